"""`oh.DebuggerHandler` (tfdbg V2 dumps) against `oh.OpLogHandler` and TensorFlow's
`tf.debugging.experimental.enable_dump_debug_info`, per eager op.

Times, in one process, the same eager ops under:

  plain        no handler, no dumping
  oplog        `oh.OpLogHandler()` (records op type, shapes, dtypes in memory)
  debugger     `oh.DebuggerHandler(root)` in NO_TENSOR mode (an Execution event per op,
               with its Python stack, into TensorFlow's DebugEventsWriter)
  health       `oh.DebuggerHandler(root, "FULL_HEALTH")` (information: one
               DebugNumericSummaryV2 per output, read back to the host)
  tf-dump      `enable_dump_debug_info(root)` in NO_TENSOR mode (information: TensorFlow's
               op callback; enabled before and disabled after each timed batch, each time
               on a new dump root, since its writer cannot be reopened)

on two cases: `add` (a 2x2 `tf.add`, inputs created outside the scope: the per-op cost)
and `keras` (an eager Keras MLP forward, 8-32-32-4 on a batch of 16: deep Python stacks,
time per call divided by its ops). Before timing, the dumps are read back with
`DebugDataReader`: the handler's and TensorFlow's list the same op types. Configurations
are interleaved (shuffled order every round); the reported time is the median over rounds
of the mean time per op. Target: debugger <= 1.3x oplog per op.
Writes the `debugger` section of docs/benchmarks.md and docs/debugger.png.

    python benchmarks/debugger.py            # full run (~1 min on 2 cores)
    python benchmarks/debugger.py --quick    # smoke run (< 30 s, noisy numbers)
"""
import contextlib
import os
import shutil
import tempfile
import time

import _common  # also puts the repository on sys.path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.debug.lib import debug_events_reader  # noqa: E402
import tf_ophandlers as oh  # noqa: E402

KEYS = ("plain", "oplog", "debugger", "health", "tf-dump")
NAMES = {"plain": "plain eager", "oplog": "oh.OpLogHandler()",
         "debugger": "oh.DebuggerHandler (NO_TENSOR)",
         "health": "oh.DebuggerHandler (FULL_HEALTH)",
         "tf-dump": "enable_dump_debug_info (NO_TENSOR)"}
CASES = (
    ("add", "2x2 `tf.add` (per-op cost)",
     "`tf.add(a, b)` on 2x2 float32 tensors created outside the scope."),
    ("keras", "Eager Keras MLP forward, 8-32-32-4, batch 16",
     "`model(x)` of a `keras.Sequential` of three Dense layers (ReLU), called eagerly: "
     "about %d ops per call with Keras's deep Python stacks; time per call / ops per "
     "call."),
)
TARGET_RATIO = 1.3  # debugger (NO_TENSOR) per op <= 1.3x OpLogHandler per op
WARMUP = 10


class Config:
    def __init__(self, case, key, workdir):
        self.case, self.key, self.workdir = case, key, workdir
        self.times = []
        if case == "add":
            a, b = tf.ones([2, 2]), tf.fill([2, 2], 2.0)
            self.fn = lambda: tf.add(a, b)
        else:
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, "relu"),
                                      keras.layers.Dense(32, "relu"), keras.layers.Dense(4)])
            x = tf.random.stateless_normal([16, 8], seed=[1, 2])
            model(x)
            self.fn = lambda: model(x)
        self.handler = None
        if key == "oplog":
            self.handler = oh.OpLogHandler()
        elif key in ("debugger", "health"):
            self.handler = oh.DebuggerHandler(
                os.path.join(workdir, "%s-%s" % (case, key)),
                tensor_debug_mode="NO_TENSOR" if key == "debugger" else "FULL_HEALTH")
        self.dumps = 0
        self.ops_per_call = 1

    @contextlib.contextmanager
    def scope(self):
        if self.key == "tf-dump":
            self.dumps += 1
            root = os.path.join(self.workdir, "tf-%s-%d" % (self.case, self.dumps))
            tf.debugging.experimental.enable_dump_debug_info(root)
            try:
                yield root
            finally:
                tf.debugging.experimental.disable_dump_debug_info()
        elif self.handler is None:
            yield None
        else:
            if self.key == "oplog":
                self.handler.clear()
            with self.handler:
                yield None

    def run(self, n):
        with self.scope():
            return _common.warm_time(self.fn, WARMUP, n) / self.ops_per_call


def _executions(root):
    with debug_events_reader.DebugDataReader(root) as reader:
        reader.update()
        return [e.op_type for e in reader.executions()]


def check(configs, workdir):
    """The handler's dump and TensorFlow's list the same ops for one call of each case;
    sets each configuration's ops per call."""
    for case, _, _ in CASES:
        by_key = {c.key: c for c in configs if c.case == case}
        log = oh.OpLogHandler()
        with log:
            by_key["plain"].fn()
        ours_root = os.path.join(workdir, "check-" + case)
        with oh.DebuggerHandler(ours_root):
            by_key["plain"].fn()
        with by_key["tf-dump"].scope() as tf_root:
            by_key["plain"].fn()
        ours, theirs = _executions(ours_root), _executions(tf_root)
        if ours != theirs or not ours:
            raise SystemExit("%s: DebuggerHandler dumped %s, enable_dump_debug_info %s"
                             % (case, ours, theirs))
        for c in by_key.values():
            c.ops_per_call = len(log.records)
    return {case: [c for c in configs if c.case == case][0].ops_per_call
            for case, _, _ in CASES}


