"""`oh.Async()` (ops queued on an asynchronous executor, control back to Python at once)
against synchronous eager execution and TensorFlow's own asynchronous execution.

Inside `with oh.Async():` every op of the scope, including the ops the handlers inside it
run, is queued on TensorFlow's asynchronous eager executor owned by the handler; its
outputs get their shapes from TensorFlow's shape functions, so Python code that reads
shapes (`tf.matmul`) keeps issuing ops (`tf_ophandlers/handlers/async_execution.py`).
Values are waited for at a synchronization point (`.numpy()`, `runner.sync()`, leaving
the scope with `sync_on_exit=True`, the default). Times, in one process, for each call:
*control returned* (from entering the scope to the line after the last op, still inside
the scope) and *total* (until the `.numpy()` of every result has returned), on three
cases:

  matmul-chain  20 steps of `h = tf.tanh(tf.matmul(h, a))` on 512x512 float32 (kernels
                dominate): eager, `tf.experimental.async_scope()`, TensorFlow's async
                executor (`context.executor_scope`), `oh.Async()`, and for each inner
                handler H in CheckNumericsHandler, ForwardAccumulator (primal `a`, ones
                tangent; + `acc.jvp(h)`), GradientTape (watching the input; +
                `tape.gradient(h, x)`): H alone (synchronous) and `oh.Async()` outside H
  small-ops     200 small ops (`h = tf.tanh(h) * 1.01`, 100 times) on 16x16 float32:
                eager, `tf.experimental.async_scope()`, TensorFlow's async executor,
                `oh.Async()` (information: the per-op cost of going asynchronous)
  overlap       a step = issue the matmul chain under `oh.Async() > CheckNumericsHandler()`,
                then wait on the host (`time.sleep`, a stand-in for I/O) for about the
                handlers' synchronous time, then `.numpy()`; against the same step with
                CheckNumericsHandler alone (synchronous)

Before timing, every configuration must give eager's value (allclose), the JVP and
gradient under `oh.Async() > H` must equal H alone's (and H alone's TensorFlow's
`tf.autodiff.ForwardAccumulator` / `tf.GradientTape`), and every `oh.Async()`
configuration must finish issuing its ops while the first kernel of the chain is still
blocked (a gated `tf.py_function` input, as in tests/handlers/test_tracing.py); after
timing, the median control-returned time under `oh.Async()` must be below the total.
The script exits non-zero otherwise. Configurations are interleaved (shuffled order every
round) and repeated; the reported times are medians over rounds of the mean per call.
Writes the `async_execution` section of docs/benchmarks.md and docs/async_execution.png.

    python benchmarks/async_execution.py            # full run (~1.5 min on 2 cores)
    python benchmarks/async_execution.py --quick    # smoke run (< 30 s, noisy numbers)
"""
import contextlib
import cProfile
import gc
import os
import pstats
import statistics
import threading
import time

import _common  # also puts the repository on sys.path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_ophandlers as oh  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402
from tensorflow.python.eager import executor as tf_executor  # noqa: E402

CONFIGS = (
    # key, name, (outer scope, inner handler), reference for the ratios
    ("eager", "eager (plain TensorFlow)", (None, None), "eager"),
    ("scope", "tf.experimental.async_scope()", ("scope", None), "eager"),
    ("executor", "TF async executor (executor_scope)", ("executor", None), "eager"),
    ("executor_raw", "TF async executor, tf.raw_ops (no shape reads)", ("executor", None),
     "eager"),
    ("async", "oh.Async()", ("oh", None), "eager"),
    ("cn", "CheckNumericsHandler (sync)", (None, "cn"), "cn"),
    ("async_cn", "oh.Async() > CheckNumericsHandler", ("oh", "cn"), "cn"),
    ("fa", "ForwardAccumulator (sync)", (None, "fa"), "fa"),
    ("async_fa", "oh.Async() > ForwardAccumulator", ("oh", "fa"), "fa"),
    ("gt", "GradientTape (sync)", (None, "gt"), "gt"),
    ("async_gt", "oh.Async() > GradientTape", ("oh", "gt"), "gt"),
)
NAMES = {c[0]: c[1] for c in CONFIGS}
KINDS = {c[0]: c[2] for c in CONFIGS}
REFERENCE = {c[0]: c[3] for c in CONFIGS}
INNER = (("cn", "async_cn", "CheckNumericsHandler"),
         ("fa", "async_fa", "ForwardAccumulator"), ("gt", "async_gt", "GradientTape"))
