"""`tf.function` calls replayed through op handlers against plain calls of the same
function.

A `tf.function` called inside a handler scope is replayed: its first call interprets the
function's body through the handler stack into a new, handler-free `tf.function`, cached
by the handlers' summaries (`tf_ophandlers/core/functions/`); later calls hit that cache and
run the cached function as one op. Times, in one process, the same call without a handler
(`plain`) and under three handlers (the cached replay) on three cases:

  mlp-forward  `@tf.function mlp(x)`: 3 dense layers 256->256 with ReLU on x [64, 256],
               captured `tf.Variable` weights, returns the `tf.reduce_sum` of the output
  train-step   `@tf.function` training step on plain `tf.Variable`s: MLP 32->64->10
               (tanh), batch 64, `tf.GradientTape` inside the function, SGD update with
               `assign_sub`; returns the loss
  small        `tf.function(lambda a: a * 2.0 + 1.0)` on a scalar: the fixed per-call
               overhead (information, no target)

with the configurations `plain` (no handler), `oh.OpHandler()` (pass-through),
`oh.OpLogHandler()` and `oh.CheckNumericsHandler()` (its replay has a CheckNumerics op per
float output: information).

Before timing, every configuration must give the plain call's result (allclose; the
training step on its own, identically initialized variables, over its first losses), its
first call must replay (the replay cache grows) and its second hit the cache, and the
OpLogHandler must have seen the body's ops at the first call; after the timed rounds the
replay cache must have the size it had before them (every timed call was a cache hit). The
script exits non-zero otherwise. Configurations are interleaved (shuffled order every
round) and repeated; the reported time is the median over rounds of the mean time per call
of N back-to-back calls.
Writes the `functions` section of docs/benchmarks.md and docs/functions.png.

    python benchmarks/functions.py            # full run (~1.5 min on 2 cores)
    python benchmarks/functions.py --quick    # smoke run (< 30 s, noisy numbers)
"""
import contextlib
import os
import time

import _common  # also puts the repository on sys.path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_ophandlers as oh  # noqa: E402
from tf_ophandlers.core import functions as replay  # noqa: E402

HANDLERS = (
    # key, name, handler class (None: plain call)
    ("plain", "plain call (no handler)", None),
    ("pass", "oh.OpHandler()", oh.OpHandler),
    ("log", "oh.OpLogHandler()", oh.OpLogHandler),
    ("checknum", "oh.CheckNumericsHandler()", oh.CheckNumericsHandler),
)
KEYS = tuple(h[0] for h in HANDLERS)
NAMES = {key: name for key, name, _ in HANDLERS}
CASES = (
    # key, title, target?, description
    ("mlp-forward", "MLP forward pass, 3 dense layers 256->256 on [64, 256]", True,
     "`@tf.function def mlp(x)`: `h = relu(h @ W + b)` three times with 256x256 weights "
     "(`tf.Variable`s captured by the function, `stateless_normal` * 0.05, zero biases) "
     "on x [64, 256], returns `tf.reduce_sum(h)`. All configurations call the same "
     "function on the same `x` (created outside the scope)."),
    ("train-step", "Training step: MLP 32->64->10, GradientTape inside the function, SGD",
     True,
     "`@tf.function def step(x, y)`: `with tf.GradientTape() as tape: loss = "
     "reduce_mean(square(tanh(x @ W1 + b1) @ W2 + b2 - y))`, `grads = "
     "tape.gradient(loss, weights)`, `w.assign_sub(0.01 * g)` for each weight; returns "
     "the loss. Plain `tf.Variable`s (no Keras), batch 64 (x [64, 32], y [64, 10]). Each "
     "configuration has its own, identically initialized variables and its own "
     "`tf.function` (so all of them keep training during the run)."),
    ("small", "Smallest function: `a * 2.0 + 1.0` on a float32 scalar", False,
     "`tf.function(lambda a: a * 2.0 + 1.0)`, shared by all configurations: the fixed "
     "cost of a call (information, no target)."),
)
CASE_KEYS = tuple(c[0] for c in CASES)
TARGET_RATIO = 1.2  # a replayed call that hits the cache: at most 1.2x a plain call
WARMUP_CALLS = 3    # per (round, configuration), inside the scope, untimed
CHECK_STEPS = 3     # train-step: losses compared in the sanity check
LR = 0.01
TOLERANCE = {"mlp-forward": 1e-4, "train-step": 1e-5, "small": 1e-6}


def fail(msg):
    """Sanity failure: raised explicitly (not `assert`), so `python -O` still exits 1."""
    raise AssertionError(msg)


