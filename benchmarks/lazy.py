"""`oh.Lazy()` (ops recorded, compiled and run at a value request) against plain eager
execution.

Inside `with oh.Lazy():` ops are recorded instead of run; a value request (`.numpy()`)
compiles the pending subgraph into a function, cached by its structure
(`tf_ophandlers/handlers/lazy/handler.py`), and runs it; later calls with the same structure hit
that cache. Times, in one process, one call = build the computation and fetch its value
with `.numpy()`, on three cases:

  chain-200  200 small ops on a 16x16 float32 tensor: `h = tf.tanh(h) * 1.01`, 100 times
  chain-256  the same chain on a 256x256 float32 tensor, where the kernels cost more
             than dispatch (information, no target)
  rnn-cell   an RNN-cell loop of 20 steps: `h = tf.tanh(tf.matmul(xs[t], W) +
             tf.matmul(h, U))` with h [4, 16], W, U [16, 16], xs [20, 4, 16]
             (information, no target)

with the configurations `eager` (plain TensorFlow), `oh.Lazy()` (one handler per
configuration, created once; each call is `with lazy: h = f(...); v = h.numpy()`) and,
for information, `tf.function` of the same computation (traced once) and, on chain-200,
`oh.Lazy() build only` (the same scope without `.numpy()`, timed from the first op to
the last: the recording alone) and `null device`: the chain under
`tf.device(<a custom device that runs nothing>)` (`tf_ophandlers._null_device`,
cc/testing/null_device.cc), no value request. Its execute callback records nothing, runs nothing
and calls no Python, so its time is what TensorFlow's Python API and its custom-device
dispatch alone cost per op: the floor of any per-op interception through a custom
device, which bounds what `oh.Lazy()` can reach (see `why_md`).

Before timing, every configuration must give eager's value (allclose), under Lazy nothing
may run while the ops are recorded, Lazy's first call must compile once (`lazy.compiled`
1) and its second call hit the cache, every value request must count one flush and the
`tf.function`s must be traced once; after the timed rounds `compiled` must be unchanged
(every timed call was a cache hit) and `flushes` must have grown by one per call. The
null device's result must be a handle on the null device. The script exits non-zero
otherwise. Configurations are interleaved (shuffled order every round) and repeated; the
reported time is the median over rounds of the mean time per call of N back-to-back calls.
Writes the `lazy` section of docs/benchmarks.md and docs/lazy.png.

    python benchmarks/lazy.py            # full run (~1-2 min on 2 cores)
    python benchmarks/lazy.py --quick    # smoke run (< 30 s, noisy numbers)
"""
import gc
import os
import time

import _common  # also puts the repository on sys.path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_ophandlers as oh  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402
from tf_ophandlers import _null_device  # noqa: E402

