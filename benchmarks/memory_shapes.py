"""Memory over many distinct input shapes: each handler against plain TensorFlow running
the same shapes.

TensorFlow itself keeps something per shape (eager kernel caches, shape inference, a
`tf.function`'s concrete function per traced shape), so the question is not whether
memory grows, but how much more than TensorFlow's does, and whether what the handlers
keep is bounded. Each configuration runs in a fresh process: a program of a few ops on
an input of a new shape `[a, b]` per step (shapes never repeat), and the resident set
size (RSS, after `gc.collect()`) is read at checkpoints. The table gives KB per new
shape over each interval between checkpoints; the project's caches are bounded
(`tf_ophandlers/core/cache.py`, `BoundedCache`), so their part of the growth stops once
they are full, where TensorFlow's own growth goes on.

  eager         plain TensorFlow: `tf.reduce_sum(tf.tanh(x) * 1.01 + x)`
  tf.function   the same program in a `tf.function` (TensorFlow traces a concrete
                function per new shape; `reduce_retracing=False`, its default)
  oh.Lazy()     the program under `with oh.Lazy(): ... .numpy()` (compiled per structure
                and shape), compared with `tf.function`
  oh.Async()    the program under `with oh.Async(): ... .numpy()`, compared with eager
  GradientTape  `oh.GradientTape` around the program, gradient of x, against
                `tf.GradientTape`
  conv eager / oh.DataFormat()  `conv2d` + `bias_add` under `oh.DataFormat()` on an NCHW
                input `[1, 2, a, b]`, against the NHWC program it runs, in plain eager
                (TensorFlow's CPU kernels take NHWC unless oneDNN's are on)

Writes the `memory-shapes` section of docs/benchmarks.md (no plot).

    python benchmarks/memory_shapes.py           # full run (~20 min on 2 cores)
    python benchmarks/memory_shapes.py --quick   # smoke run (< 2 min)
"""
import gc
import json
import os
import subprocess
import sys
import time

import _common  # also puts the repository on sys.path

SECTION = "memory-shapes"

# name, reference name (None: is a reference)
CONFIGS = (
    ("eager", None),
    ("tf.function", None),  # traces per shape: slow, run over the first checkpoints only
    ("oh.Lazy()", "tf.function"),
    ("oh.Async()", "eager"),
    ("tf.GradientTape", None),
    ("oh.GradientTape", "tf.GradientTape"),
    ("conv eager", None),
    ("oh.DataFormat()", "conv eager"),
)


