"""`oh.ForwardAccumulator` (forward-mode autodiff as an op handler) against
`tf.autodiff.ForwardAccumulator`.

Times, in one process, both accumulators on three cases:

  add-per-op  the per-op eager cost of forward mode: N back-to-back `tf.add(a, b)` on
              2x2 float32 tensors, both watched with tangents, inside an accumulator
              scope opened once per round (plain eager `tf.add` without an accumulator
              as a reference)
  mlp-hvp     a Hessian-vector product of an MLP loss with respect to its weights,
              forward-over-reverse: accumulator around a gradient tape, `acc.jvp` of
              the gradients (`tf.GradientTape` with TensorFlow's accumulator,
              `oh.GradientTape` with ours); plain `tf.Variable`s, no Keras
  chain-50    50 elementwise ops on a 4x4 tensor (`h = tf.sin(h) * 1.01`, 25 times)
              under the accumulator, then `acc.jvp(h)` (information, no target)

Before timing, both accumulators must give the same JVPs on each case (allclose; the
HVP is also checked against a reverse-over-reverse HVP with nested `tf.GradientTape`s);
the script exits non-zero otherwise. Configurations are interleaved (shuffled order
every round) and repeated; the reported time is the median over rounds of the mean time
per op / call of N back-to-back ops / calls.
Writes the `forward_accumulator` section of docs/benchmarks.md and
docs/forward_accumulator.png.

    python benchmarks/forward_accumulator.py            # full run (~1.5 min on 2 cores)
    python benchmarks/forward_accumulator.py --quick    # smoke run (< 30 s, noisy numbers)
"""
import contextlib
import os
import time

import _common  # also puts the repository on sys.path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_ophandlers as oh  # noqa: E402

ACCS = (("tf", "tf.autodiff.ForwardAccumulator", tf.autodiff.ForwardAccumulator,
         tf.GradientTape),
        ("oh", "oh.ForwardAccumulator", oh.ForwardAccumulator, oh.GradientTape))
NAMES = {key: name for key, name, _, _ in ACCS}
CASES = (
    # key, title, per-op?, description
    ("add-per-op", "Per-op cost: tf.add of two 2x2 float32 tensors, both watched", True,
     "`a`, `b` are ordinary 2x2 float32 tensors created outside the scope, watched with "
     "tangents `ta`, `tb`. Once per round: `with Acc([a, b], [ta, tb]):`, then, inside "
     "that already-entered scope, %d untimed and N timed back-to-back `tf.add(a, b)` "
     "(each result is dropped at once; nothing accumulates). With "
     "`oh.ForwardAccumulator` the inputs are physical tensors copied onto the "
     "accumulator's stack by each op and every result lives on that stack. *no "
     "accumulator* is the same loop in plain eager TensorFlow, for reference. Times are "
     "per `tf.add`."),
    ("mlp-hvp", "Hessian-vector product of an MLP loss (forward-over-reverse)", False,
     "Plain `tf.Variable`s (no Keras): x [64, 32], W1 [32, 64], b1 [64], W2 [64, 10], "
     "b2 [10], fixed targets y [64, 10]; `loss = reduce_mean(square(tanh(x @ W1 + b1) "
     "@ W2 + b2 - y))`. One call is `with Acc(weights, vecs) as acc: with Tape() as "
     "tape: loss = ...`, `grads = tape.gradient(loss, weights)` (inside the "
     "accumulator), then `acc.jvp(grads)`: TensorFlow's accumulator with "
     "`tf.GradientTape`, ours with `oh.GradientTape`. Each accumulator uses its own, "
     "identically initialized variables. *no accumulator* is the loss and "
     "`tf.GradientTape` gradient alone (what the HVP adds forward mode to), for "
     "reference."),
    ("chain-50", "Chain of 50 elementwise ops on a 4x4 float32 tensor, then jvp", False,
     "`with Acc(a, ta) as acc: h = a; for _ in range(25): h = tf.sin(h) * 1.01` (50 "
     "ops, each carrying a tangent), then `acc.jvp(h)`; one call opens a new "
     "accumulator. *no accumulator* is the same 50 ops in plain eager TensorFlow. "
     "Divide by 50 for the time per op."),
)
TARGET_SPEEDUP = 10.0  # per-op eager forward mode at least 10x faster than TensorFlow's
WARMUP_OPS = 20        # add-per-op: per (round, configuration), inside the scope, untimed
WARMUP_CALLS = 3       # mlp-hvp, chain-50: per (round, configuration), untimed
CHAIN_LEN = 25         # sin + mul pairs: 50 ops
TOLERANCE = {"add-per-op": 1e-5, "mlp-hvp": 1e-4, "chain-50": 1e-5}