CASES = (
    # key, title, configurations, description
    ("matmul-chain", "Chain of 20 matmul + tanh steps on 512x512 float32",
     ("eager", "scope", "executor", "executor_raw", "async", "cn", "async_cn", "fa",
      "async_fa", "gt", "async_gt"),
     "`h = x; for _ in range(20): h = tf.tanh(tf.matmul(h, a))` with x [512, 512] "
     "(`stateless_uniform`) and a [512, 512] (`stateless_normal` / sqrt(512)), created "
     "outside the scopes; the kernels (about 5.4 GFLOP of matmul) dominate the call. "
     "*Control returned*: from entering the scope(s) to the line after the last op, "
     "inside the scopes; *total*: until `.numpy()` of every result has returned. "
     "*tf.experimental.async_scope()*: the chain inside it (its exit waits for all "
     "executors). *TF async executor*: the chain inside `context.executor_scope(e)` with "
     "`e = executor.new_executor(enable_async=True)` created once: the executor "
     "`oh.Async()` queues on, without the handler; *TF async executor, tf.raw_ops*: the "
     "same with `tf.raw_ops.MatMul` / `tf.raw_ops.Tanh`, which read no shapes in Python "
     "(information: queuing without any wait). *oh.Async()*: one "
     "`oh.Async(sync_on_exit=False)` per configuration, created once and entered at every "
     "call, so its exit does not wait and the wait is in `.numpy()` (with the default "
     "`sync_on_exit=True` the scope's exit is that synchronization point instead). Inner "
     "handlers: *CheckNumericsHandler* (created once per configuration, it is reusable: "
     "a `CheckNumericsV2` kernel per float output), *ForwardAccumulator* "
     "(`oh.ForwardAccumulator(a, ones)`, fresh at every call; the call also computes "
     "`acc.jvp(h)` inside the scope), *GradientTape* (`oh.GradientTape()`, fresh at "
     "every call, `tape.watch(x)`; the call also computes `tape.gradient(h, x)`, after "
     "the tape's scope and inside the Async scope). `H (sync)` is H alone; "
     "`oh.Async() > H` is H inside `oh.Async()`, so H's check, tangent and backward ops "
     "are queued too. The ratios compare with the *reference*: eager for the first five "
     "rows, H alone for `oh.Async() > H`."),
    ("small-ops", "Chain of 200 small ops on a 16x16 float32 tensor",
     ("eager", "scope", "executor", "async"),
     "`h = x; for _ in range(100): h = tf.tanh(h) * 1.01`, then `h.numpy()`, on x "
     "[16, 16] float32 (`stateless_uniform`, created outside the scope): the kernels take "
     "microseconds, the time is dispatch. Configurations as in `matmul-chain` "
     "(information, no target: what queuing costs per op)."),
    ("overlap", "Overlap: matmul chain under CheckNumericsHandler, then host wait",
     ("cn", "async_cn"),
     "A step: issue the `matmul-chain` computation under CheckNumericsHandler, then "
     "`time.sleep(W)` on the host, then `.numpy()`. W is the median time of the "
     "synchronous CheckNumericsHandler chain measured before the rounds (\"the kernels' "
     "duration\"). The host work is a sleep, a stand-in for waiting on I/O (reading the "
     "next batch, a remote call): it releases the GIL and uses no CPU. A `numpy` matmul "
     "also releases the GIL but needs cores, and this machine's cores are the ones "
     "TensorFlow's kernels run on: it would measure how two CPU-bound computations share "
     "the cores, not what the handler hides. *CheckNumericsHandler (sync)*: the step "
     "with the handler alone (the wait starts after the kernels); *oh.Async() > "
     "CheckNumericsHandler*: the step inside `oh.Async(sync_on_exit=False)` (the "
     "kernels run during the wait). *Hidden* is the share of the handlers' work "
     "(synchronous step − its measured wait) that the asynchronous step saves: "
     "(sync step − async step) / (sync step − sync wait), per round."),
)
CASE_KEYS = tuple(c[0] for c in CASES)
SIZE, STEPS = 512, 20  # matmul-chain
SMALL, CHAIN_LEN = 16, 100  # small-ops: 200 ops
WARMUP_CALLS = {"matmul-chain": 1, "small-ops": 3, "overlap": 1}  # per round, untimed
CONTROL_FRACTION = 0.25  # check: control returned <= 25% of the reference's total
TOLERANCE = 1e-5       # against eager / against the synchronous handler
REF_TOLERANCE = 1e-4   # oh's JVP / gradient against TensorFlow's own
GATE_TIMEOUT = 20.0    # s: oh.Async issuing that waits for the gated kernel fails
INFO_GATE_TIMEOUT = 0.5  # s: TensorFlow's configurations (information)
CALIBRATE_CALLS = 5


def fail(msg):
    """Sanity failure: raised explicitly (not `assert`), so `python -O` still exits 1."""
    raise AssertionError(msg)


# -- the cases --------------------------------------------------------------------------

def matmul_chain(x, a):
    h = x
    for _ in range(STEPS):
        h = tf.tanh(tf.matmul(h, a))
    return h


def matmul_chain_raw(x, a):
    """`matmul_chain` through `tf.raw_ops`, which read no shapes in Python."""
    h = x
    for _ in range(STEPS):
        h = tf.raw_ops.Tanh(x=tf.raw_ops.MatMul(a=h, b=a))
    return h


def small_chain(x, a=None):
    h = x
    for _ in range(CHAIN_LEN):
        h = tf.tanh(h) * 1.01
    return h


def make_inputs():
    x = tf.random.stateless_uniform([SIZE, SIZE], seed=[3, 4])
    a = tf.random.stateless_normal([SIZE, SIZE], seed=[1, 2]) * (1.0 / SIZE ** 0.5)
    small = tf.random.stateless_uniform([SMALL, SMALL], seed=[5, 6])
    return {"matmul-chain": (matmul_chain, x, a), "small-ops": (small_chain, small, None),
            "overlap": (matmul_chain, x, a), "tangent": tf.ones_like(a)}


