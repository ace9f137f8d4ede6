"""`oh.vectorized_map` (auto-batching as an op handler) against TensorFlow's ways of
computing eager per-example gradients, in one process, on two cases (CASES below):

  per-example-grads  per-example gradients of an MLP loss (64 -> 128 relu -> 10, sparse
                     softmax cross-entropy, batch 256), five ways: `oh.vectorized_map`
                     over an eager function using `oh.GradientTape` (op by op); the same
                     over a `tf.function` of it (replayed once into a cached function,
                     tf_ophandlers/core/functions/, which later calls run directly);
                     a Python loop of `tf.GradientTape`s;
                     eager `tf.vectorized_map` (which converts the function on every
                     call); `tf.function(tf.vectorized_map)` traced once in the warm-up
  forward-batch      a forward-only per-example function, the same ways but the loop
                     (information, no target)

The targets (per-example-grads) are checked for the op-by-op configuration and for the
replayed one. Before timing, all methods must agree (allclose, 1e-5; references: the
loop of `tf.GradientTape`s, the plain batched computation), and each replayed
configuration's first call must add a replay-cache entry that the timed calls then hit
(the script exits non-zero otherwise). Configurations are interleaved (shuffled order
every round); the reported time is the median over rounds of the mean time per call of
N back-to-back calls, with the process CPU time per call alongside.
Writes the `vectorized_map` section of docs/benchmarks.md and docs/vectorized_map.png.

    python benchmarks/vectorized_map.py            # full run (~2 min on 2 cores)
    python benchmarks/vectorized_map.py --quick    # smoke run (< 30 s, noisy numbers)
"""
import logging
import os
import sys
import time

import _common  # also puts the repository on sys.path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_ophandlers as oh  # noqa: E402
from tf_ophandlers.core import functions as replay  # noqa: E402
from tf_ophandlers.handlers.vectorized_map import handler as vm  # noqa: E402

D, H, C, B = 64, 128, 10, 256  # inputs, hidden units, classes, batch size
METHODS = (
    # key, name, slow (few calls per round)
    ("oh", "oh.vectorized_map", False),
    ("ohf", "oh.vectorized_map over a tf.function", False),
    ("loop", "eager loop of tf.GradientTape", True),
    ("eager", "eager tf.vectorized_map", True),
    ("tff", "tf.function(tf.vectorized_map)", False),
)
NAME = {key: name for key, name, _ in METHODS}
CASES = (
    # key, title, methods, description
    ("per-example-grads", "Per-example gradients of an MLP 64-128-10, batch 256",
     ("oh", "ohf", "loop", "eager", "tff"),
     "Plain `tf.Variable`s `W1` [64, 128], `b1` [128], `W2` [128, 10], `b2` [10]; "
     "inputs `X` [256, 64] float32, integer labels `Y` [256]. Per-example loss "
     "`loss(e, y)`: `h = tf.nn.relu(tf.matmul(e[None], W1) + b1)`, "
     "`logits = tf.matmul(h, W2) + b2`, `tf.reduce_sum(tf.nn."
     "sparse_softmax_cross_entropy_with_logits(y[None], logits))`. Every method returns "
     "the 4 per-example gradients, shapes [256, 64, 128], [256, 128], [256, 128, 10], "
     "[256, 10]. *oh.vectorized_map*: `oh.vectorized_map(pe, (X, Y))` where `pe((e, y))` "
     "is `with oh.GradientTape() as t: l = loss(e, y)`, `return t.gradient(l, [W1, b1, "
     "W2, b2])`. *oh.vectorized_map over a tf.function*: `oh.vectorized_map(pe_fn, (X, "
     "Y))` with `pe_fn = tf.function(pe)` created once (inside the trace, "
     "`oh.GradientTape` acts as TensorFlow's tape); its first call is replayed through "
     "the vectorizing handler into a cached function, which the timed calls run "
     "directly (the call's plan: no handler scope, no dispatch of the call on handler "
     "tensors). "
     "*eager loop*: the same function with `tf.GradientTape` called on "
     "`(X[i], Y[i])` for the 256 examples in a Python loop, then `tf.stack` per variable. "
     "*eager tf.vectorized_map*: `tf.vectorized_map(pe, (X, Y))` with the "
     "`tf.GradientTape` function, called eagerly (TensorFlow converts the function to a "
     "graph again on every call). *tf.function(tf.vectorized_map)*: "
     "`tf.function(lambda: tf.vectorized_map(pe, (X, Y)))`, traced once in the warm-up, "
     "so a timed call runs the already-built graph."),
    ("forward-batch", "Forward-only per-example function, batch 256",
     ("oh", "ohf", "eager", "tff"),
     "`f = lambda e: tf.nn.softmax(tf.tanh(tf.matmul(e[None], W1)) @ W2)[0]` over "
     "`X` [256, 64] (output [256, 10]), same variables: `oh.vectorized_map(f, X)`, "
     "`oh.vectorized_map(f_fn, X)` with `f_fn = tf.function(f)` created once (replayed "
     "once, then cached), eager "
     "`tf.vectorized_map(f, X)` and `tf.function(lambda: tf.vectorized_map(f, X))` "
     "(traced once in the warm-up). Information only (no target): the batching cost "
     "without autodiff."),
)
# Targets on per-example-grads, for the op-by-op and the replayed configurations:
TARGET_VS_LOOP = 50.0   # at least 50x faster than the eager loop
TARGET_VS_EAGER = 10.0  # at least 10x faster than eager tf.vectorized_map
TARGET_VS_TFF = 3.0     # at most 3x the time of tf.function(tf.vectorized_map)
WARMUP_CALLS = {False: 2, True: 1}  # untimed per (round, configuration): fast, slow
TOLERANCE = 1e-5