def fail(msg):
    """Sanity failure: raised explicitly (not `assert`), so `python -O` still exits 1."""
    raise AssertionError(msg)


# -- the cases --------------------------------------------------------------------------

def add_inputs():
    a = tf.random.stateless_uniform([2, 2], seed=[1, 2])
    b = tf.random.stateless_uniform([2, 2], seed=[3, 4])
    ta = tf.random.stateless_normal([2, 2], seed=[5, 6])
    tb = tf.random.stateless_normal([2, 2], seed=[7, 8])
    return a, b, ta, tb


MLP_SHAPES = ([32, 64], [64], [64, 10], [10])


def mlp_data():
    x = tf.random.stateless_normal([64, 32], seed=[11, 12])
    y = tf.random.stateless_normal([64, 10], seed=[13, 14])
    vecs = [tf.random.stateless_normal(s, seed=[30 + i, 1])
            for i, s in enumerate(MLP_SHAPES)]
    return x, y, vecs


def mlp_weights():
    scales = (1 / np.sqrt(32), 0.1, 1 / np.sqrt(64), 0.1)
    return [tf.Variable(tf.random.stateless_normal(s, seed=[20 + i, 2]) * scale,
                        name=n)
            for i, (s, scale, n) in enumerate(zip(MLP_SHAPES, scales,
                                                  ("W1", "b1", "W2", "b2")))]


def mlp_loss(x, y, w):
    w1, b1, w2, b2 = w
    return tf.reduce_mean(tf.square(tf.matmul(tf.tanh(tf.matmul(x, w1) + b1), w2) + b2
                                    - y))


def chain_inputs():
    a = tf.random.stateless_uniform([4, 4], seed=[40, 41])
    ta = tf.random.stateless_normal([4, 4], seed=[42, 43])
    return a, ta


class AddPerOp:
    """add-per-op for one accumulator type (None: plain eager reference)."""

    case = "add-per-op"

    def __init__(self, key, acc):
        self.key, self.acc = key, acc
        self.a, self.b, self.ta, self.tb = add_inputs()
        self.times = []

    def scope(self):
        if self.acc is None:
            return contextlib.nullcontext()
        return self.acc([self.a, self.b], [self.ta, self.tb])

    def run(self, n):
        """Opens the scope once, then WARMUP_OPS untimed and `n` timed adds in it."""
        a, b, add = self.a, self.b, tf.add
        with self.scope():
            def one():
                return add(a, b)  # the caller drops it: only the last result is alive

            return _common.warm_time(one, WARMUP_OPS, n)

    def jvps(self):
        """One add under the accumulator; (jvp, checks that it ran where intended)."""
        with self.acc([self.a, self.b], [self.ta, self.tb]) as acc:
            y = tf.add(self.a, self.b)
            if self.key == "oh":
                if not any(h is acc for h in oh.current_stack().handlers):
                    fail("add-per-op: oh.ForwardAccumulator not on the stack in its scope")
                if oh.handler_of(y) is None:
                    fail("add-per-op: the add's result is not on the accumulator's stack")
                if oh.handler_of(self.a) is not None:
                    fail("add-per-op: input a is not a physical tensor")
        return [acc.jvp(y)], [self.ta + self.tb]


