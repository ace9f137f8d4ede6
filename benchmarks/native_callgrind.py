"""Instructions per small op of the native (C++) and Python pass-through paths, counted
with callgrind: instruction counts repeat on a loaded machine, where wall-clock timing
does not (docs/benchmarks.md, "Native path: instruction counts (callgrind)").

    python benchmarks/native_callgrind.py          # runs itself under valgrind, prints
    python benchmarks/native_callgrind.py --n 500  # fewer counted ops
    python benchmarks/native_callgrind.py --configs cxx-1,counter --keep /tmp/cg
        # only these configurations; keep the callgrind files for callgrind_annotate

For each configuration, in one process: the scopes are entered from one Python frame,
50 untimed and then N counted `r = tf.add(a, b)` on 2x2 float32 with both inputs on the
innermost stack. The count covers the whole loop (Python, TensorFlow, the dispatcher and
the release of each result); collection is toggled around it with callgrind client
requests from a small helper library compiled here (valgrind/callgrind.h).
Needs valgrind, its headers and gcc.
"""
import argparse
import contextlib

import _callgrind

KEYS = ("plain", "cxx-1", "cxx-2", "py-1", "py-2", "counter", "oplog")


def child(helper, n, keys=KEYS):
    """Runs under valgrind: counts each configuration's loop."""
    tf, oh, cg = _callgrind.child_setup(helper)
    make = {"plain": lambda: [], "cxx-1": lambda: [oh.native.PassThrough()],
            "cxx-2": lambda: [oh.native.PassThrough(), oh.native.PassThrough()],
            "py-1": lambda: [oh.OpHandler()], "py-2": lambda: [oh.OpHandler(), oh.OpHandler()],
            "counter": lambda: [oh.native.OpCounter()], "oplog": lambda: [oh.OpLogHandler()]}
    a0 = tf.random.stateless_uniform([2, 2], seed=[1, 2])
    b0 = tf.random.stateless_uniform([2, 2], seed=[3, 4])
    for key in keys:
        with contextlib.ExitStack() as scopes:
            for h in make[key]():
                scopes.enter_context(h)
            a, b = tf.identity(a0), tf.identity(b0)
            _callgrind.counted(cg, key, lambda: tf.add(a, b), n, warm=50)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1000, help="counted ops per configuration")
    p.add_argument("--configs", default=",".join(KEYS),
                   help="comma-separated configurations (plain is always counted)")
    p.add_argument("--keep", help="a directory to keep the callgrind output files in")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    keys = [k for k in KEYS if k == "plain" or k in args.configs.split(",")]
    if args.child:
        return child(args.child, args.n, keys)
    totals = _callgrind.run(__file__, ["--n", str(args.n), "--configs", ",".join(keys)],
                            "oh_callgrind_", args.keep)
    per_op = {key: total / args.n for key, total in totals.items()}
    plain = per_op["plain"]
    print("%-8s %12s %10s" % ("config", "instr/op", "over plain"))
    for key in keys:
        print("%-8s %12.0f %+10.0f" % (key, per_op[key], per_op[key] - plain))
    if set(keys) != set(KEYS):
        return
    print("further C++ level %+.0f, further Python level %+.0f, oplog/counter overhead %.2fx"
          % (per_op["cxx-2"] - per_op["cxx-1"], per_op["py-2"] - per_op["py-1"],
             (per_op["oplog"] - plain) / (per_op["counter"] - plain)))


if __name__ == "__main__":
    main()