CONFIGS = (
    # key, name
    ("eager", "eager (plain TensorFlow)"),
    ("lazy", "oh.Lazy()"),
    ("build", "oh.Lazy() build only"),
    ("function", "tf.function (traced once)"),
    ("floor", "null device (TF API only, nothing recorded or run)"),
)
NAMES = dict(CONFIGS)
CASES = (
    # key, title, target?, configurations, description
    ("chain-200", "Chain of 200 small ops on a 16x16 float32 tensor", True,
     ("eager", "lazy", "build", "function", "floor"),
     "`h = x; for _ in range(100): h = tf.tanh(h) * 1.01`, then `h.numpy()`, on x "
     "[16, 16] float32 (`stateless_uniform`, created outside the scope). *oh.Lazy()*: "
     "`with lazy: h = chain(x); v = h.numpy()` with one handler created once, so the "
     "200 ops are recorded and the value request runs them as one cached function. "
     "*oh.Lazy() build only* is the same scope without `.numpy()` (its own handler), "
     "timed from the first op to the last: the recording alone, nothing runs; the "
     "scope's entry and exit are not timed (information). *tf.function* is "
     "`tf.function(chain)` traced once, called as `fn(x).numpy()` (information). "
     "*Null device* is `with tf.device(NULL): h = chain(x)`, no value request, with NULL "
     "a TensorFlow custom device (`tf_ophandlers._null_device`, `cc/testing/null_device.cc`) "
     "whose execute callback runs nothing and calls no Python, returning a handle with "
     "the first input's shape: each op still goes through TensorFlow's Python API, "
     "TFE_Execute's placement, one custom-device call and a new output handle. It is the "
     "floor under which no per-op interception through a custom device (in Python or "
     "C) can record an op; values cannot be read back (information, not a target; the "
     "result is checked to be on the null device)."),
    ("chain-256", "Chain of 200 ops on a 256x256 float32 tensor", False,
     ("eager", "lazy", "function"),
     "The chain of `chain-200` on x [256, 256] float32 (`stateless_uniform`, created "
     "outside the scope), so that each kernel costs more than its dispatch. "
     "Configurations *eager*, *oh.Lazy()* and *tf.function* as in `chain-200` "
     "(information, no target)."),
    ("rnn-cell", "RNN-cell loop: 20 steps of tanh(x_t W + h U), h [4, 16]", False,
     ("eager", "lazy", "function"),
     "`h = tf.zeros([4, 16]); for t in range(20): h = tf.tanh(tf.matmul(xs[t], W) + "
     "tf.matmul(h, U))`, then `h.numpy()`; W, U [16, 16] (`stateless_normal` * 0.1), "
     "xs [20, 4, 16] (`stateless_normal`), all created outside the scope; 100 ops per "
     "call (slice, 2 matmuls, add, tanh per step) plus the `zeros`. Configurations "
     "*eager*, *oh.Lazy()* and *tf.function* as in `chain-200` (information, no "
     "target)."),
)
CASE_KEYS = tuple(c[0] for c in CASES)
TARGET_SPEEDUP = 3.0  # oh.Lazy at least 3x faster than eager on chain-200
WARMUP_CALLS = 3      # per (round, configuration), untimed
CHAIN_LEN = 100       # tanh + mul pairs: 200 ops
STEPS = 20            # RNN steps
GC_CALLS = 20         # sanity check: calls whose garbage is collected and counted
TOLERANCE = 1e-5
NULL_DEVICE = "/job:localhost/replica:0/task:0/device:OPHANDLER_NULL:0"
_null_registered = []


def null_device():
    """The null device's name, registering it in the eager context on first use."""
    if not _null_registered:
        ctx = context.context()
        ctx.ensure_initialized()
        _null_device.register(ctx._handle, NULL_DEVICE)
        _null_registered.append(True)
    return NULL_DEVICE


def fail(msg):
    """Sanity failure: raised explicitly (not `assert`), so `python -O` still exits 1."""
    raise AssertionError(msg)


# -- the cases --------------------------------------------------------------------------

def chain(x):
    h = x
    for _ in range(CHAIN_LEN):
        h = tf.tanh(h) * 1.01
    return h


def chain_inputs():
    return (tf.random.stateless_uniform([16, 16], seed=[1, 2]),)


def chain256_inputs():
    return (tf.random.stateless_uniform([256, 256], seed=[1, 2]),)


def rnn_cell(xs, w, u):
    h = tf.zeros([4, 16])
    for t in range(STEPS):
        h = tf.tanh(tf.matmul(xs[t], w) + tf.matmul(h, u))
    return h


def rnn_inputs():
    xs = tf.random.stateless_normal([STEPS, 4, 16], seed=[3, 4])
    w = tf.random.stateless_normal([16, 16], seed=[5, 6]) * 0.1
    u = tf.random.stateless_normal([16, 16], seed=[7, 8]) * 0.1
    return xs, w, u


BODIES = {"chain-200": (chain, chain_inputs), "chain-256": (chain, chain256_inputs),
          "rnn-cell": (rnn_cell, rnn_inputs)}