class MlpHvp:
    """mlp-hvp for one accumulator type: its own variables (None: gradient only)."""

    case = "mlp-hvp"

    def __init__(self, key, acc, tape):
        self.key, self.acc, self.tape = key, acc, tape
        self.x, self.y, self.vecs = mlp_data()
        self.w = mlp_weights()
        self.times = []
        self.call = self.hvp if acc is not None else self.gradient

    def hvp(self):
        x, y, w = self.x, self.y, self.w
        with self.acc(w, self.vecs) as acc:
            with self.tape() as tape:
                loss = mlp_loss(x, y, w)
            grads = tape.gradient(loss, w)
        return acc.jvp(grads)

    def gradient(self):
        with tf.GradientTape() as tape:
            loss = mlp_loss(self.x, self.y, self.w)
        return tape.gradient(loss, self.w)

    def run(self, n):
        return _common.warm_time(self.call, WARMUP_CALLS, n)

    def jvps(self):
        """(HVP, reference HVP by reverse-over-reverse with nested tf.GradientTape)."""
        x, y, w = self.x, self.y, self.w
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                loss = mlp_loss(x, y, w)
            grads = inner.gradient(loss, w)
            gv = tf.add_n([tf.reduce_sum(g * v) for g, v in zip(grads, self.vecs)])
        return list(self.hvp()), list(outer.gradient(gv, w))


class Chain:
    """chain-50 for one accumulator type (None: the ops alone)."""

    case = "chain-50"

    def __init__(self, key, acc):
        self.key, self.acc = key, acc
        self.a, self.ta = chain_inputs()
        self.times = []
        self.call = self.jvp if acc is not None else self.plain

    def jvp(self):
        with self.acc(self.a, self.ta) as acc:
            h = self.a
            for _ in range(CHAIN_LEN):
                h = tf.sin(h) * 1.01
        return acc.jvp(h)

    def plain(self):
        h = self.a
        for _ in range(CHAIN_LEN):
            h = tf.sin(h) * 1.01
        return h

    def run(self, n):
        return _common.warm_time(self.call, WARMUP_CALLS, n)

    def jvps(self):
        """(JVP, analytic JVP: d/dx of 1.01 sin(x) is 1.01 cos(x), chained)."""
        h, t = self.a, self.ta
        for _ in range(CHAIN_LEN):
            h, t = tf.sin(h) * 1.01, t * tf.cos(h) * 1.01
        return [self.jvp()], [t]


def make_configs():
    configs = []
    for key, _, acc, _ in ACCS:
        configs.append(AddPerOp(key, acc))
    configs.append(AddPerOp("none", None))
    for key, _, acc, tape in ACCS:
        configs.append(MlpHvp(key, acc, tape))
    configs.append(MlpHvp("none", None, None))
    for key, _, acc, _ in ACCS:
        configs.append(Chain(key, acc))
    configs.append(Chain("none", None))
    return configs


def check_jvps(configs):
    """Sanity (untimed; each accumulator's first calls in the process): both give the same
    JVPs on each case, and these match an independent reference. Returns, per case, the
    number of JVP tensors, the max abs differences oh-tf and tf-reference, and the wall
    time of each accumulator's first call (incl. one-time tracing)."""
    report = {}
    for case, _, _, _ in CASES:
        by_key = {c.key: c for c in configs if c.case == case}
        tol = TOLERANCE[case]
        got, first = {}, {}
        for key in ("tf", "oh"):
            t0 = time.perf_counter()
            got[key] = by_key[key].jvps()
            first[key] = (time.perf_counter() - t0) * 1e3
        (j_tf, ref), (j_oh, _) = got["tf"], got["oh"]
        if not len(j_tf) == len(j_oh) == len(ref):
            fail("%s: %d / %d / %d JVP tensors" % (case, len(j_tf), len(j_oh), len(ref)))
        worst, worst_ref = 0.0, 0.0
        for a, b, r in zip(j_tf, j_oh, ref):
            if a is None or b is None:
                fail("%s: missing JVP (tf %r, oh %r)" % (case, a, b))
            a, b, r = np.asarray(a), np.asarray(b), np.asarray(r)
            if not a.shape == b.shape == r.shape:
                fail("%s: shapes %s / %s / %s" % (case, a.shape, b.shape, r.shape))
            np.testing.assert_allclose(
                b, a, rtol=tol, atol=tol,
                err_msg="%s: oh.ForwardAccumulator != tf.autodiff.ForwardAccumulator" % case)
            np.testing.assert_allclose(
                a, r, rtol=tol, atol=tol,
                err_msg="%s: tf.autodiff.ForwardAccumulator != reference" % case)
            worst = max(worst, float(np.max(np.abs(a - b))) if a.size else 0.0)
            worst_ref = max(worst_ref, float(np.max(np.abs(a - r))) if a.size else 0.0)
        report[case] = {"n": len(j_tf), "worst": worst, "worst_ref": worst_ref,
                        "first_ms": first}
    return report