# -- the cases --------------------------------------------------------------------------

def mlp_function():
    """(`mlp`, its argument tuple): the mlp-forward function and input."""
    ws = [tf.Variable(tf.random.stateless_normal([256, 256], seed=[10 + i, 1]) * 0.05,
                      name="W%d" % (i + 1)) for i in range(3)]
    bs = [tf.Variable(tf.zeros([256]), name="b%d" % (i + 1)) for i in range(3)]
    x = tf.random.stateless_normal([64, 256], seed=[1, 2])

    @tf.function
    def mlp(x):
        h = x
        for w, b in zip(ws, bs):
            h = tf.nn.relu(tf.matmul(h, w) + b)
        return tf.reduce_sum(h)

    return mlp, (x,)


STEP_SHAPES = ([32, 64], [64], [64, 10], [10])


def step_data():
    x = tf.random.stateless_normal([64, 32], seed=[3, 4])
    y = tf.random.stateless_normal([64, 10], seed=[5, 6])
    return x, y


def step_function():
    """(`step`, its argument tuple): a training step on its own, fresh variables."""
    scales = (1 / np.sqrt(32), 0.1, 1 / np.sqrt(64), 0.1)
    w = [tf.Variable(tf.random.stateless_normal(s, seed=[20 + i, 2]) * scale, name=n)
         for i, (s, scale, n) in enumerate(zip(STEP_SHAPES, scales,
                                               ("W1", "b1", "W2", "b2")))]

    @tf.function
    def step(x, y):
        w1, b1, w2, b2 = w
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(tf.tanh(tf.matmul(x, w1) + b1), w2)
                                            + b2 - y))
        grads = tape.gradient(loss, w)
        for v, g in zip(w, grads):
            v.assign_sub(LR * g)
        return loss

    return step, step_data()


def small_function():
    return tf.function(lambda a: a * 2.0 + 1.0), (tf.constant(3.0),)


class Config:
    """One (case, handler configuration): the function, its arguments and the handler
    (created once, entered once per round)."""

    def __init__(self, case, key, handler_cls, function, args):
        self.case, self.key = case, key
        self.function, self.args = function, args
        self.handler = handler_cls() if handler_cls is not None else None
        self.times = []  # seconds per call, one per round

    def scope(self):
        return self.handler if self.handler is not None else contextlib.nullcontext()

    def call(self):
        return self.function(*self.args)

    def run(self, n):
        """Enters the scope once, then WARMUP_CALLS untimed and `n` timed calls in it."""
        call = self.call
        with self.scope():
            return _common.warm_time(call, WARMUP_CALLS, n)

    def log_size(self):
        return len(self.handler.records) if self.key == "log" else 0


def make_configs():
    """The configurations, and TensorFlow's own tracing time of each case's function
    (`get_concrete_function`, done for every function before the sanity check, so that
    first calls measure the replay alone)."""
    configs, trace_ms = [], {}
    shared = {"mlp-forward": mlp_function(), "small": small_function()}
    for case in CASE_KEYS:
        for key, _, cls in HANDLERS:
            function, args = shared[case] if case in shared else step_function()
            if case not in shared or key == "plain":
                t0 = time.perf_counter()
                function.get_concrete_function(*args)
                if key == "plain":
                    trace_ms[case] = (time.perf_counter() - t0) * 1e3
            configs.append(Config(case, key, cls, function, args))
    return configs, trace_ms


def _value(t):
    return np.asarray(t)  # a tensor on a handler stack is copied off


