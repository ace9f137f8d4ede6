"""Instructions per op of benchmarks/small_ops.py's async16 (chain16 under one `oh.Async()`
created once) against eager chain16 and TensorFlow's asynchronous executor without the
handler, counted with callgrind (load-independent, unlike wall-clock timing).

    python benchmarks/async_callgrind.py                # runs itself under valgrind, prints
    python benchmarks/async_callgrind.py --n 5 --keep /tmp/cg   # keep files for callgrind_annotate

In one process, for each configuration: 3 untimed and then N counted calls of chain16
(`h = tf.tanh(h) * 1.01` 100 times, 200 ops, on x [16, 16], then `.numpy()`). The count
covers the whole loop on every thread (Python, TensorFlow, the dispatcher, the executor's
thread running the kernels, the release of the results), collection toggled around it
with callgrind client requests (benchmarks/_callgrind.py). Counts leave out
what instructions do not show: waking the executor's thread, cache misses. Needs
valgrind, its headers and gcc.
"""
import argparse

import _callgrind

OPS = 200  # per call
KEYS = ("eager", "tf-async", "oh-async")


def child(helper, n):
    """Runs under valgrind: counts each configuration's loop."""
    tf, oh, cg = _callgrind.child_setup(helper)
    from tensorflow.python.eager import context, executor
    x16 = tf.random.stateless_uniform([16, 16], seed=[1, 2])

    def chain(h):
        for _ in range(OPS // 2):
            h = tf.tanh(h) * 1.01
        return h.numpy()

    runner = oh.Async()
    tf_executor = executor.new_executor(enable_async=True)

    def tf_async():
        with context.executor_scope(tf_executor):
            return chain(x16)

    def oh_async():
        with runner:
            return chain(x16)

    calls = {"eager": lambda: chain(x16), "tf-async": tf_async, "oh-async": oh_async}
    for key in KEYS:
        _callgrind.counted(cg, key, calls[key], n, warm=3)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=10, help="counted calls per configuration")
    p.add_argument("--keep", help="a directory to keep the callgrind output files in")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child, args.n)
    totals = _callgrind.run(__file__, ["--n", str(args.n)], "oh_async_callgrind_", args.keep)
    per_op = {key: total / (args.n * OPS) for key, total in totals.items()}
    for key in KEYS:
        print("%-9s %8.0f instr/op  %.3fx eager" % (key, per_op[key],
                                                   per_op[key] / per_op["eager"]))


if __name__ == "__main__":
    main()