# -- measurement ------------------------------------------------------------------------

def measure(configs, rounds, n_add, n_hvp, n_chain, seed=0):
    n_of = {"add-per-op": n_add, "mlp-hvp": n_hvp, "chain-50": n_chain}
    _common.run_rounds(configs, rounds, lambda cfg: n_of[cfg.case], seed=seed)
    # µs per op (add-per-op) or ms per call (the others), one entry per round
    per_op = {c[0]: c[2] for c in CASES}
    return {(cfg.case, cfg.key): [t * (1e6 if per_op[cfg.case] else 1e3)
                                  for t in cfg.times] for cfg in configs}


def summarize(times):
    """case -> {key: stats, "speedup": tf / oh of the medians, ...}."""
    out = {}
    for (case, key), ts in times.items():
        out.setdefault(case, {})[key] = _common.stats(ts)
    for row in out.values():
        tf_, oh_ = row["tf"], row["oh"]
        row["ratio"] = oh_["t"] / tf_["t"]
        row["speedup"] = tf_["t"] / oh_["t"]
        row["best_speedup"] = tf_["min"] / oh_["min"]
        row["speedup_q"] = _common.round_ratio_quartiles(tf_["rounds"], oh_["rounds"])
    return out


def _fmt(x, per_op):
    return ("%.2f" if per_op else "%.3f") % x


REF_LABEL = {"add-per-op": "no accumulator, plain eager (reference)",
             "mlp-hvp": "no accumulator: loss + tf.GradientTape gradient (reference)",
             "chain-50": "no accumulator, plain eager (reference)"}