class Config:
    """One (case, configuration): its body and inputs, its `oh.Async` runner or TF
    executor and its CheckNumericsHandler (created once); tapes and accumulators are
    created at every call. `wait_s` (overlap): the host wait after the issue."""

    def __init__(self, case, key, inputs):
        self.case, self.key = case, key
        self.body, self.x, self.a = inputs[case]
        if key == "executor_raw":
            self.body = matmul_chain_raw
        self.tangent = inputs["tangent"]
        self.outer, self.inner = KINDS[key]
        self.runner = oh.Async(sync_on_exit=False) if self.outer == "oh" else None
        self.executor = (tf_executor.new_executor(enable_async=True)
                         if self.outer == "executor" else None)
        self.check = oh.CheckNumericsHandler() if self.inner == "cn" else None
        self.wait_s = 0.0
        self.times = []  # (control, total, wait) seconds per call, one per round

    def scope(self):
        if self.outer == "oh":
            return self.runner
        if self.outer == "scope":
            return tf.experimental.async_scope()
        if self.outer == "executor":
            return context.executor_scope(self.executor)
        return contextlib.nullcontext()

    def issue(self, x):
        """The ops of one call under the inner handler; the tensors to fetch."""
        if self.inner is None:
            return [self.body(x, self.a)]
        if self.inner == "cn":
            with self.check:
                return [self.body(x, self.a)]
        if self.inner == "fa":
            with oh.ForwardAccumulator(self.a, self.tangent) as acc:
                h = self.body(x, self.a)
                return [h, acc.jvp(h)]
        tape = oh.GradientTape()
        with tape:
            tape.watch(x)
            h = self.body(x, self.a)
        return [h, tape.gradient(h, x)]

    def call(self):
        """One call: ((control returned, total, host wait) seconds, values)."""
        clock = time.perf_counter
        t0 = clock()
        with self.scope():
            outs = self.issue(self.x)
            t1 = clock()
        w = 0.0
        if self.wait_s:
            w0 = clock()
            time.sleep(self.wait_s)
            w = clock() - w0
        values = [o.numpy() for o in outs]
        return (t1 - t0, clock() - t0, w), values

    def gated_call(self, timeout):
        """One call whose input comes from a `tf.py_function` that blocks until released
        (or `timeout` s): (whether the issue waited for that kernel, values)."""
        gate, done = threading.Event(), []

        def slow(v):
            done.append(gate.wait(timeout))
            return v

        with self.scope():
            x = tf.ensure_shape(tf.py_function(slow, [self.x], tf.float32), self.x.shape)
            outs = self.issue(x)
            waited = bool(done)  # the kernel ran (timed out) before the issue finished
            gate.set()
        if self.runner is not None:
            self.runner.sync()
        return waited, [o.numpy() for o in outs]

    def run(self, n):
        """WARMUP_CALLS untimed and `n` timed calls, the collector off for the timed
        ones (after a `gc.collect()`); the mean (control, total, wait) seconds."""
        for _ in range(WARMUP_CALLS[self.case]):
            self.call()
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            sums = [0.0, 0.0, 0.0]
            for _ in range(n):
                t, _ = self.call()
                sums = [s + v for s, v in zip(sums, t)]
        finally:
            if enabled:
                gc.enable()
        return tuple(s / n for s in sums)


def make_configs():
    inputs = make_inputs()
    return [Config(case, key, inputs) for case, _, keys, _ in CASES for key in keys], inputs


# -- sanity -----------------------------------------------------------------------------

def _close(case, what, got, want, tol):
    if len(got) != len(want):
        fail("%s, %s: %d results, expected %d" % (case, what, len(got), len(want)))
    worst = 0.0
    for g, w in zip(got, want):
        if g.shape != w.shape:
            fail("%s, %s: shape %s != %s" % (case, what, g.shape, w.shape))
        if not np.allclose(g, w, rtol=tol, atol=tol):
            fail("%s, %s: values differ (max abs difference %.3g)"
                 % (case, what, float(np.max(np.abs(g - w)))))
        worst = max(worst, float(np.max(np.abs(g - w))))
    return worst


def tf_references(inputs):
    """TensorFlow's own JVP (tf.autodiff.ForwardAccumulator) and gradient
    (tf.GradientTape) of the matmul chain."""
    _, x, a = inputs["matmul-chain"]
    with tf.autodiff.ForwardAccumulator(a, inputs["tangent"]) as acc:
        h = matmul_chain(x, a)
        jvp = acc.jvp(h)
    with tf.GradientTape() as tape:
        tape.watch(x)
        h = matmul_chain(x, a)
    grad = tape.gradient(h, x)
    return {"fa": jvp.numpy(), "gt": grad.numpy()}


def shape_wait_profile(cfg):
    """cProfile of one call's issue: (issue ms under the profiler, ms inside
    `EagerTensor._shape_tuple`, its number of calls)."""
    prof = cProfile.Profile()
    with cfg.scope():
        prof.enable()
        outs = cfg.issue(cfg.x)
        prof.disable()
    for o in outs:
        o.numpy()
    st = pstats.Stats(prof).stats
    total = sum(v[2] for v in st.values())
    shape = [v for k, v in st.items() if "_shape_tuple" in k[2]]
    return total * 1e3, sum(v[2] for v in shape) * 1e3, sum(v[1] for v in shape)