class _DropRetracingWarning(logging.Filter):
    """Drops TensorFlow's retracing warning (eager `tf.vectorized_map` retraces per call)."""

    def filter(self, record):
        return "triggered tf.function retracing" not in record.getMessage()


# -- the workload -----------------------------------------------------------------------

class Workload:
    """Variables, data and the per-example functions (shared by all configurations)."""

    def __init__(self):
        self.W1 = tf.Variable(tf.random.stateless_normal([D, H], seed=[1, 1]) / D ** 0.5)
        self.b1 = tf.Variable(tf.random.stateless_normal([H], seed=[1, 2]) * 0.1)
        self.W2 = tf.Variable(tf.random.stateless_normal([H, C], seed=[1, 3]) / H ** 0.5)
        self.b2 = tf.Variable(tf.random.stateless_normal([C], seed=[1, 4]) * 0.1)
        self.variables = [self.W1, self.b1, self.W2, self.b2]
        self.X = tf.random.stateless_normal([B, D], seed=[2, 1])
        self.Y = tf.random.stateless_uniform([B], seed=[2, 2], maxval=C, dtype=tf.int32)
        self.tff_grads = tf.function(
            lambda: tf.vectorized_map(self.pe_tf, (self.X, self.Y)))
        self.tff_forward = tf.function(lambda: tf.vectorized_map(self.fwd, self.X))
        # created once: oh.vectorized_map replays their call once and caches the result
        self.pe_oh_fn = tf.function(self.pe_oh)
        self.fwd_fn = tf.function(self.fwd)

    def loss(self, e, y):
        h = tf.nn.relu(tf.matmul(e[None], self.W1) + self.b1)
        logits = tf.matmul(h, self.W2) + self.b2
        return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(y[None],
                                                                            logits))

    def pe_oh(self, ey):
        e, y = ey
        with oh.GradientTape() as t:
            l = self.loss(e, y)
        return t.gradient(l, self.variables)

    def pe_tf(self, ey):
        e, y = ey
        with tf.GradientTape() as t:
            l = self.loss(e, y)
        return t.gradient(l, self.variables)

    def fwd(self, e):
        return tf.nn.softmax(tf.tanh(tf.matmul(e[None], self.W1)) @ self.W2)[0]

    # per-example-grads
    def grads_oh(self):
        return oh.vectorized_map(self.pe_oh, (self.X, self.Y))

    def grads_ohf(self):
        return oh.vectorized_map(self.pe_oh_fn, (self.X, self.Y))

    def grads_loop(self):
        X, Y, pe = self.X, self.Y, self.pe_tf
        per = [pe((X[i], Y[i])) for i in range(B)]
        return [tf.stack(g) for g in zip(*per)]

    def grads_eager(self):
        return tf.vectorized_map(self.pe_tf, (self.X, self.Y))

    def grads_tff(self):
        return self.tff_grads()

    # forward-batch
    def forward_oh(self):
        return oh.vectorized_map(self.fwd, self.X)

    def forward_ohf(self):
        return oh.vectorized_map(self.fwd_fn, self.X)

    def forward_eager(self):
        return tf.vectorized_map(self.fwd, self.X)

    def forward_tff(self):
        return self.tff_forward()

    def forward_reference(self):
        return tf.nn.softmax(tf.tanh(tf.matmul(self.X, self.W1)) @ self.W2)