class Config:
    """One (case, configuration): the computation, its inputs and, for Lazy, its handler
    (created once, entered at every call) or, for tf.function, its traced function."""

    def __init__(self, case, key):
        self.case, self.key = case, key
        body, inputs = BODIES[case]
        self.args = inputs()
        self.lazy = oh.Lazy() if key in ("lazy", "build") else None
        self.function = tf.function(body) if key == "function" else None
        self.device = null_device() if key == "floor" else None
        self.body = body
        self.call = getattr(self, "call_" + key)
        self.calls = 0   # calls made by run() (warm-up and timed)
        self.times = []  # seconds per call, one per round

    def call_eager(self):
        return self.body(*self.args).numpy()

    def call_lazy(self):
        with self.lazy:
            h = self.body(*self.args)
            v = h.numpy()
        return v

    def call_build(self):
        """Records the computation without a value request; returns the seconds spent
        recording (the scope's exit, which runs what is still pending, is not in it)."""
        clock = time.perf_counter
        with self.lazy:
            t0 = clock()
            self.body(*self.args)
            t = clock() - t0
        return t

    def call_function(self):
        return self.function(*self.args).numpy()

    def call_floor(self):
        """The computation on the null device: nothing recorded, run or read; returns the
        result's handle (on the null device)."""
        with tf.device(self.device):
            return self.body(*self.args)

    def run(self, n):
        """WARMUP_CALLS untimed and `n` timed back-to-back calls (build only: the sum of
        the recording times, the collector off for all of its calls)."""
        self.calls += WARMUP_CALLS + n
        if self.key != "build":
            return _common.warm_time(self.call, WARMUP_CALLS, n)
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            for _ in range(WARMUP_CALLS):
                self.call_build()
            return sum(self.call_build() for _ in range(n)) / n
        finally:
            if enabled:
                gc.enable()

    def counters(self):
        """(compiled, flushes) of the Lazy handler, or None."""
        return None if self.lazy is None else (self.lazy.compiled, self.lazy.flushes)


def make_configs():
    """The configurations, and TensorFlow's tracing time of each case's `tf.function`
    (`get_concrete_function`, done before the sanity check, so that first calls measure
    the function's first execution)."""
    configs, trace_ms = [], {}
    for case, _, _, keys, _ in CASES:
        for key in keys:
            cfg = Config(case, key)
            if key == "function":
                t0 = time.perf_counter()
                cfg.function.get_concrete_function(*cfg.args)
                trace_ms[case] = (time.perf_counter() - t0) * 1e3
            configs.append(cfg)
    return configs, trace_ms


def _counters_check(case, cfg, step, expected):
    got = cfg.counters()
    if got != expected:
        fail("%s, %s: after %s (compiled, flushes) = %s, expected %s"
             % (case, NAMES[cfg.key], step, got, expected))


