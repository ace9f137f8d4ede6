"""`oh.Lazy(jit_compile=True, chunk_ops=N)`: compiled chunks overlapping the recording.

200 elementwise ops (`h = tf.tanh(h) * 1.01`, 100 times) on x [256, 256], a new
`oh.Lazy(jit_compile=True, chunk_ops=N)` per call for N in None (no chunks), 32, 64,
interleaved with `tf.function(chain, jit_compile=True)` (shuffled every round). Wall
clock, CPU of the recording thread and CPU of the whole process, per call (medians), and
the same-round ratio to the `tf.function`. Run twice, each in a fresh process: with
TensorFlow's default intra-op thread pool (XLA's CPU kernels may use every core, so a
chunk's kernels compete with the recording for cores) and with one intra-op thread (the
kernels of a call on one core: a chunk can run beside the recording on the other one).
Checks first that every configuration gives the `tf.function`'s values and that the
chunked ones launch chunks. Writes the `lazy_chunks` section of docs/benchmarks.md.

    python benchmarks/lazy_chunks.py            # ~1 min
    python benchmarks/lazy_chunks.py --quick
"""
import json
import os
import random
import subprocess
import sys
import time

import _common  # also puts the repository on sys.path

SECTION = "lazy_chunks"
CHUNKS = (None, 32, 64)


def child(intra, rounds):
    """Measures in this process (`intra` intra-op threads, 0 = TensorFlow's default)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    if intra:
        tf.config.threading.set_intra_op_parallelism_threads(intra)
    import tf_ophandlers as oh  # pylint: disable=import-outside-toplevel

    def chain(h):
        for _ in range(100):
            h = tf.tanh(h) * 1.01
        return h

    x = tf.random.stateless_uniform([256, 256], seed=[1, 2])
    xla = tf.function(chain, jit_compile=True)

    def lazy(c):
        def call():
            with oh.Lazy(jit_compile=True, chunk_ops=c) as handler:
                return chain(x).numpy(), handler
        return call

    configs = {str(c): lazy(c) for c in CHUNKS}
    configs["xla"] = lambda: (xla(x).numpy(), None)
    want = configs["xla"]()[0]
    for key, call in configs.items():
        call()
        got, handler = call()
        if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
            raise AssertionError("%s: values differ from tf.function(jit_compile=True)" % key)
        if handler is not None and handler.chunk_ops and handler.chunks != 200 // handler.chunk_ops:
            raise AssertionError("%s: %d chunks launched" % (key, handler.chunks))
    times = {k: [] for k in configs}
    keys = list(configs)
    for _ in range(rounds):
        random.shuffle(keys)
        for k in keys:
            w0, t0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            configs[k]()
            times[k].append((time.perf_counter() - w0, time.thread_time() - t0,
                             time.process_time() - p0))
    return times


def main(argv=None):
    args = _common.parse_args(argv, __doc__, SECTION, (30, 5), [])
    info = _common.machine_info()
    t0 = time.perf_counter()
    results = {}
    for intra in (0, 1):
        out = subprocess.run([sys.executable, __file__, "--child", str(intra),
                              str(args.rounds)], check=True, capture_output=True, text=True,
                             env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
        results[intra] = json.loads(out.stdout.strip().splitlines()[-1])
    elapsed = time.perf_counter() - t0
    # (other processes' CPU is not separable from the measuring child processes here)
    info["other"] = "n/a (load average %.1f at the end)" % os.getloadavg()[0]
    rows = []
    for intra, times in results.items():
        for k in [str(c) for c in CHUNKS] + ["xla"]:
            med = [_common.median([t[i] for t in times[k]]) * 1e3 for i in range(3)]
            ratio = ("%.2fx" % _common.median([a[0] / b[0] for a, b in
                                               zip(times[k], times["xla"])])
                     if k != "xla" else "1")
            name = ("`tf.function(jit_compile=True)`" if k == "xla" else
                    "`oh.Lazy(jit_compile=True, chunk_ops=%s)`" % k)
            rows.append(["default" if not intra else "1", name, "%.2f" % med[0],
                         "%.2f" % med[1], "%.2f" % med[2], ratio])
    method = (
        "200 elementwise ops (`h = tf.tanh(h) * 1.01`, 100 times) on [256, 256], then "
        "`.numpy()`; a new `oh.Lazy` per call; %d rounds, each running every "
        "configuration once in a shuffled order, in two fresh processes: TensorFlow's "
        "default intra-op thread pool, and one intra-op thread. Medians per call; the "
        "ratio is the median of same-round ratios to `tf.function(jit_compile=True)`. "
        "*thread CPU*: the recording thread; *process CPU*: every thread (chunk kernels "
        "run on the async executor's thread)." % args.rounds)
    lines = _common.intro_md("Lazy chunks overlapping the recording "
                             "(`benchmarks/lazy_chunks.py`)", args.quick, method,
                             _common.machine_md(info, 2 * (len(CHUNKS) + 1), elapsed), "")
    lines += [_common.md_table(["intra-op threads", "configuration", "wall ms",
                                "thread CPU ms", "process CPU ms",
                                "/ tf.function (wall)"], rows), "",
              "With the default pool XLA's kernels already use the second core, so a "
              "chunk has no free core to run on beside the recording; with one intra-op "
              "thread it has. A loaded machine widens every range.", "",
              "Reproduce: `python benchmarks/lazy_chunks.py` (writes this section)."]
    _common.write_section(args.out, SECTION, "\n".join(lines))
    for r in rows:
        print(" | ".join(r))
    print("wrote %s (%.0f s)" % (args.out, elapsed))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(int(sys.argv[2]), int(sys.argv[3]))))
    else:
        main()