class Config:
    """One (case, method): its call, calls per round and per-round times."""

    def __init__(self, case, method, call, n):
        self.case, self.method, self.call, self.n = case, method, call, n
        self.slow = dict((k, s) for k, _, s in METHODS)[method]
        self.warm = WARMUP_CALLS[self.slow]
        self.times = []
        self.cpu = []  # process CPU seconds per call (all threads), same rounds as times


def make_configs(w, args):
    n_of = {"oh": args.n_fast, "ohf": args.n_fast, "tff": args.n_fast, "eager": args.n_eager,
            "loop": args.n_loop}
    calls = {("per-example-grads", "oh"): w.grads_oh,
             ("per-example-grads", "ohf"): w.grads_ohf,
             ("per-example-grads", "loop"): w.grads_loop,
             ("per-example-grads", "eager"): w.grads_eager,
             ("per-example-grads", "tff"): w.grads_tff,
             ("forward-batch", "oh"): w.forward_oh,
             ("forward-batch", "ohf"): w.forward_ohf,
             ("forward-batch", "eager"): w.forward_eager,
             ("forward-batch", "tff"): w.forward_tff}
    return [Config(case, m, calls[(case, m)], n_of[m])
            for case, _, methods, _ in CASES for m in methods]


class SanityError(Exception):
    pass


def _compare(case, name, got, want):
    """Max abs difference of `got` vs `want` (lists of tensors); raises on mismatch."""
    if len(got) != len(want):
        raise SanityError("%s: %s returned %d tensors, expected %d"
                          % (case, name, len(got), len(want)))
    worst = 0.0
    for a, b in zip(got, want):
        if a is None:
            raise SanityError("%s: %s returned None" % (case, name))
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            raise SanityError("%s: %s shape %s, expected %s" % (case, name, a.shape,
                                                                b.shape))
        if not np.allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE):
            raise SanityError("%s: %s differs from the reference by up to %.3g"
                              % (case, name, float(np.max(np.abs(a - b)))))
        worst = max(worst, float(np.max(np.abs(a - b))) if a.size else 0.0)
    return worst


def _planned(function):
    """Whether oh.vectorized_map has a call plan running `function`'s replay directly."""
    return any(plan.key is not None and plan.fn() is function
               for plan in list(vm._call_plans.values()))  # pylint: disable=protected-access


def _replayed(case, fn, function):
    """Calls `fn` (oh.vectorized_map over the tf.function `function`) twice; the first
    call must add its replayed function to the replay cache and a call plan running it,
    the second must hit the cache. Returns the first call's result."""
    before = replay.cache_info()
    got = fn()
    first = replay.cache_info()
    if first <= before:
        raise SanityError("%s: %s did not add a replayed function to the replay cache "
                          "(cache_info %d before its first call, %d after)"
                          % (case, NAME["ohf"], before, first))
    if not _planned(function):
        raise SanityError("%s: %s has no call plan after its first call (later calls "
                          "would take the handler scope again)" % (case, NAME["ohf"]))
    fn()
    if replay.cache_info() != first:
        raise SanityError("%s: %s missed the replay cache on its second call "
                          "(cache_info %d -> %d)" % (case, NAME["ohf"], first,
                                                     replay.cache_info()))
    return got