def check(configs):
    """Sanity (untimed; each configuration's first calls in the process): every handler
    configuration replays at its first call (the replay cache grows), hits the cache at
    the next one, and gives the plain call's results; the OpLogHandler saw the body's ops.
    Returns, per case, the max abs difference to plain, the wall time of the first call
    of each configuration and what the log saw."""
    report = {}
    for case in CASE_KEYS:
        by_key = {c.key: c for c in configs if c.case == case}
        calls = CHECK_STEPS if case == "train-step" else 2
        got, first, growth = {}, {}, {}
        for key in KEYS:
            cfg = by_key[key]
            with cfg.scope():
                size0 = replay.cache_info()
                t0 = time.perf_counter()
                values = [cfg.call()]
                first[key] = (time.perf_counter() - t0) * 1e3
                size1 = replay.cache_info()
                seen = cfg.handler.op_types_seen() if key == "log" else None
                values += [cfg.call() for _ in range(calls - 1)]
                size2 = replay.cache_info()
            got[key] = [_value(v) for v in values]
            growth[key] = (size1 - size0, size2 - size1)
            if key == "plain":
                if size1 != size0:
                    fail("%s: the plain call changed the replay cache (%d -> %d)"
                         % (case, size0, size1))
                continue
            if size1 <= size0:
                fail("%s, %s: the first call did not replay (replay cache %d -> %d)"
                     % (case, NAMES[key], size0, size1))
            if size2 != size1:
                fail("%s, %s: later calls missed the replay cache (%d -> %d)"
                     % (case, NAMES[key], size1, size2))
            if key == "log":
                body = {"mlp-forward": "MatMul", "train-step": "MatMul",
                        "small": "Mul"}[case]
                if body not in seen:
                    fail("%s: oh.OpLogHandler did not see the body op %s at the first "
                         "call (saw %s)" % (case, body, seen))
                report.setdefault(case, {})["log_seen"] = len(seen)
        worst = 0.0
        tol = TOLERANCE[case]
        for key in KEYS[1:]:
            for i, (a, b) in enumerate(zip(got["plain"], got[key])):
                if a.shape != b.shape:
                    fail("%s, %s: call %d: shape %s != plain %s"
                         % (case, NAMES[key], i + 1, b.shape, a.shape))
                if not np.allclose(b, a, rtol=tol, atol=tol):
                    fail("%s, %s: call %d gives %s, the plain call %s"
                         % (case, NAMES[key], i + 1, b, a))
                worst = max(worst, float(np.max(np.abs(a - b))) if a.size else 0.0)
        report.setdefault(case, {}).update(
            worst=worst, calls=calls, first_ms=first, growth=growth)
    return report


# -- measurement ------------------------------------------------------------------------

def measure(configs, rounds, n_mlp, n_train, n_small, seed=0):
    """The interleaved rounds (µs per call, one entry per round), and the replay cache's
    size and the OpLogHandlers' record counts before and after them."""
    n_of = {"mlp-forward": n_mlp, "train-step": n_train, "small": n_small}
    cache0 = replay.cache_info()
    logs0 = {cfg.case: cfg.log_size() for cfg in configs if cfg.key == "log"}
    _common.run_rounds(configs, rounds, lambda cfg: n_of[cfg.case], seed=seed)
    cache1 = replay.cache_info()
    logs1 = {cfg.case: cfg.log_size() for cfg in configs if cfg.key == "log"}
    times = {(cfg.case, cfg.key): [t * 1e6 for t in cfg.times] for cfg in configs}
    return times, {"cache": (cache0, cache1), "logs": (logs0, logs1)}


def check_cache(during):
    """Sanity after timing: the replay cache did not grow (every timed call was a hit)."""
    before, after = during["cache"]
    if after != before:
        fail("the replay cache grew while timing (%d -> %d entries): timed calls missed "
             "the cache" % (before, after))


def summarize(times):
    """case -> {key: stats with "ratio" (this / plain of the medians), its same-round
    IQR, "best_ratio" and "added" µs}."""
    out = {}
    for (case, key), ts in times.items():
        out.setdefault(case, {})[key] = _common.stats(ts, "us")
    for row in out.values():
        plain = row["plain"]
        for key in KEYS:
            s = row[key]
            s["ratio"] = s["us"] / plain["us"]
            s["ratio_q"] = _common.round_ratio_quartiles(s["rounds"], plain["rounds"])
            s["best_ratio"] = s["min"] / plain["min"]
            s["added"] = s["us"] - plain["us"]
    return out


def target_ok(summary):
    return all(summary[case]["pass"]["ratio"] <= TARGET_RATIO
               for case, _, target, _ in CASES if target)


