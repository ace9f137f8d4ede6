"""`oh.GradientTape` (reverse-mode autodiff as an op handler) against `tf.GradientTape`.

Times, in one process, both tapes on two cases:

  keras-mlp-step  an eager Keras 3 training step of an MLP (64 -> 256 relu -> 256 relu
                  -> 10, batch 128, sparse categorical cross-entropy from logits, SGD):
                  forward under the tape, `tape.gradient` over the trainable variables,
                  `optimizer.apply_gradients`
  chain-100       100 ops on a 4x4 float32 tensor (`h = tf.sin(h) * 1.01`, 50 times)
                  under the tape, then `tape.gradient(h, a)`; the forward alone is timed
                  as a separate configuration, so the backward is reported as the
                  difference

Before timing, both tapes must give the same gradients (allclose, 1e-5) on each case.
Configurations are interleaved (shuffled order every round) and repeated; the reported
time is the median over rounds of the mean time per call of N back-to-back calls.
Writes the `gradient_tape` section of docs/benchmarks.md and docs/gradient_tape.png.

    python benchmarks/gradient_tape.py            # full run (~1.5 min on 2 cores)
    python benchmarks/gradient_tape.py --quick    # smoke run (< 30 s, noisy numbers)
"""
import argparse
import os
import random
import sys
import time

import _common  # also puts the repository on sys.path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402
import tf_ophandlers as oh  # noqa: E402

TAPES = (("tf", "tf.GradientTape", tf.GradientTape),
         ("oh", "oh.GradientTape", oh.GradientTape))
CASES = (
    # key, title, description
    ("keras-mlp-step", "Eager Keras 3 training step, MLP 64-256-256-10, batch 128",
     "`keras.Sequential([keras.Input((64,)), Dense(256, relu), Dense(256, relu), "
     "Dense(10)])`, `SparseCategoricalCrossentropy(from_logits=True)`, "
     "`keras.optimizers.SGD(0.01)`, fixed batch of 128. One call is `with Tape() as t: "
     "loss = loss_fn(y, model(x))`, `grads = t.gradient(loss, "
     "model.trainable_variables)`, `opt.apply_gradients(zip(grads, "
     "model.trainable_variables))`. Each tape trains its own model and optimizer, built "
     "identically (`keras.utils.set_random_seed(0)` before each), so the two share no "
     "variables or optimizer state."),
    ("chain-100", "Chain of 100 ops on a 4x4 float32 tensor",
     "`with Tape() as t: t.watch(a); h = a; for _ in range(50): h = tf.sin(h) * 1.01` "
     "(100 recorded ops), then `t.gradient(h, a)`. *forward + gradient* times both as "
     "one call; *forward only* is a separate configuration that runs the same scope "
     "without the gradient call (*no tape* is the same 100 ops without any tape, for "
     "reference); *backward* is not timed on its own but derived as forward + gradient "
     "minus forward only (difference of the medians; its IQR is that of the same-round "
     "differences). Divide by 100 for the time per forward op."),
)
TARGET_RATIO = 1.3  # eager training step: oh.GradientTape at most 1.3x tf.GradientTape
WARMUP_CALLS = 3    # per (round, configuration), untimed
CHAIN_LEN = 50      # sin + mul pairs: 100 ops
TOLERANCE = 1e-5


# -- the cases --------------------------------------------------------------------------

def make_mlp():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10),
    ])
    return model, keras.optimizers.SGD(0.01)


def mlp_data():
    x = tf.random.stateless_normal([128, 64], seed=[1, 2])
    y = tf.random.stateless_uniform([128], seed=[3, 4], maxval=10, dtype=tf.int32)
    return x, y


def chain_input():
    return tf.random.stateless_uniform([4, 4], seed=[5, 6])


class KerasStep:
    """keras-mlp-step for one tape type: its own model and optimizer."""

    case, part = "keras-mlp-step", "step"

    def __init__(self, tape_key, tape):
        self.tape_key, self.tape = tape_key, tape
        self.model, self.opt = make_mlp()
        self.x, self.y = mlp_data()
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.times = []

    def gradients(self):
        with self.tape() as t:
            loss = self.loss_fn(self.y, self.model(self.x))
        return t.gradient(loss, self.model.trainable_variables)

    def call(self):
        model, opt, tape, loss_fn, x, y = (self.model, self.opt, self.tape, self.loss_fn,
                                           self.x, self.y)
        with tape() as t:
            loss = loss_fn(y, model(x))
        grads = t.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))