def check(configs, inputs):
    """Sanity (untimed; each configuration's first calls): every configuration gives
    eager's value (2 calls); under `oh.Async() > H` the JVP / gradient equals H alone's,
    which equals TensorFlow's own; every `oh.Async` configuration issues all its ops
    while the chain's first kernel is blocked (gated input; fails on waiting); for
    TensorFlow's asynchronous configurations the same gated call tells whether the issue
    waited (information). Also: whether `tf.experimental.async_scope()` makes the
    current executor asynchronous, and a profile of the issue under TF's async executor
    and under `oh.Async()` (time spent reading shapes)."""
    report = {"worst": {}, "worst_ref": 0.0, "waited": {}}
    refs = tf_references(inputs)
    for case, _, keys, _ in CASES:
        by_key = {c.key: c for c in configs if c.case == case}
        got = {key: [by_key[key].call()[1] for _ in range(2)] for key in keys}
        if "eager" in got:
            base = got["eager"]
            if case == "matmul-chain":
                chain_eager = base
        else:  # overlap: the matmul-chain's eager value
            base = chain_eager
        worst = 0.0
        for key in keys:
            for i in range(2):
                worst = max(worst, _close(case, "%s call %d (result vs eager)"
                                          % (NAMES[key], i + 1), got[key][i][:1],
                                          base[i][:1], TOLERANCE))
        for sync, asyn, _ in INNER:
            if sync not in got or asyn not in got or len(got[sync][0]) < 2:
                continue
            for i in range(2):
                _close(case, "%s call %d (JVP/gradient vs %s)"
                       % (NAMES[asyn], i + 1, NAMES[sync]), got[asyn][i][1:],
                       got[sync][i][1:], TOLERANCE)
            report["worst_ref"] = max(report["worst_ref"], _close(
                case, "%s (JVP/gradient vs TensorFlow's)" % NAMES[sync], got[sync][0][1:],
                [refs[sync]], REF_TOLERANCE))
        report["worst"][case] = worst
        for key in keys:
            cfg = by_key[key]
            if cfg.outer is None:
                continue
            timeout = GATE_TIMEOUT if cfg.outer == "oh" else INFO_GATE_TIMEOUT
            waited, values = cfg.gated_call(timeout)
            _close(case, "%s gated call" % NAMES[key], values, got[key][0], TOLERANCE)
            if cfg.outer == "oh" and waited:
                fail("%s, %s: issuing the ops waited for a blocked kernel (%.0f s) "
                     "instead of returning control at once" % (case, NAMES[key], timeout))
            report["waited"][(case, key)] = waited
    with tf.experimental.async_scope():
        report["scope_is_async"] = context.context().executor.is_async()
    by_key = {c.key: c for c in configs if c.case == "matmul-chain"}
    report["profile"] = {k: shape_wait_profile(by_key[k]) for k in ("executor", "async")}
    return report


def calibrate_wait(configs):
    """The overlap case's host wait: the median time of the synchronous
    CheckNumericsHandler chain (CALIBRATE_CALLS calls), in seconds, whole ms."""
    cfg = [c for c in configs if c.case == "overlap" and c.key == "cn"][0]
    ts = [cfg.call()[0][1] for _ in range(CALIBRATE_CALLS)]
    wait = round(statistics.median(ts) * 1e3) / 1e3
    for c in configs:
        if c.case == "overlap":
            c.wait_s = wait
    return wait


# -- measurement ------------------------------------------------------------------------

def measure(configs, rounds, n_of, seed=0):
    """The interleaved rounds: (case, key) -> {"control", "total", "wait"}: ms per call,
    one entry per round."""
    _common.run_rounds(configs, rounds, lambda cfg: n_of[cfg.case], seed=seed)
    return {(cfg.case, cfg.key): {name: [t[i] * 1e3 for t in cfg.times]
                                  for i, name in enumerate(("control", "total", "wait"))}
            for cfg in configs}


def summarize(times):
    """case -> {key: {"control", "total", "wait": stats (ms), "ratio": control / total
    of the medians, "ratio_q": IQR of same-round ratios, "vs_ref" / "ctl_vs_ref": total /
    control over the reference's total (and IQRs)}} and, for overlap, "hidden"."""
    out = {}
    for (case, key), t in times.items():
        out.setdefault(case, {})[key] = {name: _common.stats(ts)
                                         for name, ts in t.items()}
    for case, row in out.items():
        for key, s in row.items():
            c, t = s["control"], s["total"]
            s["ratio"] = c["t"] / t["t"]
            s["ratio_q"] = _common.round_ratio_quartiles(c["rounds"], t["rounds"])
            ref = row.get(REFERENCE[key], row.get("eager"))
            if ref is None:
                ref = row[key]
            rt = ref["total"]
            s["vs_ref"] = t["t"] / rt["t"]
            s["vs_ref_q"] = _common.round_ratio_quartiles(t["rounds"], rt["rounds"])
            s["ctl_vs_ref"] = c["t"] / rt["t"]
            s["ctl_vs_ref_q"] = _common.round_ratio_quartiles(c["rounds"], rt["rounds"])
    ov = out["overlap"]
    sync, asyn = ov["cn"]["total"]["rounds"], ov["async_cn"]["total"]["rounds"]
    waits = ov["cn"]["wait"]["rounds"]
    fr = [(s - a) / (s - w) for s, a, w in zip(sync, asyn, waits)]
    ov["hidden"] = {"t": _common.median(fr), "q": _common.quartiles(fr)}
    ov["work"] = ov["cn"]["total"]["t"] - ov["cn"]["wait"]["t"]
    return out


def check_control(summary):
    """Sanity after timing: under oh.Async the median control-returned time is below the
    median total (work was still queued when control came back)."""
    for case, _, keys, _ in CASES:
        for key in keys:
            if KINDS[key][0] != "oh":
                continue
            s = summary[case][key]
            if not s["control"]["t"] < s["total"]["t"]:
                fail("%s, %s: control returned after %.3f ms, total %.3f ms: nothing was "
                     "left to wait for" % (case, NAMES[key], s["control"]["t"],
                                            s["total"]["t"]))