def render_md(summary, info, args, png_name, plotted, elapsed, checks, trace_ms, during):
    cache0, cache1 = during["cache"]
    logs0, logs1 = during["logs"]
    method = (
        "One process times calls of the same `tf.function` without a handler (*plain*) "
        "and inside the scope of `oh.OpHandler()` (pass-through), `oh.OpLogHandler()` and "
        "`oh.CheckNumericsHandler()`. Under a handler the call is *replayed* "
        "(`tf_ophandlers/core/functions/`): the first call interprets the function's body "
        "through the handler stack into a new, handler-free `tf.function` (cached by the "
        "handlers' summaries and the arguments' specs); every later call splits its "
        "arguments, looks the cache up and runs the cached function as one op, so the log "
        "sees the body's ops at the first call only and the CheckNumerics ops are part of "
        "the cached function. Every configuration keeps its handler (created once) and "
        "its inputs for the whole run. TensorFlow's own tracing of each function is done "
        "first (`get_concrete_function`, untimed: %s), then an untimed sanity check makes "
        "each configuration's first calls, then a warm-up pass runs every configuration "
        "with N/5 calls; each of %d rounds then runs every configuration once, in a "
        "freshly shuffled order, entering its handler scope once and making %d untimed + N "
        "timed back-to-back calls in it (N = %d for `mlp-forward`, %d for `train-step`, "
        "%d for `small`; the scope's entry and exit are not in the timings), timed with "
        "`time.perf_counter` with the garbage collector off (after a `gc.collect()`; the "
        "objects alive after setup are frozen with `gc.freeze()` so that collection stays "
        "short). The tables give the median over rounds of the mean time per call, the "
        "interquartile range (IQR) of the per-round means and the best (lowest) round, "
        "which is the least disturbed by other processes; the target uses the median. "
        "*Ratio* is this / plain of the medians, its IQR that of the same-round ratios; "
        "*added* is the difference of the medians. The sanity check requires, else the "
        "script exits non-zero: every handler configuration gives the plain call's "
        "results (`np.allclose`; %s), its first call replays (the replay cache grows) and "
        "its next calls hit the cache, the log saw the body's ops at its first call (%s), "
        "and the replay cache has as many entries after the warm-up and timed rounds as "
        "before them (%d and %d): every timed call was a cache hit. The log's record "
        "count did not change during them either (%s)."
        % ("; ".join("%s %.0f ms" % (case, trace_ms[case]) for case in CASE_KEYS),
           args.rounds, WARMUP_CALLS, args.n_mlp, args.n_train, args.n_small,
           "; ".join("%s %d call(s), max abs difference %.1e (rtol = atol = %g)"
                     % (case, checks[case]["calls"], checks[case]["worst"], TOLERANCE[case])
                     for case in CASE_KEYS),
           "; ".join("%s %d ops" % (case, checks[case]["log_seen"])
                     for case in CASE_KEYS),
           cache0, cache1,
           "; ".join("%s %d → %d records" % (case, logs0[case], logs1[case])
                     for case in CASE_KEYS)))
    L = _common.intro_md(
        "`tf.function` calls replayed through handlers vs. plain calls "
        "(`benchmarks/functions.py`)", args.quick, method,
        _common.machine_md(info, info["nconfigs"], elapsed),
        _common.image_md("time per call of a tf.function, plain and replayed under "
                         "handlers", png_name, plotted))
    for case, title, _, desc in CASES:
        row = summary[case]
        first = checks[case]["first_ms"]
        rows = []
        for key in KEYS:
            s = row[key]
            rows.append([
                NAMES[key], "%.1f" % s["us"], "%.3fx" % s["ratio"],
                "—" if key == "plain" else "%.3f – %.3f" % s["ratio_q"],
                "—" if key == "plain" else "%+.1f" % s["added"],
                "%.1f – %.1f" % (s["q1"], s["q3"]), "%.1f" % s["min"],
                "%.1f" % first[key],
            ])
        after = ["*First call*: wall time of the configuration's first call (single "
                 "measurement in the sanity check, after TensorFlow's tracing). The plain "
                 "call's includes the function's instantiation at its first execution; a "
                 "handler's is the replay: the body interpreted through the handler "
                 "stack, the new function traced and instantiated, then run. The "
                 "difference to the steady state is the one-time cost: %s."
                 % "; ".join("%s %.1f ms" % (NAMES[k], (first[k] - row[k]["us"] / 1e3))
                             for k in KEYS)]
        L += _common.case_md(
            "%s (`%s`)" % (title, case), desc,
            ["configuration", "µs/call", "ratio to plain (this / plain)",
             "IQR of same-round ratios", "added µs vs plain", "IQR µs/call (rounds)",
             "best round µs/call", "first call ms"], rows, after)

    ok = target_ok(summary)
    targets = [(case, summary[case]["pass"]) for case, _, t, _ in CASES if t]
    T = ["- A replayed call that hits the cache costs at most %.1fx a plain call of the "
         "same function (`oh.OpHandler()`, pass-through): %s — %s  (best rounds: %s)"
         % (TARGET_RATIO,
            "; ".join("`%s` %.3fx (%.1f vs %.1f µs, same-round IQR %.3f – %.3f)"
                      % (case, s["ratio"], s["us"], summary[case]["plain"]["us"],
                         s["ratio_q"][0], s["ratio_q"][1]) for case, s in targets),
            _common.verdict(ok),
            ", ".join("%s %.3fx" % (case, s["best_ratio"]) for case, s in targets))]
    small = summary["small"]
    info_parts = ["`small`: %s (%+.1f µs per call for the pass-through replay)"
                  % (", ".join("%s %.3fx" % (NAMES[k], small[k]["ratio"]) for k in KEYS[1:]),
                     small["pass"]["added"])]
    for case, _, t, _ in CASES:
        if t:
            info_parts.append("`%s`: %s" % (case, ", ".join(
                "%s %.3fx" % (NAMES[k], summary[case][k]["ratio"]) for k in KEYS[2:])))
    T.append("- Information, no target: " + "; ".join(info_parts) + ".")
    L += _common.targets_md(T, "functions", args.quick, png_name)
    return "\n".join(L), ok