def check_results(w):
    """Sanity (untimed): every method gives the same per-example gradients as the loop
    of tf.GradientTapes (and the forward case the plain batched result),
    oh.vectorized_map / oh.GradientTape really are handlers on the stack inside fn, and
    the tf.function configurations really go through the replay cache."""
    seen = {}

    def probe(ey):
        with oh.GradientTape() as t:
            handlers = oh.current_stack().handlers
            seen["vmap"] = any(isinstance(h, oh.VectorizedMap) for h in handlers)
            seen["tape"] = any(h is t for h in handlers)
            l = w.loss(*ey)
        return t.gradient(l, w.variables)

    oh.vectorized_map(probe, (w.X, w.Y))
    if not (seen.get("vmap") and seen.get("tape")):
        raise SanityError("oh.VectorizedMap / oh.GradientTape not on the handler stack "
                          "inside the mapped function: %s" % seen)
    want = w.grads_loop()
    shapes = [tuple(g.shape) for g in want]
    expected = [(B, D, H), (B, H), (B, H, C), (B, C)]
    if shapes != expected:
        raise SanityError("loop gradients have shapes %s, expected %s" % (shapes,
                                                                          expected))
    report = {"per-example-grads": {}, "forward-batch": {}}
    for key, fn in (("oh", w.grads_oh),
                    ("ohf", lambda: _replayed("per-example-grads", w.grads_ohf, w.pe_oh_fn)),
                    ("eager", w.grads_eager), ("tff", w.grads_tff)):
        report["per-example-grads"][key] = _compare("per-example-grads", NAME[key],
                                                    list(fn()), want)
    ref = [w.forward_reference()]
    for key, fn in (("oh", w.forward_oh),
                    ("ohf", lambda: _replayed("forward-batch", w.forward_ohf, w.fwd_fn)),
                    ("eager", w.forward_eager), ("tff", w.forward_tff)):
        report["forward-batch"][key] = _compare("forward-batch", NAME[key], [fn()], ref)
    return report


# -- measurement ------------------------------------------------------------------------

def measure(configs, rounds, seed=0):
    """Milliseconds per call, one entry per round, per (case, method); and the replay
    cache's size after the warm-up pass and after the last round."""
    cache = {}
    calls = [0]

    def run(cfg, n):
        # run_rounds' warm-up pass runs each configuration once: after len(configs)
        # calls it is over and the first timed round starts
        if calls[0] == len(configs):
            cache["warm-up"] = replay.cache_info()
        calls[0] += 1
        wall, cpu = _common.warm_time_and_cpu(cfg.call, cfg.warm, n)
        cfg.cpu.append(cpu)
        return wall

    # (the warm-up pass also traces the tf.functions)
    _common.run_rounds(configs, rounds, lambda cfg: cfg.n, run, seed)
    cache.setdefault("warm-up", replay.cache_info())
    cache["rounds"] = replay.cache_info()
    return ({(cfg.case, cfg.method): [t * 1e3 for t in cfg.times] for cfg in configs},
            cache, {(cfg.case, cfg.method): [t * 1e3 for t in cfg.cpu] for cfg in configs})


def cpu_ratio(cpu, case, num, den):
    """Median and IQR of the same-round CPU-time ratios num / den."""
    ratios = [x / y for x, y in zip(cpu[(case, num)], cpu[(case, den)])]
    return _common.median(ratios), _common.quartiles(ratios)


def summarize(times):
    """case -> {method: stats}; every method also gets its speed-up over oh (op by op):
    "x" = method time / oh time (medians), its same-round IQR and the best-round one;
    and the same over oh.vectorized_map over a tf.function (replayed): "x_f",
    "x_f_q", "best_x_f"."""
    out = {}
    for (case, method), ts in times.items():
        out.setdefault(case, {})[method] = _common.stats(ts, "ms")
    for row in out.values():
        o, f = row["oh"], row["ohf"]
        for key, s in row.items():
            s["x"] = s["ms"] / o["ms"]
            s["best_x"] = s["min"] / o["min"]
            s["x_q"] = _common.round_ratio_quartiles(s["rounds"], o["rounds"])
            s["x_f"] = s["ms"] / f["ms"]
            s["best_x_f"] = s["min"] / f["min"]
            s["x_f_q"] = _common.round_ratio_quartiles(s["rounds"], f["rounds"])
    return out