def targets(summary):
    """(check 1 ok, {inner: check 2 ok})."""
    row = summary["matmul-chain"]
    one = row["async"]["ratio"] <= CONTROL_FRACTION
    two = {sync: row[asyn]["ctl_vs_ref"] <= CONTROL_FRACTION for sync, asyn, _ in INNER}
    return one, two


# -- the markdown section ---------------------------------------------------------------

def why_md(summary, checks):
    row, small = summary["matmul-chain"], summary["small-ops"]
    ctl = {k: row[k]["control"]["t"] for k in row}
    tot = {k: row[k]["total"]["t"] for k in row}
    prof_total, prof_shape, prof_calls = checks["profile"]["executor"]
    oh_total, oh_shape, _ = checks["profile"]["async"]
    waited = checks["waited"]
    py = {sync: ctl[asyn] - ctl["async"] for sync, asyn, _ in INNER}
    ops = 2 * CHAIN_LEN
    s_e, s_x, s_a = (small[k] for k in ("eager", "executor", "async"))
    ov = summary["overlap"]

    def best(key):  # best-round total over eager's best round
        return row[key]["total"]["min"] / row["eager"]["total"]["min"]

    return (
        "**Why.** *tf.experimental.async_scope()* does not make local execution "
        "asynchronous in TensorFlow %s: inside it the current executor is %s "
        "(`context.context().executor.is_async()` = %s; the scope only sets "
        "`TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE` for remote workers and waits for all "
        "executors at its exit), so every op runs before the next is issued and control "
        "comes back after %.1f of %.1f ms (%.0f%%) on `matmul-chain`%s. *TF's async "
        "executor* (the one oh.Async queues on, entered with `context.executor_scope`) "
        "does queue the ops, but `tf.matmul` reads its inputs' shapes in Python "
        "(`a._shape_tuple()`, tensorflow/python/ops/math_ops.py in `matmul`, to choose "
        "between MatMul and BatchMatMul), and the shape of a queued tensor is only known "
        "once its kernel has run: each step waits for the previous one. A profile of one "
        "issue under it spent %.1f of %.1f ms in `EagerTensor._shape_tuple` (%d calls); "
        "the gated check confirms it: the issue %s for the blocked first kernel. With "
        "`tf.raw_ops.MatMul` / `Tanh`, which read no shapes, the same executor returns "
        "control after %.1f of %.1f ms (gated issue %s), and on `small-ops`, where "
        "nothing reads a shape either, after %.2f of %.2f ms (gated issue %s): the wait "
        "is the shape read, not the executor. *oh.Async()* answers those shape reads "
        "from TensorFlow's shape functions (the profile of its issue: %.1f ms in "
        "`_shape_tuple` of %.1f ms), so the matmul chain is issued in %.1f ms of %.1f ms "
        "total (%.0f%%), and the inner handlers' Python code (the JVP rules read "
        "shapes too) keeps issuing: `oh.Async() > H` returns after %s. Only the kernels "
        "are hidden: the handlers' Python work (their `execute`, the JVP rules, the backward pass's "
        "Python) still runs on the calling thread, before control returns: control under "
        "`oh.Async() > H` minus under `oh.Async()` alone is %s per call. Going "
        "asynchronous also costs per op on the calling thread: on `small-ops` oh.Async's "
        "issue takes %.1f µs per op (total %.1f µs per op) against %.1f µs per op for "
        "eager's whole call and %.1f µs (issue %.1f µs) for TF's async executor without "
        "the handler: oh.Async's total is %.2fx eager's there (per op, on top of the "
        "executor's queueing: the dispatch to the handler, the shape-inference cache "
        "lookup, the representation tuple). On `matmul-chain`, where kernels dominate, oh.Async's "
        "total is %.2fx eager's (TF's executor on raw ops: %.2fx; best rounds %.2fx and "
        "%.2fx): the kernels are the same, they run on the executor's thread. Such totals "
        "are noisy on this machine: `tf.experimental.async_scope()`, as synchronous as "
        "eager, takes %.2fx eager's in this run (best rounds %.2fx). Under "
        "`oh.Async() > H` the totals are %s H alone's: the kernels are the same, and H's "
        "Python work, part of H alone's time, can run while they do. On "
        "`overlap` that is the point: the synchronous step takes %.1f "
        "ms (%.1f ms handlers' work + %.1f ms wait), the asynchronous step %.1f ms, "
        "hiding %.0f%% (IQR of rounds %.0f – %.0f%%) of the handlers' work behind the "
        "host wait."
        % (tf.__version__, "synchronous" if not checks["scope_is_async"] else
           "asynchronous", checks["scope_is_async"], ctl["scope"], tot["scope"],
           row["scope"]["ratio"] * 100,
           "" if not waited.get(("matmul-chain", "scope")) else
           " (the gated issue waited for the blocked kernel)",
           prof_shape, prof_total, prof_calls,
           "waited" if waited.get(("matmul-chain", "executor")) else "did not wait",
           ctl["executor_raw"], tot["executor_raw"],
           "waited" if waited.get(("matmul-chain", "executor_raw")) else "did not wait",
           s_x["control"]["t"], s_x["total"]["t"],
           "waited" if waited.get(("small-ops", "executor")) else "did not wait",
           oh_shape, oh_total, ctl["async"], tot["async"], row["async"]["ratio"] * 100,
           ", ".join("%.1f ms (%s alone: %.1f ms, %.0f%%)"
                     % (ctl[asyn], name, tot[sync], row[asyn]["ctl_vs_ref"] * 100)
                     for sync, asyn, name in INNER),
           ", ".join("%.1f ms (%s)" % (py[sync], name) for sync, _, name in INNER),
           s_a["control"]["t"] / ops * 1e3, s_a["total"]["t"] / ops * 1e3,
           s_e["total"]["t"] / ops * 1e3, s_x["total"]["t"] / ops * 1e3,
           s_x["control"]["t"] / ops * 1e3, s_a["vs_ref"], row["async"]["vs_ref"],
           row["executor_raw"]["vs_ref"], best("async"), best("executor_raw"),
           row["scope"]["vs_ref"], best("scope"),
           ", ".join("%.2fx (same-round IQR %.2f – %.2f)"
                     % ((row[asyn]["vs_ref"],) + row[asyn]["vs_ref_q"])
                     for _, asyn, _ in INNER),
           ov["cn"]["total"]["t"], ov["work"], ov["cn"]["wait"]["t"],
           ov["async_cn"]["total"]["t"], ov["hidden"]["t"] * 100,
           ov["hidden"]["q"][0] * 100, ov["hidden"]["q"][1] * 100))