COLORS = {"plain": "tab:blue", "pass": "tab:orange", "log": "tab:green",
          "checknum": "tab:purple"}
LABELS = {"plain": "plain\n(no handler)", "pass": "oh.\nOpHandler()",
          "log": "oh.OpLog\nHandler()", "checknum": "oh.Check\nNumerics\nHandler()"}


def plot(summary, plt):
    fig, axes = plt.subplots(1, len(CASES) + 1, figsize=(17, 4.8),
                             gridspec_kw={"width_ratios": [1] * len(CASES) + [1.3]})
    for ax, (case, _, _, _) in zip(axes, CASES):
        _common.median_bars(ax, KEYS, [summary[case][k] for k in KEYS], COLORS, LABELS,
                            "µs per call", case, key="us", fmt="%.1f")

    ax_r = axes[-1]
    top = max(TARGET_RATIO, _common.grouped_bars(ax_r, CASE_KEYS, KEYS[1:], summary, "ratio",
                                                 COLORS, NAMES, fontsize=6))
    ax_r.axhline(1.0, color="black", lw=0.8)
    ax_r.axhline(TARGET_RATIO, color="tab:red", ls=":", lw=1,
                 label="target (OpHandler, mlp-forward\nand train-step): %.1fx"
                 % TARGET_RATIO)
    ax_r.set_xticks(np.arange(len(CASES)))
    ax_r.set_xticklabels(["%s%s" % (c, "" if t else "\n(information)")
                          for c, _, t, _ in CASES], fontsize=8)
    ax_r.set_ylabel("ratio: replayed call / plain call")
    ax_r.set_title("ratio to plain (IQR of same-round ratios)", fontsize=9)
    ax_r.set_ylim(0, top * 1.3)
    ax_r.grid(axis="y", alpha=0.3)
    ax_r.legend(fontsize=6, loc="upper right")
    fig.suptitle("tf-ophandlers: tf.function calls replayed through handlers (cache hits) "
                 "vs. plain calls (eager, same run)", fontsize=10)
    return fig


def main(argv=None):
    args = _common.parse_args(
        argv, __doc__, "functions", (40, 3),
        [("n-mlp", "timed mlp-forward calls per round", 300, 20),
         ("n-train", "timed train-step calls per round", 300, 20),
         ("n-small", "timed small calls per round", 600, 100)])

    start = time.perf_counter()
    info = _common.machine_info()
    configs, trace_ms = make_configs()
    info["nconfigs"] = len(configs)
    checks = check(configs)
    times, during = _common.measure_under_load(
        info, lambda: measure(configs, args.rounds, args.n_mlp, args.n_train, args.n_small),
        freeze=True)
    check_cache(during)
    summary = summarize(times)
    elapsed = time.perf_counter() - start

    ok, png_path = _common.publish(
        args.out, "functions", lambda plt: plot(summary, plt),
        lambda png_name, plotted: render_md(summary, info, args, png_name, plotted,
                                            elapsed, checks, trace_ms, during))

    for case in CASE_KEYS:
        row = summary[case]
        print("%-11s " % case + "  ".join(
            "%s %8.1f us %5.3fx" % (key, row[key]["us"], row[key]["ratio"]) for key in KEYS))
    print("first call ms: " + "; ".join(
        "%s " % case + " ".join("%s %.1f" % (k, checks[case]["first_ms"][k]) for k in KEYS)
        for case in CASE_KEYS))
    print("replay cache %d -> %d entries while timing" % during["cache"])
    print("target: OpHandler / plain %s <= %.1fx %s"
          % (", ".join("%s %.3fx" % (c, summary[c]["pass"]["ratio"])
                       for c, _, t, _ in CASES if t), TARGET_RATIO,
             "PASS" if ok else "MISS"))
    _common.print_wrote(args.out, png_path, elapsed)


if __name__ == "__main__":
    main()