def _fmt(x):
    return "%.3f" % x if x < 100 else "%.1f" % x


# who is checked against the targets: key, how the target lines and the output name it
TARGET_SUBJECTS = (("oh", "`oh.vectorized_map`", "oh"),
                   ("ohf", "`oh.vectorized_map` over a `tf.function` (replayed)",
                    "oh over tf.function"))


def targets(summary):
    """(subject, method, text, value, best, ok, how) for each target, first for
    oh.vectorized_map op by op (as before), then for the replayed configuration."""
    g = summary["per-example-grads"]
    op_by_op = [
        ("loop", "at least %.0fx faster than the eager loop of `tf.GradientTape`"
         % TARGET_VS_LOOP, g["loop"]["x"], g["loop"]["best_x"],
         g["loop"]["x"] >= TARGET_VS_LOOP, "%.1fx faster" % g["loop"]["x"]),
        ("eager", "at least %.0fx faster than eager `tf.vectorized_map`" % TARGET_VS_EAGER,
         g["eager"]["x"], g["eager"]["best_x"], g["eager"]["x"] >= TARGET_VS_EAGER,
         "%.1fx faster" % g["eager"]["x"]),
        ("tff", "within %.0fx of `tf.function(tf.vectorized_map)` (oh / tf.function "
         "<= %.0f)" % (TARGET_VS_TFF, TARGET_VS_TFF), 1.0 / g["tff"]["x"],
         1.0 / g["tff"]["best_x"], 1.0 / g["tff"]["x"] <= TARGET_VS_TFF,
         "oh takes %.2fx the time" % (1.0 / g["tff"]["x"])),
    ]
    replayed = [
        ("loop", "at least %.0fx faster than the eager loop of `tf.GradientTape`"
         % TARGET_VS_LOOP, g["loop"]["x_f"], g["loop"]["best_x_f"],
         g["loop"]["x_f"] >= TARGET_VS_LOOP, "%.1fx faster" % g["loop"]["x_f"]),
        ("eager", "at least %.0fx faster than eager `tf.vectorized_map`" % TARGET_VS_EAGER,
         g["eager"]["x_f"], g["eager"]["best_x_f"], g["eager"]["x_f"] >= TARGET_VS_EAGER,
         "%.1fx faster" % g["eager"]["x_f"]),
        ("tff", "within %.0fx of `tf.function(tf.vectorized_map)` (oh over tf.function / "
         "tf.function <= %.0f)" % (TARGET_VS_TFF, TARGET_VS_TFF), 1.0 / g["tff"]["x_f"],
         1.0 / g["tff"]["best_x_f"], 1.0 / g["tff"]["x_f"] <= TARGET_VS_TFF,
         "oh over tf.function takes %.2fx the time" % (1.0 / g["tff"]["x_f"])),
    ]
    return ([("oh",) + t for t in op_by_op] + [("ohf",) + t for t in replayed])