def render_md(summary, info, args, png_name, plotted, elapsed, checks, wait_s):
    method = (
        "One process times, for every call, *control returned* (from entering the "
        "scope(s) to the line after the last op, inside the scopes: when Python can go on) "
        "and *total* (until `.numpy()` of every result has returned) in plain eager "
        "TensorFlow, under `tf.experimental.async_scope()`, under TensorFlow's async "
        "executor without the handler, and inside `oh.Async(sync_on_exit=False)` (ops "
        "queued on the handler's asynchronous executor, shapes from TensorFlow's shape "
        "functions; `tf_ophandlers/handlers/async_execution.py`), alone and as the "
        "outermost handler over CheckNumericsHandler, ForwardAccumulator and GradientTape. "
        "Every configuration keeps its inputs, its `oh.Async` runner or TF executor and "
        "its CheckNumericsHandler for the whole run; ForwardAccumulator and GradientTape "
        "(single-use) are created at every call. An untimed sanity check makes each "
        "configuration's first calls, then a warm-up pass runs every configuration with "
        "U + max(1, N/5) calls; "
        "each of %d rounds then runs every configuration once, in a freshly shuffled "
        "order, making U untimed + N timed back-to-back calls (U, N = %d, %d for "
        "`matmul-chain`; %d, %d for `small-ops`; %d, %d for `overlap`), timed with "
        "`time.perf_counter` with the garbage collector off (after a `gc.collect()`; the "
        "objects alive after setup are frozen with `gc.freeze()`). The tables give the "
        "median over rounds of the mean time per call, the IQR of the per-round means and "
        "of the same-round ratios, and the best (lowest) round. The sanity check "
        "requires, else the script exits non-zero: every configuration gives eager's "
        "value (`np.allclose`, rtol = atol = %g, 2 calls; max abs difference %s); under "
        "`oh.Async() > H` the JVP / gradient equals H alone's (same tolerance), and H "
        "alone's equals TensorFlow's own `tf.autodiff.ForwardAccumulator` / "
        "`tf.GradientTape` (rtol = atol = %g; max abs difference %.1e); every "
        "`oh.Async()` configuration issues all its ops while the chain's input kernel (a "
        "`tf.py_function` blocked on an event, up to %.0f s) has not run, i.e. without "
        "waiting for any kernel (the same gated call on TensorFlow's configurations, "
        "released after %.1f s, is information: %s); and after timing the median "
        "control-returned time under every `oh.Async()` configuration is below its "
        "total (ratios in the tables). The overlap case's host wait W = %.0f ms is the "
        "median of %d synchronous CheckNumericsHandler chains measured before the rounds."
        % (args.rounds, WARMUP_CALLS["matmul-chain"], args.n_chain,
           WARMUP_CALLS["small-ops"], args.n_small, WARMUP_CALLS["overlap"],
           args.n_overlap, TOLERANCE,
           "; ".join("%s %.1e" % (c, checks["worst"][c]) for c in CASE_KEYS),
           REF_TOLERANCE, checks["worst_ref"], GATE_TIMEOUT, INFO_GATE_TIMEOUT,
           "; ".join("%s %s %s" % (case, NAMES[key], "waited" if w else "did not wait")
                     for (case, key), w in sorted(checks["waited"].items())
                     if KINDS[key][0] != "oh"),
           wait_s * 1e3, CALIBRATE_CALLS))
    L = _common.intro_md(
        "`oh.Async()` vs. synchronous and TensorFlow's asynchronous execution "
        "(`benchmarks/async_execution.py`)", args.quick, method,
        _common.machine_md(info, info["nconfigs"], elapsed),
        _common.image_md("control returned and total time per call: eager, TensorFlow's "
                         "async execution, oh.Async() alone and over inner handlers; "
                         "overlap with host wait", png_name, plotted))
    for case, title, keys, desc in CASES:
        row = summary[case]
        rows, after = [], []
        if case == "overlap":
            for key in keys:
                s = row[key]
                rows.append([NAMES[key], "%.2f" % s["total"]["t"],
                             "%.2f" % s["wait"]["t"],
                             "%.2f" % (s["total"]["t"] - s["wait"]["t"]),
                             "%.2f" % s["control"]["t"],
                             "%.2f – %.2f" % (s["total"]["q1"], s["total"]["q3"]),
                             "%.2f" % s["total"]["min"]])
            header = ["configuration", "step ms", "of which host wait ms",
                      "step − wait ms", "control returned ms (issue)", "IQR step ms",
                      "best round step ms"]
            after = ["*Hidden*: the asynchronous step saves %.1f of the %.1f ms of "
                     "handlers' work (synchronous step − its wait): %.0f%% (IQR of "
                     "same-round fractions %.0f – %.0f%%). What remains is the issue on "
                     "the calling thread (%.1f ms) and whatever of the kernels did not fit "
                     "in the wait."
                     % (row["cn"]["total"]["t"] - row["async_cn"]["total"]["t"],
                        row["work"], row["hidden"]["t"] * 100, row["hidden"]["q"][0] * 100,
                        row["hidden"]["q"][1] * 100, row["async_cn"]["control"]["t"])]
        else:
            nd = 2 if case == "matmul-chain" else 3
            f = "%%.%df" % nd
            for key in keys:
                s = row[key]
                c, t = s["control"], s["total"]
                ref = REFERENCE[key] if case == "matmul-chain" else "eager"
                rows.append([NAMES[key], f % c["t"], f % t["t"],
                             "%.2f (%.2f – %.2f)" % ((s["ratio"],) + s["ratio_q"]),
                             "—" if key == ref else "%.2f" % s["ctl_vs_ref"],
                             "—" if key == ref else "%.2fx (%.2f – %.2f)"
                             % ((s["vs_ref"],) + s["vs_ref_q"]),
                             (f + " – " + f) % (t["q1"], t["q3"]), f % t["min"]])
            header = ["configuration", "control returned ms", "total ms",
                      "control / total (IQR)", "control / reference total",
                      "total / reference total (IQR)", "IQR total ms",
                      "best round total ms"]
            if case == "small-ops":
                after = ["Per op (200 ops): eager %.1f µs; async_scope %.1f µs; TF async "
                         "executor %.1f µs total, %.1f µs issue; oh.Async() %.1f µs "
                         "total, %.1f µs issue."
                         % tuple(v / (2 * CHAIN_LEN) * 1e3 for v in (
                             row["eager"]["total"]["t"], row["scope"]["total"]["t"],
                             row["executor"]["total"]["t"], row["executor"]["control"]["t"],
                             row["async"]["total"]["t"], row["async"]["control"]["t"]))]
        L += _common.case_md("%s (`%s`)" % (title, case), desc, header, rows, after)
    L += [why_md(summary, checks), ""]

    one, two = targets(summary)
    row = summary["matmul-chain"]
    a = row["async"]
    T = ["- Returns control to Python at once (check: under `oh.Async()` on "
         "`matmul-chain` control returns within %.0f%% of the total): after %.2f of "
         "%.2f ms, %.0f%% (same-round IQR %.0f – %.0f%%) — %s. For comparison "
         "`tf.experimental.async_scope()` returns after %.0f%% of its total (%.1f of "
         "%.1f ms) and TF's async executor after %.0f%% (%.1f of %.1f ms)."
         % (CONTROL_FRACTION * 100, a["control"]["t"], a["total"]["t"], a["ratio"] * 100,
            a["ratio_q"][0] * 100, a["ratio_q"][1] * 100, _common.verdict(one),
            row["scope"]["ratio"] * 100, row["scope"]["control"]["t"],
            row["scope"]["total"]["t"], row["executor"]["ratio"] * 100,
            row["executor"]["control"]["t"], row["executor"]["total"]["t"])]
    for sync, asyn, name in INNER:
        s = row[asyn]
        T.append("- As the outermost handler it hides the overhead of %s inside it "
                 "(check: control under `oh.Async() > %s` returns within %.0f%% of "
                 "%s alone's time): %.2f ms vs %.2f ms, %.0f%% (same-round IQR %.0f – "
                 "%.0f%%) — %s"
                 % (name, name, CONTROL_FRACTION * 100, name, s["control"]["t"],
                    row[sync]["total"]["t"], s["ctl_vs_ref"] * 100,
                    s["ctl_vs_ref_q"][0] * 100, s["ctl_vs_ref_q"][1] * 100,
                    _common.verdict(two[sync])))
    T.append("- Not hidden: the handlers' Python work runs on the calling thread; only "
             "their kernels are queued. Control under `oh.Async() > H` minus under "
             "`oh.Async()` alone: %s per call; on `small-ops` oh.Async's issue costs "
             "%.1f µs per op against eager's %.1f µs for the whole call (total %.2fx "
             "eager's; information, no target)."
             % (", ".join("%.1f ms (%s)" % (row[asyn]["control"]["t"]
                                            - a["control"]["t"], name)
                          for _, asyn, name in INNER),
                summary["small-ops"]["async"]["control"]["t"] / (2 * CHAIN_LEN) * 1e3,
                summary["small-ops"]["eager"]["total"]["t"] / (2 * CHAIN_LEN) * 1e3,
                summary["small-ops"]["async"]["vs_ref"]))
    T.append("- The issue states no number for Async; the %.0f%% bound of these checks "
             "is this script's reading of \"at once\" / \"hides\": Python is back after "
             "a quarter of the work at most, i.e. at least three quarters of the wait "
             "can be spent on something else." % (CONTROL_FRACTION * 100))
    L += _common.targets_md(T, "async_execution", args.quick, png_name, plural=True)
    return "\n".join(L), (one and all(two.values()))