def summarize(configs):
    out = {}
    for cfg in configs:
        s = _common.stats([t * 1e6 for t in cfg.times], "us")
        out.setdefault(cfg.case, {})[cfg.key] = s
    for row in out.values():
        for key in KEYS:
            s = row[key]
            s["vs_oplog"] = s["us"] / row["oplog"]["us"]
            s["vs_oplog_q"] = _common.round_ratio_quartiles(s["rounds"], row["oplog"]["rounds"])
            s["vs_plain"] = s["us"] / row["plain"]["us"]
    return out


def render_md(summary, info, args, png_name, plotted, elapsed, ops):
    method = (
        "One process times the same eager ops under each configuration: plain eager, "
        "`oh.OpLogHandler()`, `oh.DebuggerHandler(root)` (NO_TENSOR), "
        "`oh.DebuggerHandler(root, \"FULL_HEALTH\")` and TensorFlow's "
        "`enable_dump_debug_info(root)` (NO_TENSOR; enabled before and disabled after "
        "each timed batch, on a new dump root each time, since TensorFlow's writer cannot "
        "be reopened once closed; enabling and disabling are not timed). Handlers are "
        "created once and their scope entered once per round (its exit flushes the dump "
        "files, untimed). Before timing, one call of each case is dumped by the handler "
        "and by TensorFlow and read back with `DebugDataReader`: both list the same op "
        "types (%s). After a warm-up pass, each of %d rounds runs every configuration "
        "once, in a freshly shuffled order, as %d untimed + N timed back-to-back calls "
        "(N = %d for `add`, %d for `keras`), timed with `time.perf_counter` with the "
        "garbage collector off; the time per op is the time per call divided by the ops "
        "per call. Tables give the median over rounds, the IQR of the same-round ratios "
        "to `oh.OpLogHandler()`, and the best round."
        % ("; ".join("%s: %d ops per call" % kv for kv in ops.items()), args.rounds,
           WARMUP, args.n_add, args.n_keras))
    L = _common.intro_md(
        "DebuggerHandler: tfdbg dumps per op (`benchmarks/debugger.py`)", args.quick, method,
        _common.machine_md(info, len(KEYS) * len(CASES), elapsed),
        _common.image_md("per-op time of the dumping configurations", png_name, plotted),
        "calls")
    for case, title, desc in CASES:
        rows = []
        for key in KEYS:
            s = summary[case][key]
            rows.append([NAMES[key], "%.2f" % s["us"], "%.2fx" % s["vs_plain"],
                         "%.2fx" % s["vs_oplog"],
                         "%.2f – %.2f" % tuple(s["vs_oplog_q"]), "%.2f" % s["min"]])
        L += _common.case_md(title, desc % ops[case] if "%d" in desc else desc,
                             ["configuration", "µs/op", "ratio to plain",
                              "ratio to OpLogHandler", "IQR of same-round ratios",
                              "best round µs/op"], rows)
    ok = all(summary[case]["debugger"]["vs_oplog"] <= TARGET_RATIO for case, _, _ in CASES)
    T = ["- `oh.DebuggerHandler` in NO_TENSOR mode costs at most %.1fx an "
         "`oh.OpLogHandler()` per op: %s — %s" % (
             TARGET_RATIO, "; ".join("%s %.2fx" % (case, summary[case]["debugger"]["vs_oplog"])
                                     for case, _, _ in CASES), _common.verdict(ok))]
    L += _common.targets_md(T, "debugger", args.quick, png_name)
    return "\n".join(L), ok


def plot(summary, plt):
    fig, axes = plt.subplots(1, len(CASES), figsize=(12, 4.2))
    colors = {"plain": "tab:gray", "oplog": "tab:blue", "debugger": "tab:green",
              "health": "tab:olive", "tf-dump": "tab:orange"}
    labels = {"plain": "plain", "oplog": "OpLog", "debugger": "Debugger\nNO_TENSOR",
              "health": "Debugger\nFULL_HEALTH", "tf-dump": "TF dump\nNO_TENSOR"}
    for ax, (case, title, _) in zip(axes, CASES):
        _common.median_bars(ax, KEYS, [summary[case][k] for k in KEYS], colors, labels,
                            "µs per op", title.replace("`", ""), key="us", fmt="%.1f")
    return fig


def main(argv=None):
    args = _common.parse_args(
        argv, __doc__, "debugger", (15, 3),
        [("n-add", "timed tf.add calls per round", 1000, 100),
         ("n-keras", "timed Keras forward calls per round", 60, 8)])
    start = time.perf_counter()
    info = _common.machine_info()
    info["keras"] = keras.__version__
    workdir = tempfile.mkdtemp(prefix="oh-debugger-bench-")
    try:
        configs = [Config(case, key, workdir) for case, _, _ in CASES for key in KEYS]
        ops = check(configs, workdir)
        n_of = {"add": args.n_add, "keras": args.n_keras}
        _common.measure_under_load(
            info, lambda: _common.run_rounds(configs, args.rounds, lambda c: n_of[c.case]),
            freeze=True)
        summary = summarize(configs)
        elapsed = time.perf_counter() - start
        ok, png_path = _common.publish(
            args.out, "debugger", lambda plt: plot(summary, plt),
            lambda png_name, plotted: render_md(summary, info, args, png_name, plotted,
                                                elapsed, ops))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for case, _, _ in CASES:
        print("%-6s " % case + "  ".join("%s %.1f us (%.2fx oplog)" % (
            key, summary[case][key]["us"], summary[case][key]["vs_oplog"]) for key in KEYS))
    print("target: debugger <= %.1fx oplog per op: %s" % (TARGET_RATIO,
                                                          "PASS" if ok else "MISS"))
    _common.print_wrote(args.out, png_path, elapsed)


if __name__ == "__main__":
    main()
