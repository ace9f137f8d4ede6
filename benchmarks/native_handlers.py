"""Per-op cost of handlers written in C++ (oh.native) against plain eager TensorFlow.

Times, in one process, a small op (tf.add on 2x2 float32 whose inputs already live on
the handler stack, the steady state of a chain of ops in a scope) under:

  plain        no handler
  cxx-1        oh.native.PassThrough() (no execute hook: ABI version 4's forwarding)
  cxx-2        two nested oh.native.PassThrough() (the cost of a further C++ level)
  py-1         oh.OpHandler() (the Python pass-through)
  py-2         two nested oh.OpHandler()
  py-skip      a Python handler whose handles_ops excludes the op
  counter      oh.native.OpCounter() (an execute hook per op, no-GIL path)
  oplog        oh.OpLogHandler()

Configurations are interleaved (shuffled order every round), gc disabled while timing;
the reported time is the median over rounds of the mean per-op time, ratios are
same-round ratios to plain. Also checks that OpCounter's counts equal OpLogHandler's
records for the timed ops. Writes the `native_handlers` section of docs/benchmarks.md.

    python benchmarks/native_handlers.py           # full run (~1 min on 2 cores)
    python benchmarks/native_handlers.py --quick   # smoke run
"""
import collections
import contextlib
import os
import time

import _common  # also puts the repository on sys.path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402
import tf_ophandlers as oh  # noqa: E402

CONFIGS = (
    ("plain", "plain eager TensorFlow", lambda: []),
    ("cxx-1", "`oh.native.PassThrough()` (C++)", lambda: [oh.native.PassThrough()]),
    ("cxx-2", "2 nested `oh.native.PassThrough()`",
     lambda: [oh.native.PassThrough(), oh.native.PassThrough()]),
    ("py-1", "`oh.OpHandler()` (Python pass-through)", lambda: [oh.OpHandler()]),
    ("py-2", "2 nested `oh.OpHandler()`", lambda: [oh.OpHandler(), oh.OpHandler()]),
    ("py-skip", "Python handler whose `handles_ops` excludes the op (`MatMul` only)",
     lambda: [MatMulOnly()]),
    ("counter", "`oh.native.OpCounter()` (C++)", lambda: [oh.native.OpCounter()]),
    ("oplog", "`oh.OpLogHandler()` (Python)", lambda: [oh.OpLogHandler()]),
)
class MatMulOnly(oh.OpHandler):
    """A Python handler that executes only MatMul: other ops cost no Python call."""

    handles_ops = frozenset({"MatMul"})

    def execute(self, op, inputs):
        return self.next.execute(op, inputs)


TARGET_CXX = 1.15      # a C++ pass-through: at most 1.15x plain eager per small op
TARGET_LEVEL_US = 1.0  # each further C++ level: at most +1 us per small op
TARGET_COUNTER = 5.0   # OpCounter at least 5x cheaper per op than OpLogHandler (overhead)
WARMUP_OPS = 20


class Config:
    def __init__(self, key):
        self.key = key
        self.make = dict((k, m) for k, _, m in CONFIGS)[key]
        self.times = []
        self.handlers = self.make()
        a0 = tf.random.stateless_uniform([2, 2], seed=[1, 2])
        b0 = tf.random.stateless_uniform([2, 2], seed=[3, 4])
        self.a0, self.b0 = a0, b0

    def run(self, n):
        if self.key in ("counter", "oplog"):
            self.handlers = self.make()  # fresh: records do not pile up across rounds
        return self._timed(self.handlers, n)

    def _timed(self, handlers, n):
        # Every configuration times from the same Python stack depth: TensorFlow captures
        # the Python stack on every op (StackTrace::Capture, a cost per frame), so
        # entering the scopes by recursion (a frame per handler) would bill the deeper
        # configurations for frames, not for their handlers.
        with contextlib.ExitStack() as scopes:
            for h in handlers:
                scopes.enter_context(h)
            a, b = tf.identity(self.a0), tf.identity(self.b0)
            for _ in range(WARMUP_OPS):
                tf.add(a, b)
            return _common.time_per_call(lambda: tf.add(a, b), n)


def measure(rounds, n):
    configs = [Config(k) for k, _, _ in CONFIGS]
    _common.run_rounds(configs, rounds, lambda cfg: n)
    return {cfg.key: [t * 1e6 for t in cfg.times] for cfg in configs}


def counts_agree(n=200):
    log, counter = oh.OpLogHandler(), oh.native.OpCounter()
    a0 = tf.random.stateless_uniform([2, 2], seed=[1, 2])

    def prog():
        a = tf.identity(a0)
        for _ in range(n):
            a = tf.add(a, a) * 0.5
        return tf.reduce_sum(a)
    with log:
        prog()
    with counter:
        prog()
    return counter.counts == dict(collections.Counter(r.op_type for r in log.records))


