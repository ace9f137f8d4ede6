"""Instructions per op of tape100 under `oh.GradientTape` and `tf.GradientTape`, counted
with callgrind (load-independent, unlike wall-clock timing; docs/benchmarks.md, "Tape
recording: instruction counts (callgrind)").

    python benchmarks/tape_callgrind.py          # runs itself under valgrind, prints
    python benchmarks/tape_callgrind.py --n 10   # fewer counted calls

In one process, for each tape: 5 untimed and then N counted calls of benchmarks/
small_ops.py's tape100 (`h = tf.sin(h) * 1.01` 50 times, 100 ops, on a watched [4, 4]
tensor under a tape opened per call, forward only). The count covers the whole loop
(Python, TensorFlow, the dispatcher, the tape's enter and exit and the release of the
records), collection toggled around it with callgrind client requests
(benchmarks/_callgrind.py). Needs valgrind, its headers and gcc.
"""
import argparse

import _callgrind

OPS = 100  # per call


def child(helper, n):
    """Runs under valgrind: counts each tape's loop."""
    tf, oh, cg = _callgrind.child_setup(helper)
    a4 = tf.random.stateless_uniform([4, 4], seed=[1, 2])

    def call(tape_type):
        with tape_type() as t:
            t.watch(a4)
            h = a4
            for _ in range(OPS // 2):
                h = tf.sin(h) * 1.01
        return h

    for key, tape_type in (("tf", tf.GradientTape), ("oh", oh.GradientTape)):
        _callgrind.counted(cg, key, lambda t=tape_type: call(t), n, warm=5)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=20, help="counted calls per tape")
    p.add_argument("--keep", help="a directory to keep the callgrind output files in")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child, args.n)
    totals = _callgrind.run(__file__, ["--n", str(args.n)], "oh_tape_callgrind_", args.keep)
    per_op = {key: total / (args.n * OPS) for key, total in totals.items()}
    print("tf.GradientTape %8.0f instr/op" % per_op["tf"])
    print("oh.GradientTape %8.0f instr/op" % per_op["oh"])
    print("oh / tf         %8.3f" % (per_op["oh"] / per_op["tf"]))


if __name__ == "__main__":
    main()