def first_lazy_call(case, cfg):
    """The first call of a Lazy configuration, checking that the ops are recorded (the
    result is pending on the handler's stack, nothing ran); (value or None, wall ms of
    the call, for build only of the recording)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()  # as in the timed calls (see Config.run)
    try:
        with cfg.lazy:
            t0 = time.perf_counter()
            h = cfg.body(*cfg.args)
            t1 = time.perf_counter()
            stack = oh.handler_of(h)
            if stack is None or cfg.lazy not in stack.handlers:
                fail("%s, %s: the result inside `with oh.Lazy()` is not on the Lazy "
                     "handler's stack (%r)" % (case, NAMES[cfg.key], stack))
            _counters_check(case, cfg, "recording (nothing may run yet)", (0, 0))
            if cfg.key == "lazy":
                v = h.numpy()
                t1 = time.perf_counter()
            else:
                v = None
            del h
    finally:
        if enabled:
            gc.enable()
    return v, (t1 - t0) * 1e3


def check(configs):
    """Sanity (untimed; each configuration's first calls in the process): every
    configuration gives eager's value; under Lazy the ops are recorded (the result is
    pending on the handler's stack, nothing ran before the value request); Lazy's first
    call compiles once and its second hits the cache, one flush per value request; each
    tf.function is traced once; the null device's result is a handle on the null device
    with the input's shape. Returns, per case, the max abs difference to eager, the
    wall time of each configuration's first call, the build-only handler's counters after
    its first call, and what the cyclic garbage collector frees per Lazy call."""
    report = {}
    for case, _, _, keys, _ in CASES:
        by_key = {c.key: c for c in configs if c.case == case}
        got, first, build_exit = {}, {}, None
        for key in keys:
            cfg = by_key[key]
            if cfg.lazy is not None:
                _counters_check(case, cfg, "creation", (0, 0))
                v, first[key] = first_lazy_call(case, cfg)
                values = [v]
            elif key == "floor":
                t0 = time.perf_counter()
                h = cfg.call()
                first[key] = (time.perf_counter() - t0) * 1e3
                for i, h in enumerate((h, cfg.call())):
                    if h.device != NULL_DEVICE or h.shape != cfg.args[0].shape:
                        fail("%s, %s: call %d gives a handle on %r of shape %s, expected "
                             "one on %r of shape %s" % (case, NAMES[key], i + 1, h.device,
                                                        h.shape, NULL_DEVICE,
                                                        cfg.args[0].shape))
                del h
                got[key] = None
                continue
            else:
                t0 = time.perf_counter()
                values = [cfg.call()]
                first[key] = (time.perf_counter() - t0) * 1e3
            if key == "lazy":
                _counters_check(case, cfg, "the first call", (1, 1))
                values.append(cfg.call())
                _counters_check(case, cfg, "the second call (a cache hit)", (1, 2))
            elif key == "build":
                build_exit = cfg.counters()  # the scope's exit may run the dropped graph
            else:
                values.append(cfg.call())
            if key == "function":
                traced = cfg.function.experimental_get_tracing_count()
                if traced != 1:
                    fail("%s: tf.function traced %d times, expected once" % (case, traced))
            got[key] = values
        worst = 0.0
        for key in keys:
            if key in ("eager", "build", "floor"):
                continue
            for i, (a, b) in enumerate(zip(got["eager"], got[key])):
                if a.shape != b.shape:
                    fail("%s, %s: call %d: shape %s != eager %s"
                         % (case, NAMES[key], i + 1, b.shape, a.shape))
                if not np.allclose(b, a, rtol=TOLERANCE, atol=TOLERANCE):
                    fail("%s, %s: call %d gives %s, eager %s"
                         % (case, NAMES[key], i + 1, b, a))
                worst = max(worst, float(np.max(np.abs(a - b))))
        report[case] = {"worst": worst, "first_ms": first, "build_exit": build_exit,
                        "gc": garbage(by_key["lazy"]),
                        "eager_gc": garbage(by_key["eager"])[0]}
    return report


def garbage(cfg):
    """(objects, ms) the cyclic garbage collector frees per call of `cfg`, over GC_CALLS
    calls made with the collector off; ms is the time of that `gc.collect()` less that of
    an empty one right after it. The Lazy counters are checked afterwards."""
    before = cfg.counters()
    clock = time.perf_counter
    gc.collect()
    gc.disable()
    try:
        for _ in range(GC_CALLS):
            cfg.call()
        t0 = clock()
        n = gc.collect()
        t1 = clock()
        gc.collect()
        t2 = clock()
    finally:
        gc.enable()
    ms = max(0.0, (t1 - t0) - (t2 - t1)) * 1e3
    if before is not None:
        _counters_check(cfg.case, cfg, "%d more calls" % GC_CALLS,
                        (before[0], before[1] + GC_CALLS))
    return n / GC_CALLS, ms / GC_CALLS


# -- measurement ------------------------------------------------------------------------

def measure(configs, rounds, n_of, seed=0):
    """The interleaved rounds (ms per call, one entry per round; `n_of`: case -> timed
    calls per round), and the Lazy handlers' counters and call counts before and after
    them."""
    lazy = [cfg for cfg in configs if cfg.lazy is not None]
    before = {(cfg.case, cfg.key): cfg.counters() for cfg in lazy}
    _common.run_rounds(configs, rounds, lambda cfg: n_of[cfg.case], seed=seed)
    after = {(cfg.case, cfg.key): cfg.counters() for cfg in lazy}
    calls = {(cfg.case, cfg.key): cfg.calls for cfg in lazy}
    times = {(cfg.case, cfg.key): [t * 1e3 for t in cfg.times] for cfg in configs}
    return times, {"before": before, "after": after, "calls": calls}


def check_counters(during):
    """Sanity after timing: no Lazy handler compiled again (every timed call hit the
    cache; for build only, what its scope's exit ran), each Lazy call counted one flush.
    """
    for (case, key), (c0, f0) in during["before"].items():
        c1, f1 = during["after"][(case, key)]
        calls = during["calls"][(case, key)]
        if c1 != c0:
            fail("%s, %s: compiled %d -> %d while timing: timed calls missed the cache"
                 % (case, NAMES[key], c0, c1))
        expected = f0 + calls
        if key == "lazy" and f1 != expected:
            fail("%s, %s: flushes %d -> %d while timing, expected %d (%d calls)"
                 % (case, NAMES[key], f0, f1, expected, calls))


def summarize(times):
    """case -> {key: stats with "speedup" (eager / this of the medians), its same-round
    IQR and "best_speedup"}."""
    out = {}
    for (case, key), ts in times.items():
        out.setdefault(case, {})[key] = _common.stats(ts)
    for row in out.values():
        eager = row["eager"]
        for s in row.values():
            s["speedup"] = eager["t"] / s["t"]
            s["speedup_q"] = _common.round_ratio_quartiles(eager["rounds"], s["rounds"])
            s["best_speedup"] = eager["min"] / s["min"]
    return out


def target_ok(summary):
    return summary["chain-200"]["lazy"]["speedup"] >= TARGET_SPEEDUP


def why_md(summary):
    """The **Why.** paragraph: Lazy's chain-200 time against the null device's floor and
    the compiled run, and the bound they put on any per-op recorder."""
    row = summary["chain-200"]
    eager, lazy, build, fn, floor = (row[k]["t"] for k in
                                     ("eager", "lazy", "build", "function", "floor"))
    ops = 2 * CHAIN_LEN
    need = eager / TARGET_SPEEDUP
    bound = eager / (floor + fn)
    if floor >= need:
        reach = ("below what the null device alone takes (%.2f ms): %.0fx is out of reach "
                 "for per-op interception on this TensorFlow, whatever the recorder costs"
                 % (floor, TARGET_SPEEDUP))
    elif floor + fn > need:
        reach = ("of which the null device alone takes %.0f%% and the null device plus "
                 "`tf.function` more than all: %.0fx is out of reach for per-op "
                 "interception on this TensorFlow, whatever the recorder costs"
                 % (floor / need * 100, TARGET_SPEEDUP))
    else:
        reach = ("of which the null device takes %.0f%%: the bound allows %.0fx, so "
                 "Lazy's own costs above the floor decide it"
                 % (floor / need * 100, TARGET_SPEEDUP))
    if build >= floor:
        above = "%.1f µs per op while recording" % ((build - floor) / ops * 1e3)
    else:
        above = ("nothing while recording (build only took %.2f ms less than the null "
                 "device, whose time includes its `tf.device` scope)" % (floor - build))
    if lazy >= build:
        above += (" and %.2f ms for the value request (the pending nodes, the structure "
                  "key, the cache hit, the compiled run) and the scope's entry and exit"
                  % (lazy - build))
    else:
        above += (" (the whole Lazy call's median is %.2f ms below build only's: the "
                  "rounds disagree, the value request's share is not resolved)"
                  % (build - lazy))
    big = summary["chain-256"]
    return (
        "**Why.** On `chain-200` a Lazy call took %.2f ms, of which recording the %d ops "
        "(*build only*) took %.2f ms, %.1f µs per op, against %.1f µs per op for eager "
        "execution (%.2f ms per call). Under the null device, which records nothing and "
        "runs nothing, the same ops took %.2f ms, %.1f µs per op: TensorFlow's Python API, "
        "TFE_Execute's placement, one custom-device call and a new output handle per op, "
        "which any per-op interception through a custom device pays, in Python or C. "
        "Above that floor Lazy adds %s. The chain as a traced `tf.function` runs in "
        "%.2f ms per call, so a recorder costing nothing above the floor, whose value "
        "request took no longer than that `tf.function`, would still take %.2f ms: "
        "eager / (null device + "
        "tf.function) = %.2fx is the best speedup any per-op recorder through a custom "
        "device can reach on this chain. For %.0fx a call would have to take at most "
        "eager / %.0f = %.2f ms, %s. On `chain-256` (information), where the kernels "
        "dominate (`tf.function` %.1fx faster than eager), Lazy is %.2fx eager (%.2f vs "
        "%.2f ms per call)."
        % (lazy, ops, build, build / ops * 1e3, eager / ops * 1e3, eager, floor,
           floor / ops * 1e3, above, fn, floor + fn, bound, TARGET_SPEEDUP,
           TARGET_SPEEDUP, need, reach, big["function"]["speedup"], big["lazy"]["speedup"],
           big["lazy"]["t"], big["eager"]["t"]))


def render_md(summary, info, args, png_name, plotted, elapsed, checks, trace_ms, during):
    lazy_keys = sorted(during["before"])
    method = (
        "One process times one *call* (build the computation and fetch its value with "
        "`.numpy()`) in plain eager TensorFlow (*eager*), inside `with oh.Lazy():` (ops "
        "recorded; the value request compiles the pending subgraph into a function cached "
        "by its structure, then runs it; `tf_ophandlers/handlers/lazy/handler.py`) and, for "
        "information, as a `tf.function` of the same computation traced once (untimed "
        "tracing: %s) and, on `chain-200`, under a custom device that records and runs "
        "nothing (*null device*, described there): the floor of per-op interception. Every "
        "configuration keeps its inputs and its Lazy handler (created once, entered at "
        "every call) or its `tf.function` for the whole run. An untimed sanity check makes "
        "each configuration's first calls, then a warm-up pass runs every configuration "
        "with N/5 calls; each of %d rounds then runs every configuration once, in a "
        "freshly shuffled order, making %d untimed + N timed back-to-back calls (N = %d "
        "for `chain-200`, %d for `chain-256`, %d for `rnn-cell`), timed with "
        "`time.perf_counter` with the garbage collector off (after a `gc.collect()`; the "
        "objects alive after setup are frozen with `gc.freeze()` so that collection stays "
        "short). The tables give the median over rounds of the mean time per call, the "
        "interquartile range (IQR) of the per-round means and the best (lowest) round, "
        "which is the least disturbed by other processes; the target uses the median. "
        "*Speedup* is eager / this of the medians, its IQR that of the same-round "
        "speedups. The sanity check requires, else the script exits non-zero: every "
        "configuration gives eager's value (`np.allclose`, rtol = atol = %g, 2 calls; max "
        "abs difference %s); inside the Lazy scope the result is pending on the handler's "
        "stack and nothing has run before `.numpy()`; Lazy's first call compiles one "
        "function (`compiled` 1) and its second is a cache hit (`compiled` still 1); every "
        "value request counts one flush; each `tf.function` is traced once; the null "
        "device's result is a handle on the null device with the input's shape; and after "
        "the warm-up and timed rounds the Lazy handlers' counters are (compiled, flushes) "
        "%s: no timed call compiled, one flush per Lazy call. Build only's recording runs "
        "nothing either (checked at its first call); its scope's exit runs whatever is "
        "still pending, and its counters after its first call, %s, show %s. Objects left "
        "to the cyclic garbage collector (a `gc.collect()` after %d calls made with the "
        "collector off): %s objects per Lazy call (eager: %s); that collection took %s per "
        "call more than an empty one right after it; with the collector off, as here, that "
        "cost is not in the times."
        % ("; ".join("%s %.0f ms" % (case, trace_ms[case]) for case in CASE_KEYS),
           args.rounds, WARMUP_CALLS, args.n_chain, args.n_chain256, args.n_rnn,
           TOLERANCE,
           "; ".join("%s %.1e" % (case, checks[case]["worst"]) for case in CASE_KEYS),
           "; ".join("%s %s %s → %s after %d calls"
                     % (case, NAMES[key], during["before"][(case, key)],
                        during["after"][(case, key)], during["calls"][(case, key)])
                     for case, key in lazy_keys),
           "; ".join("%s %s" % (case, checks[case]["build_exit"]) for case in CASE_KEYS
                     if checks[case]["build_exit"] is not None),
           "that it ran nothing (the graph each call dropped was not run)"
           if checks["chain-200"]["build_exit"][1] == 0 else
           "that it ran what the call dropped", GC_CALLS,
           " and ".join("%.0f (%s)" % (checks[case]["gc"][0], case) for case in CASE_KEYS),
           " and ".join("%.0f" % checks[case]["eager_gc"] for case in CASE_KEYS),
           " and ".join("%.2f ms (%s)" % (checks[case]["gc"][1], case)
                        for case in CASE_KEYS)))
    L = _common.intro_md(
        "`oh.Lazy()` vs. eager execution (`benchmarks/lazy.py`)", args.quick, method,
        _common.machine_md(info, info["nconfigs"], elapsed),
        _common.image_md("time per call, eager vs. oh.Lazy() (and tf.function, null "
                         "device)", png_name, plotted))
    for case, title, _, keys, desc in CASES:
        row = summary[case]
        first = checks[case]["first_ms"]
        rows = []
        for key in keys:
            s = row[key]
            rows.append([
                NAMES[key], "%.3f" % s["t"],
                "1.00x" if key == "eager" else "%.2fx" % s["speedup"],
                "—" if key == "eager" else "%.2f – %.2f" % s["speedup_q"],
                "%.3f – %.3f" % (s["q1"], s["q3"]), "%.3f" % s["min"],
                "%.1f" % first[key],
            ])
        lazy = row["lazy"]["t"]
        after = ["*First call*: wall time of the configuration's first call (single "
                 "measurement in the sanity check; the `tf.function` was traced before). "
                 "Lazy's first call records the ops, compiles them into a function "
                 "(trace and instantiation) and runs it: a one-time cost of %.1f ms over "
                 "the steady state (%.1f ms vs %.3f ms), the price of %.0f eager calls."
                 % (first["lazy"] - lazy, first["lazy"], lazy,
                    (first["lazy"] - lazy) / row["eager"]["t"])]
        L += _common.case_md(
            "%s (`%s`)" % (title, case), desc,
            ["configuration", "ms/call", "speedup (eager / this)",
             "IQR of same-round speedups", "IQR ms/call (rounds)", "best round ms/call",
             "first call ms"], rows, after)
    L += [why_md(summary), ""]

    ok = target_ok(summary)
    c, b, r = summary["chain-200"], summary["chain-256"], summary["rnn-cell"]
    T = ["- `oh.Lazy` at least %.0fx faster than eager on the small-op chain "
         "(`chain-200`), results unchanged: %.2fx (%.3f vs %.3f ms per call, same-round "
         "IQR %.2f – %.2f; results equal eager, max abs difference %.1e) — %s  (best "
         "rounds: %.2fx)"
         % (TARGET_SPEEDUP, c["lazy"]["speedup"], c["lazy"]["t"], c["eager"]["t"],
            c["lazy"]["speedup_q"][0], c["lazy"]["speedup_q"][1],
            checks["chain-200"]["worst"], _common.verdict(ok), c["lazy"]["best_speedup"]),
         "- Information, no target: `chain-256` oh.Lazy() %.2fx (%.3f vs %.3f ms); "
         "`rnn-cell` oh.Lazy() %.2fx (%.3f vs %.3f ms); `tf.function` %.1fx on "
         "`chain-200`, %.1fx on `chain-256` and %.1fx on `rnn-cell`; `chain-200` build "
         "only %.2fx (%.3f ms), null device %.3f ms (%.1f µs per op), bound on any per-op "
         "recorder eager / (null device + tf.function) %.2fx."
         % (b["lazy"]["speedup"], b["lazy"]["t"], b["eager"]["t"],
            r["lazy"]["speedup"], r["lazy"]["t"], r["eager"]["t"], c["function"]["speedup"],
            b["function"]["speedup"], r["function"]["speedup"], c["build"]["speedup"],
            c["build"]["t"], c["floor"]["t"], c["floor"]["t"] / (2 * CHAIN_LEN) * 1e3,
            c["eager"]["t"] / (c["floor"]["t"] + c["function"]["t"]))]
    L += _common.targets_md(T, "lazy", args.quick, png_name)
    return "\n".join(L), ok


COLORS = {"eager": "tab:blue", "lazy": "tab:orange", "build": "tab:olive",
          "function": "tab:gray", "floor": "tab:purple"}
LABELS = {"eager": "eager", "lazy": "oh.Lazy()", "build": "oh.Lazy()\nbuild only",
          "function": "tf.function\n(traced once)",
          "floor": "null device\n(floor; no\n.numpy())"}


def plot(summary, plt):
    fig, axes = plt.subplots(1, len(CASES) + 1, figsize=(17, 4.8),
                             gridspec_kw={"width_ratios": [
                                 0.3 + 0.22 * len(keys) for _, _, _, keys, _ in CASES]
                                 + [1.3]})
    for ax, (case, _, _, keys, _) in zip(axes, CASES):
        _common.median_bars(ax, keys, [summary[case][k] for k in keys], COLORS, LABELS,
                            "ms per call (build + .numpy())", case)

    ax_r = axes[-1]
    keys = ("lazy", "function")
    labels = {k: NAMES[k] + ("" if k == "lazy" else " (information)") for k in keys}
    top = max(TARGET_SPEEDUP, _common.grouped_bars(ax_r, CASE_KEYS, keys, summary, "speedup",
                                                   COLORS, labels))
    ax_r.axhline(1.0, color="black", lw=0.8, label="parity with eager")
    ax_r.axhline(TARGET_SPEEDUP, color="tab:red", ls=":", lw=1,
                 label="target (oh.Lazy, chain-200): %.0fx" % TARGET_SPEEDUP)
    c = summary["chain-200"]
    bound = c["eager"]["t"] / (c["floor"]["t"] + c["function"]["t"])
    x0 = CASE_KEYS.index("chain-200")
    ax_r.hlines(bound, x0 - 0.45, x0 + 0.45, color=COLORS["floor"], ls="--", lw=1.5,
                label="bound on any per-op recorder (chain-200):\neager / (null device "
                      "+ tf.function) = %.2fx" % bound)
    ax_r.set_yscale("log")
    ax_r.set_xticks(np.arange(len(CASES)))
    ax_r.set_xticklabels(["%s%s" % (c, "" if t else "\n(information)")
                          for c, _, t, _, _ in CASES], fontsize=8)
    ax_r.set_ylabel("speedup: eager time / this time (log scale)")
    ax_r.set_title("speedup over eager (IQR of same-round speedups)", fontsize=9)
    low = min(summary[c][k]["speedup_q"][0] for c in CASE_KEYS for k in keys)
    ax_r.set_ylim(min(0.5, low * 0.7), top * 10)
    ax_r.grid(axis="y", alpha=0.3)
    ax_r.legend(fontsize=6, loc="upper left")
    fig.suptitle("tf-ophandlers: oh.Lazy() (recorded, compiled at .numpy(), cached) vs. "
                 "eager execution (same run)", fontsize=10)
    return fig


def n_of(args):
    """case -> timed calls per round."""
    return {"chain-200": args.n_chain, "chain-256": args.n_chain256,
            "rnn-cell": args.n_rnn}


def main(argv=None):
    args = _common.parse_args(
        argv, __doc__, "lazy", (30, 3),
        [("n-chain", "timed chain-200 calls per round", 30, 5),
         ("n-chain256", "timed chain-256 calls per round", 5, 2),
         ("n-rnn", "timed rnn-cell calls per round", 30, 5)])

    start = time.perf_counter()
    info = _common.machine_info()
    configs, trace_ms = make_configs()
    info["nconfigs"] = len(configs)
    checks = check(configs)
    times, during = _common.measure_under_load(
        info, lambda: measure(configs, args.rounds, n_of(args)), freeze=True)
    check_counters(during)
    summary = summarize(times)
    elapsed = time.perf_counter() - start

    ok, png_path = _common.publish(
        args.out, "lazy", lambda plt: plot(summary, plt),
        lambda png_name, plotted: render_md(summary, info, args, png_name, plotted,
                                            elapsed, checks, trace_ms, during))

    for case, _, _, keys, _ in CASES:
        row = summary[case]
        print("%-9s " % case + "  ".join(
            "%s %7.3f ms %5.2fx" % (key, row[key]["t"], row[key]["speedup"])
            for key in keys))
    print("first call ms: " + "; ".join(
        "%s " % case + " ".join("%s %.1f" % (k, checks[case]["first_ms"][k]) for k in keys)
        for case, _, _, keys, _ in CASES))
    print("Lazy counters (compiled, flushes) while timing: " + "; ".join(
        "%s %s %s -> %s" % (case, key, during["before"][(case, key)],
                            during["after"][(case, key)])
        for case, key in sorted(during["before"])))
    print("target: chain-200 eager / oh.Lazy %.2fx >= %.0fx %s"
          % (summary["chain-200"]["lazy"]["speedup"], TARGET_SPEEDUP,
             "PASS" if ok else "MISS"))
    _common.print_wrote(args.out, png_path, elapsed)


if __name__ == "__main__":
    main()