def summarize(times):
    plain = times["plain"]
    out = {}
    for key, _, _ in CONFIGS:
        row = _common.stats(times[key], "us")
        row["ratio"] = row["us"] / _common.median(plain)
        row["ratio_q"] = _common.round_ratio_quartiles(times[key], plain)
        out[key] = row
    out["level_us"] = _common.median([b - a for a, b in zip(times["cxx-1"], times["cxx-2"])])
    over = lambda k: _common.median([t - p for t, p in zip(times[k], plain)])  # noqa: E731
    out["counter_over_us"], out["oplog_over_us"] = over("counter"), over("oplog")
    return out


def render_md(s, info, args, agree, elapsed):
    method = (
        "One process times `tf.add` on 2x2 float32 tensors whose inputs were created "
        "inside the scopes (`a = tf.identity(a0)`), under each configuration below. "
        "After a warm-up pass, each of %d rounds runs every configuration once in a "
        "freshly shuffled order, as %d untimed + %d timed back-to-back ops with the "
        "garbage collector disabled. Times are medians over rounds; ratios are to plain "
        "eager in the same run, with the quartiles of the same-round ratios. "
        "`OpCounter` and `OpLogHandler` are made fresh each round. `PassThrough` has no "
        "execute hook (ABI version 4): the runtime forwards its ops, and skips the "
        "forwarding levels in between; `OpCounter` runs its C++ execute hook per op."
        % (args.rounds, WARMUP_OPS, args.n))
    L = _common.intro_md("Handlers in C++ (`oh.native`): per-op cost", args.quick, method,
                         _common.machine_md(info, len(CONFIGS), elapsed), "")
    rows = []
    for key, title, _ in CONFIGS:
        r = s[key]
        rows.append([title, "%.2f" % r["us"], "%.2fx" % r["ratio"],
                     "%.2f-%.2f" % r["ratio_q"]])
    L += [_common.md_table(["configuration", "us/op", "vs plain", "round ratios q1-q3"],
                           rows), ""]
    ok_cxx = s["cxx-1"]["ratio"] <= TARGET_CXX
    ok_level = s["level_us"] <= TARGET_LEVEL_US
    factor = s["oplog_over_us"] / max(s["counter_over_us"], 1e-9)
    ok_counter = factor >= TARGET_COUNTER and agree
    L += [
        "- C++ pass-through at most %.2fx plain eager: %.2fx %s" % (
            TARGET_CXX, s["cxx-1"]["ratio"], _common.verdict(ok_cxx)),
        "- each further C++ level at most +%.1f us: %+.2f us %s" % (
            TARGET_LEVEL_US, s["level_us"], _common.verdict(ok_level)),
        "- OpCounter's overhead over plain at least %.0fx smaller than OpLogHandler's: "
        "%+.2f us vs %+.2f us (%s), counts equal to OpLogHandler's records: %s %s" % (
            TARGET_COUNTER, s["counter_over_us"], s["oplog_over_us"],
            # At or below plain (noise around a zero overhead): no meaningful factor.
            "%.1fx" % factor if s["counter_over_us"] > 0 else "OpCounter at or below plain",
            "yes" if agree else "NO", _common.verdict(ok_counter)),
        "",
        "A further level's wall-clock cost is within this page's run-to-run noise; its "
        "instruction count, which load does not change, is on the page "
        "[native path: instructions per op](native_callgrind.md).",
    ]
    return "\n".join(L), {"cxx": ok_cxx, "level": ok_level, "counter": ok_counter}


def main(argv=None):
    args = _common.parse_args(argv, __doc__, "native_handlers", (15, 3),
                              [("n", "timed ops per round", 2000, 200)], what="ops")
    start = time.perf_counter()
    info = _common.machine_info()
    times = _common.measure_under_load(info, lambda: measure(args.rounds, args.n))
    agree = counts_agree()
    s = summarize(times)
    elapsed = time.perf_counter() - start
    body, verdicts = render_md(s, info, args, agree, elapsed)
    _common.write_section(args.out, "native_handlers", body)
    for key, _, _ in CONFIGS:
        print("%-8s %8.2f us %5.2fx" % (key, s[key]["us"], s[key]["ratio"]))
    print("level %+.2f us; counter %+.2f us vs oplog %+.2f us; counts agree: %s" % (
        s["level_us"], s["counter_over_us"], s["oplog_over_us"], agree))
    print("targets: " + ", ".join("%s %s" % (k, "PASS" if v else "MISS")
                                  for k, v in verdicts.items()))
    print("wrote %s" % args.out)


if __name__ == "__main__":
    main()