def render_md(summary, info, args, png_name, plotted, elapsed, checks):
    method = (
        "One process times `tf.autodiff.ForwardAccumulator` and "
        "`oh.ForwardAccumulator` (the forward-mode autodiff op handler, same API) on each "
        "case below. Every configuration keeps its inputs (and, for the HVP, its "
        "variables) for the whole run. TensorFlow's accumulator computes each op's JVP by "
        "calling a `tf.function` that it traces once per op signature on first use; those "
        "one-time costs are excluded from the timings: before timing, an untimed sanity "
        "check runs every case once, then a warm-up pass runs every configuration with "
        "N/5 calls, and every timed batch is preceded by untimed calls in the same "
        "configuration, so the rounds measure the steady state. Each of %d rounds runs "
        "every configuration once, in a freshly shuffled order: for `add-per-op` the "
        "accumulator scope is entered once and %d untimed + N timed `tf.add`s run in it "
        "(N = %d), for the others %d untimed + N timed back-to-back calls (N = %d for "
        "`mlp-hvp`, %d for `chain-50`), each call opening a new accumulator; all timed "
        "with `time.perf_counter` with the garbage collector off (after a `gc.collect()`; the "
        "objects alive after setup are frozen with `gc.freeze()` so that collection stays "
        "short). The tables give the "
        "median over rounds of the mean time per op / call, the interquartile range (IQR) "
        "of the per-round means and the best (lowest) round, which is the least disturbed "
        "by other processes; the target uses the median. *Ratio* is this / tf of the "
        "medians; *speedup* is tf / oh of the medians, its IQR that of the same-round "
        "speedups. The sanity check requires both accumulators to give the same JVPs "
        "(`np.allclose`) and TensorFlow's to match an independent reference (add: "
        "`ta + tb`; HVP: reverse-over-reverse with nested `tf.GradientTape`s; chain: the "
        "JVP written out with `tf.cos`), else the script exits non-zero: %s. "
        "As the check is each accumulator's first use in the process, its wall time "
        "shows the one-time costs (single measurement, tf first): %s."
        % (args.rounds, WARMUP_OPS, args.n_add, WARMUP_CALLS, args.n_hvp, args.n_chain,
           "; ".join("%s %d JVP tensor(s), max abs difference oh – tf %.1e, tf – reference "
                     "%.1e (rtol = atol = %g)"
                     % (case, c["n"], c["worst"], c["worst_ref"], TOLERANCE[case])
                     for case, c in checks.items()),
           "; ".join("%s tf %.0f ms, oh %.0f ms" % (case, c["first_ms"]["tf"],
                                                    c["first_ms"]["oh"])
                     for case, c in checks.items())))
    L = _common.intro_md(
        "`oh.ForwardAccumulator` vs. `tf.autodiff.ForwardAccumulator` "
        "(`benchmarks/forward_accumulator.py`)", args.quick, method,
        _common.machine_md(info, info["nconfigs"], elapsed),
        _common.image_md("time per op / call, tf.autodiff.ForwardAccumulator vs. "
                         "oh.ForwardAccumulator", png_name, plotted))
    for case, title, per_op, desc in CASES:
        unit = "µs/op" if per_op else "ms/call"
        row = summary[case]
        tf_t = row["tf"]["t"]
        rows = []
        for key, label in (("tf", NAMES["tf"]), ("oh", NAMES["oh"]),
                           ("none", REF_LABEL[case])):
            s = row[key]
            rows.append([
                label, _fmt(s["t"], per_op), "%.3fx" % (s["t"] / tf_t),
                "1.00x" if key == "tf" else
                ("%.1fx (IQR %.1f – %.1f)" % (row["speedup"], row["speedup_q"][0],
                                              row["speedup_q"][1])
                 if key == "oh" else "%.1fx" % (tf_t / s["t"])),
                "%s – %s" % (_fmt(s["q1"], per_op), _fmt(s["q3"], per_op)),
                _fmt(s["min"], per_op),
            ])
        L += _common.case_md(
            "%s (`%s`)" % (title, case), desc % WARMUP_OPS if per_op else desc,
            ["accumulator", unit, "ratio to tf (this / tf)", "speedup (tf / this)",
             "IQR %s (rounds)" % unit, "best round %s" % unit], rows)

    add = summary["add-per-op"]
    ok = add["speedup"] >= TARGET_SPEEDUP
    T = []
    T.append("- Per-op eager forward mode (`add-per-op`) at least %.0fx faster than "
             "TensorFlow's accumulator (`tf.autodiff.ForwardAccumulator`: %.0f µs per "
             "`tf.add`): %.1fx (%.2f vs %.2f µs per "
             "op) — %s  (best rounds: %.1fx; plain eager `tf.add`: %.2f µs, so forward "
             "mode adds %.2f µs per op with `oh.ForwardAccumulator` and %.2f µs with "
             "TensorFlow's)"
             % (TARGET_SPEEDUP, add["tf"]["t"], add["speedup"],
                add["oh"]["t"], add["tf"]["t"], _common.verdict(ok), add["best_speedup"],
                add["none"]["t"], add["oh"]["t"] - add["none"]["t"],
                add["tf"]["t"] - add["none"]["t"]))
    T.append("- `mlp-hvp` and `chain-50` have no target (information): speedup %.1fx "
             "and %.1fx (oh / tf %.3fx and %.3fx)."
             % (summary["mlp-hvp"]["speedup"], summary["chain-50"]["speedup"],
                summary["mlp-hvp"]["ratio"], summary["chain-50"]["ratio"]))
    L += _common.targets_md(T, "forward_accumulator", args.quick, png_name)
    return "\n".join(L), ok


