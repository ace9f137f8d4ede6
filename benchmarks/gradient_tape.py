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
import os
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
        t, h = self.forward_taped()
        return t.gradient(h, self.a)

    def forward(self):
        return self.forward_taped()[1]

    def forward_taped(self):
        """The 100 ops under a new tape watching `a`: (tape, result)."""
        with self.tape() as t:
            t.watch(self.a)
            h = self.plain()
        return t, h

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
    _common.run_rounds(configs, rounds, lambda cfg: n_of[cfg.case],
                       lambda cfg, n: _common.warm_time(cfg.call, WARMUP_CALLS, n), seed)
    # milliseconds per call, one entry per round
    return {(cfg.case, cfg.part, cfg.tape_key): [t * 1e3 for t in cfg.times]
            for cfg in configs}


def summarize(times):
    """(case, part) -> {tape_key: stats}; parts: step | full, fwd, bwd (derived)."""
    out = {}
    for (case, part, key), ts in times.items():
        out.setdefault((case, part), {})[key] = _common.stats(ts, "ms")
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
            row["ratio_q"] = _common.round_ratio_quartiles(oh_["rounds"], tf_["rounds"])
    return out


PARTS = {
    "keras-mlp-step": (("step", "training step"),),
    "chain-100": (("full", "forward + gradient"), ("fwd", "forward only"),
                  ("bwd", "backward (derived)")),
}


def _fmt(x):
    return "%.3f" % x


def render_md(summary, info, args, png_name, plotted, elapsed, checks):
    method = (
        "One process times `tf.GradientTape` and `oh.GradientTape` (the "
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
    L = _common.intro_md(
        "`oh.GradientTape` vs. `tf.GradientTape` (`benchmarks/gradient_tape.py`)",
        args.quick, method, _common.machine_md(info, info["nconfigs"], elapsed),
        _common.image_md("time per call, tf.GradientTape vs. oh.GradientTape", png_name,
                         plotted))
    for case, title, desc in CASES:
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
        L += _common.case_md(
            "%s (`%s`)" % (title, case), desc,
            ["part", "tape", "ms/call", "ratio to tf.GradientTape", "IQR ms/call (rounds)",
             "best round ms/call"], rows)

    step = summary[("keras-mlp-step", "step")]
    ok = step["ratio"] <= TARGET_RATIO
    chain = summary[("chain-100", "full")]
    T = []
    T.append("- Eager training step (`keras-mlp-step`) at most %.1fx the time of "
             "`tf.GradientTape`; aim to beat it: %.3fx (%.3f vs %.3f ms) — %s  (best "
             "rounds: %.2fx; %s)"
             % (TARGET_RATIO, step["ratio"], step["oh"]["ms"],
                step["tf"]["ms"], _common.verdict(ok), step["best_ratio"],
                "beats tf.GradientTape" if step["ratio"] < 1.0
                else "does not beat tf.GradientTape"))
    T.append("- `chain-100` has no target (information): forward + gradient %.2fx, forward "
             "only %.2fx, backward %.2fx." % (chain["ratio"],
                                              summary[("chain-100", "fwd")]["ratio"],
                                              summary[("chain-100", "bwd")]["ratio"]))
    L += _common.targets_md(T, "gradient_tape", args.quick, png_name)
    return "\n".join(L), ok


def plot(summary, plt):
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
        pos = xs + (i - 0.5) * width
        ax.bar(pos, [s["ms"] for s in ss], width, yerr=_common.iqr_err(ss, "ms"),
               capsize=3, color=colors[key], label="%s (median, IQR of rounds)" % name)
        if key == "oh":
            _common.label_bars(ax, pos, [max(s["ms"], s["q3"]) for s in ss],
                               ["%.2fx" % summary[(c, p)]["ratio"] for c, p, _ in groups])
    ax.set_xticks(xs)
    ax.set_xticklabels([g[2] for g in groups], fontsize=8)
    ax.set_ylabel("ms per call")
    ax.set_title("time per call (label: oh / tf)", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    top = max(summary[(c, p)][k]["q3"] for c, p, _ in groups for k in ("tf", "oh"))
    ax.set_ylim(0, top * 1.2)

    ratios = [summary[(c, p)]["ratio"] for c, p, _ in groups]
    lo, hi = _common.spread(ratios, [summary[(c, p)]["ratio_q"] for c, p, _ in groups])
    ax_r.bar(xs, ratios, 0.6, yerr=[lo, hi], capsize=3,
             color=["tab:orange"] + ["tab:gray"] * (len(groups) - 1))
    ax_r.axhline(1.0, color="black", lw=0.8, label="parity with tf.GradientTape")
    ax_r.axhline(TARGET_RATIO, color="tab:red", ls=":", lw=1,
                 label="target (training step): %.1fx" % TARGET_RATIO)
    _common.label_bars(ax_r, xs, [r + h for r, h in zip(ratios, hi)],
                       ["%.2fx" % r for r in ratios], boxed=True)
    ax_r.set_xticks(xs)
    ax_r.set_xticklabels([g[2] for g in groups], fontsize=7)
    ax_r.set_ylabel("oh.GradientTape / tf.GradientTape")
    ax_r.set_title("ratio of medians (IQR of same-round ratios)", fontsize=9)
    ax_r.set_ylim(0, max(max(ratios) + max(hi + [0]), TARGET_RATIO) * 1.25)
    ax_r.grid(axis="y", alpha=0.3)
    ax_r.legend(fontsize=7, loc="upper left")
    fig.suptitle("tf-ophandlers: oh.GradientTape vs. tf.GradientTape (eager, same run)",
                 fontsize=10)
    return fig


def main(argv=None):
    args = _common.parse_args(
        argv, __doc__, "gradient_tape", (30, 3),
        [("n-keras", "timed training steps per round", 30, 10),
         ("n-chain", "timed chain calls per round", 30, 10)])

    start = time.perf_counter()
    info = _common.machine_info()
    info["keras"] = keras.__version__
    configs = make_configs()
    info["nconfigs"] = len(configs)
    checks = check_gradients(configs)
    times = _common.measure_under_load(
        info, lambda: measure(configs, args.rounds, args.n_keras, args.n_chain))
    summary = summarize(times)
    elapsed = time.perf_counter() - start

    ok, png_path = _common.publish(
        args.out, "gradient_tape", lambda plt: plot(summary, plt),
        lambda png_name, plotted: render_md(summary, info, args, png_name, plotted,
                                            elapsed, checks))

    for case, _, _ in CASES:
        for part, _ in PARTS[case]:
            row = summary[(case, part)]
            print("%-15s %-5s tf %8.3f ms  oh %8.3f ms  %5.2fx"
                  % (case, part, row["tf"]["ms"], row["oh"]["ms"], row["ratio"]))
    step = summary[("keras-mlp-step", "step")]
    print("target: keras-mlp-step %.3fx <= %.1fx %s" % (step["ratio"], TARGET_RATIO,
                                                      "PASS" if ok else "MISS"))
    _common.print_wrote(args.out, png_path, elapsed)


if __name__ == "__main__":
    main()