def _rss_kb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _shape(k):
    """The k-th distinct shape: [a, b] with a in 1..64 (never repeats)."""
    return [1 + k % 64, 1 + k // 64]


def _step_fn(name):
    """A function of k running the configuration's program on the k-th shape."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tf_ophandlers as oh  # pylint: disable=import-outside-toplevel
    tf.get_logger().setLevel("ERROR")  # the retracing warnings of the tf.function case

    def program(x):
        return tf.reduce_sum(tf.tanh(x) * 1.01 + x)

    if name == "eager":
        return lambda k: program(tf.ones(_shape(k))).numpy()
    if name == "tf.function":
        f = tf.function(program)
        return lambda k: f(tf.ones(_shape(k))).numpy()
    if name in ("oh.Lazy()", "oh.Async()"):
        handler = oh.Lazy() if name == "oh.Lazy()" else oh.Async()

        def under(k):
            x = tf.ones(_shape(k))
            with handler:
                return program(x).numpy()
        return under
    if name in ("tf.GradientTape", "oh.GradientTape"):
        tape_type = tf.GradientTape if name == "tf.GradientTape" else oh.GradientTape

        def grad(k):
            x = tf.ones(_shape(k))
            with tape_type() as tape:
                tape.watch(x)
                y = program(x)
            return tape.gradient(y, x).numpy()
        return grad
    kernel, bias = tf.ones([3, 3, 2, 4]) * 0.1, tf.ones([4])

    def conv(k, fmt="NCHW"):
        a, b = _shape(k)
        x = tf.ones([1, 2, a + 2, b + 2] if fmt == "NCHW" else [1, a + 2, b + 2, 2])
        return tf.reduce_sum(tf.nn.bias_add(
            tf.nn.conv2d(x, kernel, 1, "VALID", data_format=fmt), bias,
            data_format=fmt)).numpy()
    if name == "conv eager":  # what oh.DataFormat runs (NCHW needs oneDNN on the CPU)
        return lambda k: conv(k, "NHWC")
    handler = oh.DataFormat()

    def under_data_format(k):
        with handler:
            return conv(k)
    return under_data_format


def child(name, checkpoints):
    """Runs in a fresh process: RSS (KB) at each checkpoint, as JSON on stdout."""
    step = _step_fn(name)
    for k in range(50):  # warm-up shapes: imports, first traces, thread pools
        step(k)
    gc.collect()
    rss, done, start = [], 50, time.perf_counter()
    for upto in checkpoints:
        for k in range(done, 50 + upto):
            step(k)
        done = 50 + upto
        gc.collect()
        rss.append(_rss_kb())
    print(json.dumps({"rss": rss, "seconds": time.perf_counter() - start}))


# What the table says, as a paragraph under it (the figures themselves vary by machine).
CONCLUSIONS = [
    "Plain eager TensorFlow keeps almost nothing per new shape; a `tf.function` keeps a "
    "concrete function per traced shape. `oh.Lazy()` compiles per structure and shape "
    "too, into a bounded LRU cache of compiled calls (`lazy.functions`), and keeps far "
    "less than the `tf.function` doing the same. `oh.Async()` keeps its shape-inference "
    "results per op signature (`async.inferred`, 16,384 entries, and the shared "
    "`shapes.inferred`): its growth per shape falls as those caches fill and stops when "
    "they are full. `oh.GradientTape` keeps nothing per shape; `oh.DataFormat()` keeps "
    "what the NHWC program it runs keeps."]


# Configurations that compile per shape (≈0.1 s each): run to the first two checkpoints only.
COMPILING = ("tf.function", "oh.Lazy()")


def run_child(name, checkpoints):
    if name in COMPILING:
        checkpoints = checkpoints[:2]
    out = subprocess.run(
        [sys.executable, __file__, "--child", name, ",".join(map(str, checkpoints))],
        check=True, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=_common.REPO))
    return json.loads(out.stdout.strip().splitlines()[-1])


def render(results, checkpoints, quick, machine, elapsed):
    intervals = ["%d–%d" % (a, b) for a, b in zip(checkpoints, checkpoints[1:])]
    header = ["configuration", "compared with"] + ["KB/shape, shapes %s" % i for i in intervals] + [
        "total MB over shapes", "MB more than the reference (same shapes)"]
    rows = []
    for name, ref in CONFIGS:
        rss = results[name]["rss"]
        per = ["%.2f" % ((b - a) / (cb - ca)) for a, b, ca, cb in
               zip(rss, rss[1:], checkpoints, checkpoints[1:])]
        per += ["—"] * (len(intervals) - len(per))
        total = rss[-1] - rss[0]
        if ref is None:
            ratio = "—"
        else:  # over the same shapes as the reference ran (a ratio to a flat reference
            # would say nothing: plain eager TensorFlow keeps almost nothing per shape)
            ref_rss = results[ref]["rss"]
            n = min(len(ref_rss), len(rss))
            ref_total, own = ref_rss[n - 1] - ref_rss[0], rss[n - 1] - rss[0]
            ratio = "%+.1f" % ((own - ref_total) / 1024)
        rows.append([name, ref or "—"] + per
                    + ["%.1f over %d" % (total / 1024, checkpoints[len(rss) - 1]), ratio])
    lines = ["## Memory over many distinct input shapes (`benchmarks/memory_shapes.py`)", ""]
    if quick:
        lines += ["> **Quick (smoke) run**: few shapes; numbers are indicative only.", ""]
    lines += [
        "**Method.** Each configuration runs in a fresh process: a small program on an input "
        "of a new shape at every step (shapes never repeat), after 50 warm-up shapes; the "
        "resident set size is read (after `gc.collect()`) at %s new shapes (the two "
        "configurations that compile per shape, ≈0.1 s each, at the first two). KB per shape is "
        "the RSS growth over an interval divided by its shapes; the total is from the first "
        "checkpoint to the last. TensorFlow itself keeps something per shape, so each "
        "handler is compared with the plain TensorFlow configuration that runs the same "
        "work (`oh.Lazy()` compiles per shape as a `tf.function` traces per shape). "
        "The project's caches are bounded (`BoundedCache`, 1k–16k entries each): their "
        "growth stops when they are full." % ", ".join(map(str, checkpoints)),
        "",
        "**Machine.** %s; run took %.0f s." % (machine, elapsed),
        "",
        _common.md_table(header, rows),
        "",
    ] + CONCLUSIONS + [""]
    return "\n".join(lines)


def main(argv):
    if argv[:1] == ["--child"]:
        child(argv[1], [int(c) for c in argv[2].split(",")])
        return 0
    quick = "--quick" in argv
    out = _common.DEFAULT_MD
    if "--out" in argv:
        out = argv[argv.index("--out") + 1]
    checkpoints = (200, 1000, 2000) if quick else (1000, 3000, 6000, 12000)
    start = time.perf_counter()
    results = {}
    for name, _ in CONFIGS:
        results[name] = run_child(name, checkpoints)
        print("%-18s RSS KB %s (%.0f s)" % (name, results[name]["rss"],
                                            results[name]["seconds"]), file=sys.stderr)
    info = _common.machine_info()
    machine = ("%(nproc)s CPU(s) (%(cpu)s), %(os)s, Python %(python)s, TensorFlow "
               "%(tensorflow)s, run on %(date)s" % info)
    _common.write_section(out, SECTION, render(results, checkpoints, quick, machine,
                                               time.perf_counter() - start))
    print("wrote %s" % out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