def plot(summary, plt):
    fig, axes = plt.subplots(1, len(CASES) + 1, figsize=(15, 4.4),
                             gridspec_kw={"width_ratios": [1] * len(CASES) + [1.2]})
    colors = {"tf": "tab:blue", "oh": "tab:orange", "none": "tab:gray"}
    labels = {"tf": "tf.autodiff.\nForwardAcc.", "oh": "oh.\nForwardAcc.",
              "none": "no accumulator\n(reference)"}
    for ax, (case, title, per_op, _) in zip(axes, CASES):
        row = summary[case]
        keys = ("tf", "oh", "none")
        ss = [row[k] for k in keys]
        xs = np.arange(len(keys))
        ax.bar(xs, [s["t"] for s in ss], 0.6, yerr=_common.iqr_err(ss), capsize=3,
               color=[colors[k] for k in keys])
        _common.label_bars(ax, xs, [max(s["t"], s["q3"]) for s in ss],
                           [_fmt(s["t"], per_op) for s in ss])
        ax.set_xticks(xs)
        ax.set_xticklabels([labels[k] for k in keys], fontsize=7)
        ax.set_ylabel("µs per tf.add" if per_op else "ms per call")
        ax.set_title("%s\n(median, IQR of rounds)" % case, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylim(0, max(s["q3"] for s in ss) * 1.18)

    ax_r = axes[-1]
    xs = np.arange(len(CASES))
    sp = [summary[c[0]]["speedup"] for c in CASES]
    lo, hi = _common.spread(sp, [summary[c[0]]["speedup_q"] for c in CASES])
    ax_r.bar(xs, sp, 0.6, yerr=[lo, hi], capsize=3,
             color=["tab:orange"] + ["tab:gray"] * (len(CASES) - 1))
    ax_r.axhline(1.0, color="black", lw=0.8, label="parity with TensorFlow's")
    ax_r.axhline(TARGET_SPEEDUP, color="tab:red", ls=":", lw=1,
                 label="target (add-per-op): %.0fx" % TARGET_SPEEDUP)
    _common.label_bars(ax_r, xs, [s + h for s, h in zip(sp, hi)],
                       ["%.1fx" % s for s in sp], boxed=True)
    ax_r.set_xticks(xs)
    ax_r.set_xticklabels([c[0] for c in CASES], fontsize=8)
    ax_r.set_ylabel("speedup: tf time / oh time")
    ax_r.set_title("speedup of oh (IQR of same-round speedups)", fontsize=9)
    ax_r.set_ylim(0, max(max(s + h for s, h in zip(sp, hi)), TARGET_SPEEDUP) * 1.25)
    ax_r.grid(axis="y", alpha=0.3)
    ax_r.legend(fontsize=7, loc="upper right")
    fig.suptitle("tf-ophandlers: oh.ForwardAccumulator vs. tf.autodiff.ForwardAccumulator "
                 "(eager, same run)", fontsize=10)
    return fig


def main(argv=None):
    args = _common.parse_args(
        argv, __doc__, "forward_accumulator", (30, 3),
        [("n-add", "timed tf.adds per round", 500, 50),
         ("n-hvp", "timed HVP calls per round", 15, 3),
         ("n-chain", "timed chain calls per round", 15, 3)])

    start = time.perf_counter()
    info = _common.machine_info()
    configs = make_configs()
    info["nconfigs"] = len(configs)
    checks = check_jvps(configs)
    times = _common.measure_under_load(
        info, lambda: measure(configs, args.rounds, args.n_add, args.n_hvp, args.n_chain),
        freeze=True)
    summary = summarize(times)
    elapsed = time.perf_counter() - start

    ok, png_path = _common.publish(
        args.out, "forward_accumulator", lambda plt: plot(summary, plt),
        lambda png_name, plotted: render_md(summary, info, args, png_name, plotted,
                                            elapsed, checks))

    for case, _, per_op, _ in CASES:
        row = summary[case]
        unit = "us/op" if per_op else "ms"
        print("%-11s tf %9.3f %-5s  oh %8.3f %-5s  none %8.3f %-5s  speedup %5.1fx"
              % (case, row["tf"]["t"], unit, row["oh"]["t"], unit, row["none"]["t"],
                 unit, row["speedup"]))
    add = summary["add-per-op"]
    print("target: add-per-op speedup %.1fx >= %.0fx %s"
          % (add["speedup"], TARGET_SPEEDUP, "PASS" if ok else "MISS"))
    _common.print_wrote(args.out, png_path, elapsed)


if __name__ == "__main__":
    main()