def render_md(summary, info, args, png_name, plotted, elapsed, checks, cache, cpu):
    method = (
        "One process times `oh.vectorized_map` (the auto-batching op handler: "
        "the function runs once, eagerly, each op on the whole batch) and TensorFlow's "
        "ways of batching the same eager function on each case below. When `fn` is a "
        "`tf.function`, its call is replayed once through the vectorizing handler into a "
        "cached handler-free function (`tf_ophandlers/core/functions/`); later calls with the "
        "same function and argument specs run that function directly (a call plan "
        "recorded from the first call: no handler scope, no TensorFlow dispatch of the "
        "call on handler tensors, no splitting and rebuilding of representations; the "
        "script checks that the plan exists); the op-by-op configuration (*oh.vectorized_map*) is the eager `fn` "
        "(Python code that need not be traceable). All configurations "
        "share the variables and the batch for the whole run; after a warm-up pass over "
        "all configurations (which also traces the `tf.function`s), each of %d rounds runs "
        "every configuration once, in a freshly shuffled order, as untimed + N timed "
        "back-to-back calls timed with `time.perf_counter` (and the process CPU time of all "
        "threads, `time.process_time`) with the garbage collector "
        "off. The call counts differ by method so that the run stays short: N = %d for "
        "both `oh.vectorized_map` configurations and `tf.function(tf.vectorized_map)` (%d "
        "untimed), N = %d for "
        "eager `tf.vectorized_map` and N = %d for the eager loop (%d untimed each; one "
        "loop call is 256 tapes). The table gives the median over rounds of the mean time "
        "per call, the interquartile range (IQR) of the per-round means and the best "
        "(lowest) round, which is the least disturbed by other processes; the targets use "
        "the medians. *Time / oh* is the method's median over `oh.vectorized_map`'s (> 1: "
        "oh is that many times faster); its IQR is that of the same-round ratios; "
        "*time / oh over tf.function* is the same over the replayed configuration's "
        "median. Before "
        "timing, the script checks that all methods agree (`np.allclose`, rtol = atol = "
        "%g) with the reference (the loop of `tf.GradientTape`s; the plain batched "
        "computation for the forward case): max abs difference %s. The replay cache "
        "(`replay.cache_info()`) grew on the first call of each replayed configuration "
        "and held %d replayed functions after the warm-up pass and %d after the last "
        "round (the script fails if it grows during the rounds: every timed replayed "
        "call is a cache hit). TensorFlow's "
        "per-call retracing warning of eager `tf.vectorized_map` is filtered from the log "
        "output (the retracing itself is part of what is measured)."
        % (args.rounds, args.n_fast, WARMUP_CALLS[False], args.n_eager, args.n_loop,
           WARMUP_CALLS[True], TOLERANCE,
           "; ".join("%s: %s" % (case, ", ".join("%s %.1e" % (NAME[k], v)
                                                 for k, v in per.items()))
                     for case, per in checks.items()),
           cache["warm-up"], cache["rounds"]))
    L = _common.intro_md(
        "`oh.vectorized_map`: eager per-example gradients (`benchmarks/vectorized_map.py`)",
        args.quick, method, _common.machine_md(info, info["nconfigs"], elapsed),
        _common.image_md("time per call and oh.vectorized_map's speed-up", png_name,
                         plotted))
    for case, title, methods, desc in CASES:
        rows = []
        for key in methods:
            s = summary[case][key]
            rows.append([
                NAME[key], _fmt(s["ms"]),
                "1.00x" if key == "oh" else "%.2fx (IQR %.2f – %.2f)"
                % (s["x"], s["x_q"][0], s["x_q"][1]),
                "1.00x" if key == "ohf" else "%.2fx (IQR %.2f – %.2f)"
                % (s["x_f"], s["x_f_q"][0], s["x_f_q"][1]),
                "%s – %s" % (_fmt(s["q1"]), _fmt(s["q3"])), _fmt(s["min"]),
                len(s["rounds"]),
            ])
        L += _common.case_md(
            "%s (`%s`)" % (title, case), desc,
            ["method", "ms/call", "time / oh", "time / oh over tf.function",
             "IQR ms/call (rounds)",
             "best round ms/call", "rounds"], rows)

    T = []
    ok_all = True
    g = summary["per-example-grads"]
    subject = {k: md for k, md, _ in TARGET_SUBJECTS}
    for who, key, text, value, best, ok, how in targets(summary):
        ok_all = ok_all and ok
        T.append("- %s %s: %s (%.3f vs %.3f ms) — %s  (best rounds: "
                 "%.2fx)" % (subject[who], text, how, g[who]["ms"], g[key]["ms"],
                             _common.verdict(ok), best))
    for case in ("per-example-grads", "forward-batch"):  # CPU time, same rounds
        r, q = cpu_ratio(cpu, case, "eager", "oh")
        T.append("- CPU time (information; all threads) on `%s`: eager `tf.vectorized_map` "
                 "/ `oh.vectorized_map` = %.2fx (IQR %.2f – %.2f), medians %.3f vs %.3f ms"
                 % ((case, r) + q + tuple(_common.median(cpu[(case, k)])
                                          for k in ("eager", "oh"))))
    fw = summary["forward-batch"]
    T.append("- `forward-batch` has no target (information): eager `tf.vectorized_map` "
             "takes %.1fx the time of `oh.vectorized_map`, `oh.vectorized_map` %.2fx that "
             "of `tf.function(tf.vectorized_map)`; over a `tf.function` (replayed), "
             "`oh.vectorized_map` takes %.2fx the time of `tf.function(tf.vectorized_map)` "
             "and eager `tf.vectorized_map` %.1fx its time."
             % (fw["eager"]["x"], 1.0 / fw["tff"]["x"], 1.0 / fw["tff"]["x_f"],
                fw["eager"]["x_f"]))
    L += _common.targets_md(T, "vectorized_map", args.quick, png_name, plural=True,
                            scope=" for `per-example-grads`")
    return "\n".join(L), ok_all