class Chain:
    """chain-100 for one tape type: forward + gradient, or forward only."""

    case = "chain-100"

    def __init__(self, tape_key, tape, part):
        self.tape_key, self.tape, self.part = tape_key, tape, part
        self.a = chain_input()
        self.times = []
        self.call = {"full": self.full, "fwd": self.forward}[part] if tape else self.plain

    def gradients(self):
        return [self.full()]

    def full(self):
        a = self.a
        with self.tape() as t:
            t.watch(a)
            h = a
            for _ in range(CHAIN_LEN):
                h = tf.sin(h) * 1.01
        return t.gradient(h, a)

    def forward(self):
        a = self.a
        with self.tape() as t:
            t.watch(a)
            h = a
            for _ in range(CHAIN_LEN):
                h = tf.sin(h) * 1.01
        return h

    def plain(self):
        h = self.a
        for _ in range(CHAIN_LEN):
            h = tf.sin(h) * 1.01
        return h


def make_configs():
    configs = []
    for key, _, tape in TAPES:
        configs.append(KerasStep(key, tape))
    for key, _, tape in TAPES:
        configs.append(Chain(key, tape, "full"))
        configs.append(Chain(key, tape, "fwd"))
    configs.append(Chain("none", None, "fwd"))
    return configs


def check_gradients(configs):
    """Sanity (untimed): both tapes give the same gradients on each case, and
    oh.GradientTape really is a handler on the stack inside its scope."""
    with oh.GradientTape() as t:
        assert any(h is t for h in oh.current_stack().handlers), "oh tape not on the stack"
    report = {}
    for case in ("keras-mlp-step", "chain-100"):
        by_tape = {c.tape_key: c for c in configs
                   if c.case == case and c.tape_key in ("tf", "oh") and
                   c.part in ("step", "full")}
        g_tf = by_tape["tf"].gradients()
        g_oh = by_tape["oh"].gradients()
        assert len(g_tf) == len(g_oh), (case, len(g_tf), len(g_oh))
        worst = 0.0
        for a, b in zip(g_tf, g_oh):
            assert a is not None and b is not None, (case, a, b)
            a, b = np.asarray(a), np.asarray(b)
            assert a.shape == b.shape, (case, a.shape, b.shape)
            np.testing.assert_allclose(b, a, rtol=TOLERANCE, atol=TOLERANCE,
                                       err_msg="%s: oh.GradientTape != tf.GradientTape"
                                       % case)
            worst = max(worst, float(np.max(np.abs(a - b))) if a.size else 0.0)
        report[case] = (len(g_tf), worst)
    return report


# -- measurement ------------------------------------------------------------------------