COLORS = {"control": "tab:orange", "total": "tab:blue", "wait": "lightgray"}
LABELS = {"eager": "eager", "scope": "tf async_\nscope()", "executor": "TF async\nexecutor",
          "executor_raw": "TF async\nexecutor,\nraw_ops",
          "async": "oh.Async()", "cn": "CheckNum.\n(sync)", "async_cn": "Async >\nCheckNum.",
          "fa": "FwdAcc.\n(sync)", "async_fa": "Async >\nFwdAcc.", "gt": "Tape\n(sync)",
          "async_gt": "Async >\nTape"}


def pair_bars(ax, keys, row, title, fmt):
    """Control returned and total per configuration, side by side (median, IQR)."""
    xs = np.arange(len(keys))
    top = 0.0
    for j, name in enumerate(("control", "total")):
        ss = [row[k][name] for k in keys]
        pos = xs + (j - 0.5) * 0.4
        ax.bar(pos, [s["t"] for s in ss], 0.38, yerr=_common.iqr_err(ss), capsize=2,
               color=COLORS[name], label="control returned" if j == 0 else "total")
        _common.label_bars(ax, pos, [max(s["t"], s["q3"]) for s in ss],
                           [fmt % s["t"] for s in ss], fontsize=6)
        top = max(top, max(s["q3"] for s in ss))
    ax.set_xticks(xs)
    ax.set_xticklabels([LABELS[k] for k in keys], fontsize=7)
    ax.set_ylabel("ms per call")
    ax.set_ylim(0, top * 1.15)
    ax.set_title("%s\n(median, IQR of rounds)" % title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")


def plot(summary, plt):
    fig, axes = plt.subplots(1, 3, figsize=(17, 5), gridspec_kw={"width_ratios":
                                                                  [3.4, 1.5, 1.0]})
    pair_bars(axes[0], CASES[0][2], summary["matmul-chain"],
              "matmul-chain (512x512, 20 steps): control returned vs total", "%.1f")
    pair_bars(axes[1], CASES[1][2], summary["small-ops"],
              "small-ops (200 ops on 16x16): per call", "%.2f")
    ax = axes[2]
    ov = summary["overlap"]
    keys = CASES[2][2]
    xs = np.arange(len(keys))
    waits = [ov[k]["wait"]["t"] for k in keys]
    rest = [ov[k]["total"]["t"] - w for k, w in zip(keys, waits)]
    ax.bar(xs, waits, 0.6, color=COLORS["wait"], hatch="//", label="host wait (sleep)")
    ax.bar(xs, rest, 0.6, bottom=waits, color=COLORS["total"],
           label="rest of the step", yerr=_common.iqr_err([ov[k]["total"] for k in keys]),
           capsize=3)
    _common.label_bars(ax, xs, [ov[k]["total"]["q3"] for k in keys],
                       ["%.1f ms" % ov[k]["total"]["t"] for k in keys])
    ax.set_xticks(xs)
    ax.set_xticklabels([LABELS[k] for k in keys], fontsize=7)
    ax.set_ylabel("ms per step")
    ax.set_ylim(0, max(ov[k]["total"]["q3"] for k in keys) * 1.2)
    ax.set_title("overlap: step = issue + wait + .numpy()\nhidden %.0f%% of the "
                 "handlers' work" % (ov["hidden"]["t"] * 100), fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    fig.suptitle("tf-ophandlers: oh.Async() (ops queued, control back to Python) vs. "
                 "synchronous and TensorFlow's asynchronous execution (same run)",
                 fontsize=10)
    return fig


def main(argv=None):
    args = _common.parse_args(
        argv, __doc__, "async_execution", (20, 3),
        [("n-chain", "timed matmul-chain calls per round", 2, 1),
         ("n-small", "timed small-ops calls per round", 20, 5),
         ("n-overlap", "timed overlap steps per round", 2, 1)])

    start = time.perf_counter()
    info = _common.machine_info()
    configs, inputs = make_configs()
    info["nconfigs"] = len(configs)
    checks = check(configs, inputs)
    wait_s = calibrate_wait(configs)
    n_of = {"matmul-chain": args.n_chain, "small-ops": args.n_small,
            "overlap": args.n_overlap}
    times = _common.measure_under_load(
        info, lambda: measure(configs, args.rounds, n_of), freeze=True)
    summary = summarize(times)
    check_control(summary)
    elapsed = time.perf_counter() - start

    ok, png_path = _common.publish(
        args.out, "async_execution", lambda plt: plot(summary, plt),
        lambda png_name, plotted: render_md(summary, info, args, png_name, plotted,
                                            elapsed, checks, wait_s))

    for case, _, keys, _ in CASES:
        row = summary[case]
        print("%s:" % case)
        for key in keys:
            s = row[key]
            print("  %-36s control %8.3f ms  total %8.3f ms  ratio %.2f  total/ref %.2fx"
                  % (NAMES[key], s["control"]["t"], s["total"]["t"], s["ratio"],
                     s["vs_ref"]))
    ov = summary["overlap"]
    print("overlap: wait %.1f ms, hidden %.0f%% of %.1f ms handlers' work"
          % (wait_s * 1e3, ov["hidden"]["t"] * 100, ov["work"]))
    print("profile of one issue (ms total, ms in _shape_tuple, calls): %s"
          % checks["profile"])
    print("gated issue waited: %s" % {"%s/%s" % k: v for k, v in checks["waited"].items()})
    one, two = targets(summary)
    print("check 1 (control <= %.0f%% of total under oh.Async): %s; check 2: %s"
          % (CONTROL_FRACTION * 100, "PASS" if one else "MISS",
             ", ".join("%s %s" % (k, "PASS" if v else "MISS") for k, v in two.items())))
    _common.print_wrote(args.out, png_path, elapsed)
    return ok


if __name__ == "__main__":
    main()