COLORS = {"oh": "tab:orange", "ohf": "tab:green", "loop": "tab:red",
          "eager": "tab:purple", "tff": "tab:blue"}


def plot(summary, plt):
    fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(14, 4.8),
                                   gridspec_kw={"width_ratios": [3, 2.4]})
    width = 0.16
    labelled = set()
    for ci, (case, _, methods, _) in enumerate(CASES):
        for mi, key in enumerate(methods):  # the case's bars centred on its tick
            s = summary[case][key]
            x = ci + (mi - (len(methods) - 1) / 2.0) * width
            ax.bar(x, s["ms"], width, yerr=_common.iqr_err([s], "ms"), capsize=3,
                   color=COLORS[key], label=None if key in labelled else NAME[key])
            labelled.add(key)
            _common.label_bars(ax, [x], [max(s["ms"], s["q3"])],
                               [("%.0f" if s["ms"] >= 10 else "%.2f") % s["ms"]], 7)
    ax.set_yscale("log")
    ax.set_xticks(range(len(CASES)))
    ax.set_xticklabels(["%s\n(%d methods%s)" % (c, len(m), ", forward only"
                                                if c == "forward-batch" else "")
                        for c, _, m, _ in CASES], fontsize=8)
    ax.set_ylabel("ms per call (log scale)")
    ax.set_title("time per call, batch 256 (median, IQR of rounds)", fontsize=9)
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper right")
    top = max(s["q3"] for row in summary.values() for s in row.values())
    bottom = min(s["q1"] for row in summary.values() for s in row.values())
    ax.set_ylim(bottom / 2, top * 4)

    # right: each oh configuration's speed-up over each method, with the targets
    groups = [("per-example-grads", "loop", TARGET_VS_LOOP, "grads\nvs loop"),
              ("per-example-grads", "eager", TARGET_VS_EAGER, "grads\nvs eager vmap"),
              ("per-example-grads", "tff", 1.0 / TARGET_VS_TFF, "grads\nvs tf.function"),
              ("forward-batch", "eager", None, "forward\nvs eager vmap"),
              ("forward-batch", "tff", None, "forward\nvs tf.function")]
    subjects = (("oh", "x", "x_q", "oh.vectorized_map (eager fn, op by op)"),
                ("ohf", "x_f", "x_f_q", "oh.vectorized_map over a tf.function (replayed)"))
    bw = 0.36
    xs = np.arange(len(groups))
    all_vals, all_tops = [], []
    for si, (who, xk, qk, label) in enumerate(subjects):
        bx = xs + (si - 0.5) * bw
        vals = [summary[c][k][xk] for c, k, _, _ in groups]
        lo, hi = _common.spread(vals, [summary[c][k][qk] for c, k, _, _ in groups])
        bars = ax_r.bar(bx, vals, bw, yerr=[lo, hi], capsize=2, color=COLORS[who],
                        label=label)
        for patch, (_, _, t, _) in zip(bars.patches, groups):
            if t is None:  # information only: paler
                patch.set_alpha(0.5)
        tops = [v + h for v, h in zip(vals, hi)]
        _common.label_bars(ax_r, bx, tops,
                           ["%.0fx" % v if v >= 100 else "%.1fx" % v if v >= 1
                            else "%.2fx" % v for v in vals], fontsize=6, boxed=True)
        all_vals += vals
        all_tops += tops
    first = True
    for x, (_, _, t, _) in zip(xs, groups):
        if t is not None:
            ax_r.hlines(t, x - 0.45, x + 0.45, colors="black", linestyles=":", lw=1.5,
                        label="target (minimum speed-up)" if first else None)
            first = False
    ax_r.axhline(1.0, color="black", lw=0.8, label="parity")
    ax_r.set_yscale("log")
    ax_r.set_xticks(xs)
    ax_r.set_xticklabels([g[3] for g in groups], fontsize=7)
    ax_r.set_ylabel("method time / oh.vectorized_map time (log)")
    ax_r.set_title("speed-up of oh.vectorized_map (IQR of same-round ratios; "
                   "forward: no target)", fontsize=9)
    ax_r.set_ylim(min(min(all_vals), 1.0 / TARGET_VS_TFF) / 2,
                  max(max(all_tops), TARGET_VS_LOOP) * 6)
    ax_r.grid(axis="y", alpha=0.3, which="both")
    ax_r.legend(fontsize=6.5, loc="upper right")
    fig.suptitle("tf-ophandlers: oh.vectorized_map (op by op, and over a tf.function) vs. "
                 "TensorFlow's batching of the same functions (same run)", fontsize=10)
    return fig