def measure(configs, rounds, n_keras, n_chain, seed=0):
    n_of = {"keras-mlp-step": n_keras, "chain-100": n_chain}

    def run(cfg, n):
        for _ in range(WARMUP_CALLS):
            cfg.call()
        return _common.time_per_call(cfg.call, n)

    for cfg in configs:  # warm-up: one untimed pass per configuration
        run(cfg, max(1, n_of[cfg.case] // 5))
    rng = random.Random(seed)
    for r in range(rounds):
        order = list(configs)
        rng.shuffle(order)
        for cfg in order:
            cfg.times.append(run(cfg, n_of[cfg.case]))
        print("round %d/%d done" % (r + 1, rounds), file=sys.stderr)
    # milliseconds per call, one entry per round
    return {(cfg.case, cfg.part, cfg.tape_key): [t * 1e3 for t in cfg.times]
            for cfg in configs}


def _stats(ts):
    q1, q3 = _common.quartiles(ts)
    return {"ms": _common.median(ts), "q1": q1, "q3": q3, "min": min(ts), "rounds": ts}


def summarize(times):
    """(case, part) -> {tape_key: stats}; parts: step | full, fwd, bwd (derived)."""
    out = {}
    for (case, part, key), ts in times.items():
        out.setdefault((case, part), {})[key] = _stats(ts)
    for key in ("tf", "oh"):
        full, fwd = out[("chain-100", "full")][key], out[("chain-100", "fwd")][key]
        diffs = [f - w for f, w in zip(full["rounds"], fwd["rounds"])]
        q1, q3 = _common.quartiles(diffs)
        out.setdefault(("chain-100", "bwd"), {})[key] = {
            "ms": full["ms"] - fwd["ms"], "q1": q1, "q3": q3, "min": None,
            "rounds": diffs}
    for row in out.values():
        if "tf" in row and "oh" in row:
            tf_, oh_ = row["tf"], row["oh"]
            row["ratio"] = oh_["ms"] / tf_["ms"]
            row["best_ratio"] = (oh_["min"] / tf_["min"]
                                 if oh_["min"] is not None else None)
            # per-round ratios (same round, so the same disturbance): their spread
            ratios = [o / t for o, t in zip(oh_["rounds"], tf_["rounds"])]
            row["ratio_q"] = _common.quartiles(ratios)
    return out


PARTS = {
    "keras-mlp-step": (("step", "training step"),),
    "chain-100": (("full", "forward + gradient"), ("fwd", "forward only"),
                  ("bwd", "backward (derived)")),
}


def verdict(ok):
    return "**PASS**" if ok else "**MISS**"


def _fmt(x):
    return "%.3f" % x


def render_md(summary, info, args, png_name, elapsed, checks):
    L = []
    L.append("## `oh.GradientTape` vs. `tf.GradientTape` (`benchmarks/gradient_tape.py`)")
    L.append("")
    if args.quick:
        L.append("> **Quick (smoke) run**: few calls per round, numbers are noisy and not "
                 "representative. Rerun without `--quick` for the real measurement.")
        L.append("")
    L.append(
        "**Method.** One process times `tf.GradientTape` and `oh.GradientTape` (the "
        "reverse-mode autodiff op handler, same API) on each case below; a new tape is "
        "opened for every call, as in a training loop. Every configuration keeps its "
        "inputs (and, for the Keras step, its model and optimizer) for the whole run; "
        "after a warm-up pass over all configurations, each of %d rounds runs every "
        "configuration once, in a freshly shuffled order, as %d untimed + N timed "
        "back-to-back calls (N = %d for the Keras step, %d for the chain) timed with "
        "`time.perf_counter` with the garbage collector off. The table gives the median "
        "over rounds of the mean time per call, the interquartile range (IQR) of the "
        "per-round means and the best (lowest) round, which is the least disturbed by "
        "other processes; the target uses the median. *Ratio* is oh / tf of the medians; "
        "its IQR is that of the same-round ratios. Before timing, the script checks that "
        "both tapes give the same gradients (`np.allclose`, rtol = atol = %g): %s."
        % (args.rounds, WARMUP_CALLS, args.n_keras, args.n_chain, TOLERANCE,
           "; ".join("%s %d gradient tensor(s), max abs difference %.1e"
                     % (case, n, worst) for case, (n, worst) in checks.items())))
    L.append("")
    L.append(
        "**Machine.** %(nproc)s CPU(s) available (%(cpu)s), %(os)s, Python %(python)s, "
        "TensorFlow %(tensorflow)s, Keras %(keras)s (CPU, eager). Other processes (and VM "
        "steal) used %(other)s CPU cores on average during the measurement; load there "
        "widens the ranges." % info
        + " Run on %s; %d configurations, %.0f s total." % (info["date"], info["nconfigs"],
                                                          elapsed))
    L.append("")
    L.append("![time per call, tf.GradientTape vs. oh.GradientTape](%s)" % png_name)
    L.append("")
    for case, title, desc in CASES:
        L.append("### %s (`%s`)" % (title, case))
        L.append("")
        L.append(desc)
        L.append("")
        rows = []
        for part, label in PARTS[case]:
            row = summary[(case, part)]
            for key, name, _ in TAPES:
                s = row[key]
                rows.append([
                    label, name, _fmt(s["ms"]),
                    "1.00x" if key == "tf" else "%.2fx (IQR %.2f – %.2f)"
                    % (row["ratio"], row["ratio_q"][0], row["ratio_q"][1]),
                    "%s – %s" % (_fmt(s["q1"]), _fmt(s["q3"])),
                    "—" if s["min"] is None else _fmt(s["min"]),
                ])
            if "none" in row:
                s = row["none"]
                rows.append([label, "no tape (reference)", _fmt(s["ms"]),
                             "%.2fx" % (s["ms"] / row["tf"]["ms"]),
                             "%s – %s" % (_fmt(s["q1"]), _fmt(s["q3"])), _fmt(s["min"])])
        L.append(_common.md_table(
            ["part", "tape", "ms/call", "ratio to tf.GradientTape", "IQR ms/call (rounds)",
             "best round ms/call"], rows))
        L.append("")

    step = summary[("keras-mlp-step", "step")]
    ok = step["ratio"] <= TARGET_RATIO
    chain = summary[("chain-100", "full")]
    L.append("### Target")
    L.append("")
    L.append("Target of the issue, checked against this run's medians (not tuned):")
    L.append("")
    L.append("- Eager training step (`keras-mlp-step`) at most %.1fx the time of "
             "`tf.GradientTape`; aim to beat it: %.3fx (%.3f vs %.3f ms) — %s  (best "
             "rounds: %.2fx; %s)"
             % (TARGET_RATIO, step["ratio"], step["oh"]["ms"],
                step["tf"]["ms"], verdict(ok), step["best_ratio"],
                "beats tf.GradientTape" if step["ratio"] < 1.0
                else "does not beat tf.GradientTape"))
    L.append("- `chain-100` has no target (information): forward + gradient %.2fx, forward "
             "only %.2fx, backward %.2fx." % (chain["ratio"],
                                              summary[("chain-100", "fwd")]["ratio"],
                                              summary[("chain-100", "bwd")]["ratio"]))
    L.append("")
    L.append("The verdict compares the medians with the target as measured; the best-round "
             "figures are context only. When other processes load the machine (see "
             "*Machine*), rerun on an idle machine before reading a MISS as a regression.")
    L.append("")
    L.append("Reproduce: `python benchmarks/gradient_tape.py%s` (writes this section and "
             "`%s`)." % (" --quick" if args.quick else "", png_name))
    return "\n".join(L), ok


def plot(summary, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written", file=sys.stderr)
        return False
    groups = [("keras-mlp-step", "step", "keras-mlp-step\ntraining step"),
              ("chain-100", "full", "chain-100\nforward + gradient"),
              ("chain-100", "fwd", "chain-100\nforward only"),
              ("chain-100", "bwd", "chain-100\nbackward (derived)")]
    fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(13, 4.4),
                                   gridspec_kw={"width_ratios": [3, 2]})
    xs = np.arange(len(groups))
    width = 0.38
    colors = {"tf": "tab:blue", "oh": "tab:orange"}
    for i, (key, name, _) in enumerate(TAPES):
        ss = [summary[(c, p)][key] for c, p, _ in groups]
        ys = [s["ms"] for s in ss]
        err = [[max(0.0, s["ms"] - s["q1"]) for s in ss],
               [max(0.0, s["q3"] - s["ms"]) for s in ss]]
        pos = xs + (i - 0.5) * width
        ax.bar(pos, ys, width, yerr=err, capsize=3, color=colors[key],
               label="%s (median, IQR of rounds)" % name)
        if key == "oh":
            for x, s, (c, p, _) in zip(pos, ss, groups):
                ax.annotate("%.2fx" % summary[(c, p)]["ratio"], (x, max(s["ms"], s["q3"])),
                            textcoords="offset points", xytext=(0, 3), ha="center",
                            fontsize=8)
    ax.set_xticks(xs)
    ax.set_xticklabels([g[2] for g in groups], fontsize=8)
    ax.set_ylabel("ms per call")
    ax.set_title("time per call (label: oh / tf)", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    top = max(summary[(c, p)][k]["q3"] for c, p, _ in groups for k in ("tf", "oh"))
    ax.set_ylim(0, top * 1.2)

    ratios = [summary[(c, p)]["ratio"] for c, p, _ in groups]
    lo = [r - summary[(c, p)]["ratio_q"][0] for r, (c, p, _) in zip(ratios, groups)]
    hi = [summary[(c, p)]["ratio_q"][1] - r for r, (c, p, _) in zip(ratios, groups)]
    ax_r.bar(xs, ratios, 0.6, yerr=[[max(0.0, v) for v in lo], [max(0.0, v) for v in hi]],
             capsize=3, color=["tab:orange"] + ["tab:gray"] * (len(groups) - 1))
    ax_r.axhline(1.0, color="black", lw=0.8, label="parity with tf.GradientTape")
    ax_r.axhline(TARGET_RATIO, color="tab:red", ls=":", lw=1,
                 label="target (training step): %.1fx" % TARGET_RATIO)
    for x, r, h in zip(xs, ratios, hi):
        ax_r.annotate("%.2fx" % r, (x, r + max(0.0, h)), textcoords="offset points",
                      xytext=(0, 3), ha="center", fontsize=8,
                      bbox=dict(fc="white", ec="none", pad=0.5))
    ax_r.set_xticks(xs)
    ax_r.set_xticklabels([g[2] for g in groups], fontsize=7)
    ax_r.set_ylabel("oh.GradientTape / tf.GradientTape")
    ax_r.set_title("ratio of medians (IQR of same-round ratios)", fontsize=9)
    ax_r.set_ylim(0, max(max(ratios) + max(hi + [0]), TARGET_RATIO) * 1.25)
    ax_r.grid(axis="y", alpha=0.3)
    ax_r.legend(fontsize=7, loc="upper left")
    fig.suptitle("tf-ophandlers: oh.GradientTape vs. tf.GradientTape (eager, same run)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: fewer calls and rounds (< 30 s, noisy)")
    p.add_argument("--out", default=_common.DEFAULT_MD,
                   help="markdown file to update (default: docs/benchmarks.md); the plot "
                        "is written next to it as gradient_tape.png")
    p.add_argument("--rounds", type=int, help="rounds (default 30, quick 3)")
    p.add_argument("--n-keras", type=int, help="timed training steps per round "
                                               "(default 30, quick 10)")
    p.add_argument("--n-chain", type=int, help="timed chain calls per round "
                                               "(default 30, quick 10)")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 30)
    args.n_keras = args.n_keras or (10 if args.quick else 30)
    args.n_chain = args.n_chain or (10 if args.quick else 30)

    start = time.perf_counter()
    info = _common.machine_info()
    info["keras"] = keras.__version__
    configs = make_configs()
    info["nconfigs"] = len(configs)
    checks = check_gradients(configs)
    other = _common.OtherLoad()
    times = measure(configs, args.rounds, args.n_keras, args.n_chain)
    other = other.cores()
    info["other"] = "n/a" if other is None else "%.2f" % other
    summary = summarize(times)
    elapsed = time.perf_counter() - start

    png_name = "gradient_tape.png"
    png_path = os.path.join(os.path.dirname(os.path.abspath(args.out)), png_name)
    os.makedirs(os.path.dirname(png_path), exist_ok=True)
    plotted = plot(summary, png_path)
    body, ok = render_md(summary, info, args, png_name, elapsed, checks)
    if not plotted:
        body = body.replace(
            "![time per call, tf.GradientTape vs. oh.GradientTape](%s)" % png_name,
            "(plot not written: matplotlib is not installed)")
    _common.write_section(args.out, "gradient_tape", body)

    for case, _, _ in CASES:
        for part, _ in PARTS[case]:
            row = summary[(case, part)]
            print("%-15s %-5s tf %8.3f ms  oh %8.3f ms  %5.2fx"
                  % (case, part, row["tf"]["ms"], row["oh"]["ms"], row["ratio"]))
    step = summary[("keras-mlp-step", "step")]
    print("target: keras-mlp-step %.3fx <= %.1fx %s" % (step["ratio"], TARGET_RATIO,
                                                      "PASS" if ok else "MISS"))
    print("wrote %s%s (%.0f s)" % (args.out, " and " + png_path if plotted else "",
                                   elapsed))


if __name__ == "__main__":
    main()