def main(argv=None):
    args = _common.parse_args(
        argv, __doc__, "vectorized_map", (30, 3),
        [("n-fast", "timed calls per round of oh.vectorized_map (both configurations) "
                    "and tf.function(tf.vectorized_map)", 20, 5),
         ("n-eager", "timed calls per round of eager tf.vectorized_map", 3, 1),
         ("n-loop", "timed calls per round of the eager loop", 1, 1)])

    start = time.perf_counter()
    tf.get_logger().addFilter(_DropRetracingWarning())
    info = _common.machine_info()
    w = Workload()
    configs = make_configs(w, args)
    info["nconfigs"] = len(configs)
    try:
        checks = check_results(w)
    except SanityError as e:
        print("sanity check failed: %s" % e, file=sys.stderr)
        return 1
    times, cache, cpu = _common.measure_under_load(info,
                                                   lambda: measure(configs, args.rounds))
    if cache["rounds"] != cache["warm-up"]:
        print("sanity check failed: the replay cache grew during the timed rounds "
              "(replay.cache_info() %d after the warm-up, %d after the rounds): the "
              "replayed configurations missed it" % (cache["warm-up"], cache["rounds"]),
              file=sys.stderr)
        return 1
    summary = summarize(times)
    elapsed = time.perf_counter() - start

    ok, png_path = _common.publish(
        args.out, "vectorized_map", lambda plt: plot(summary, plt),
        lambda png_name, plotted: render_md(summary, info, args, png_name, plotted,
                                            elapsed, checks, cache, cpu))

    for case, _, methods, _ in CASES:
        for key in methods:
            s = summary[case][key]
            print("%-17s %-37s %9.3f ms  time/oh %7.2fx  time/ohf %7.2fx"
                  % (case, NAME[key], s["ms"], s["x"], s["x_f"]))
    r, q = cpu_ratio(cpu, "per-example-grads", "eager", "oh")
    print("CPU time, per-example-grads: eager tf.vectorized_map / oh.vectorized_map %.2fx "
          "(IQR %.2f - %.2f)" % ((r,) + q))
    print("replay cache: %d functions after the warm-up, %d after the rounds"
          % (cache["warm-up"], cache["rounds"]))
    printed = {k: name for k, _, name in TARGET_SUBJECTS}
    for who, key, text, value, best, t_ok, how in targets(summary):
        print("target: %s %s: %s %s" % (printed[who], text.replace("`", ""), how,
                                        "PASS" if t_ok else "MISS"))
    _common.print_wrote(args.out, png_path, elapsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
