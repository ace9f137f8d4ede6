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
(benchmarks/native_callgrind.py's helper). Needs valgrind, its headers and gcc.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

from native_callgrind import HELPER

HERE = os.path.dirname(os.path.abspath(__file__))
OPS = 100  # per call


def child(helper, n):
    """Runs under valgrind: counts each tape's loop."""
    import ctypes
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, os.path.dirname(HERE))
    import tensorflow as tf
    import tf_ophandlers as oh
    cg = ctypes.CDLL(helper)
    a4 = tf.random.stateless_uniform([4, 4], seed=[1, 2])

    def call(tape_type):
        with tape_type() as t:
            t.watch(a4)
            h = a4
            for _ in range(OPS // 2):
                h = tf.sin(h) * 1.01
        return h

    for key, tape_type in (("tf", tf.GradientTape), ("oh", oh.GradientTape)):
        for _ in range(5):
            call(tape_type)
        cg.cg_toggle()
        for _ in range(n):
            call(tape_type)
        cg.cg_toggle()
        cg.cg_dump(key.encode())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=20, help="counted calls per tape")
    p.add_argument("--keep", help="a directory to keep the callgrind output files in")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child, args.n)
    if not shutil.which("valgrind") or not os.path.exists("/usr/include/valgrind/callgrind.h"):
        sys.exit("needs valgrind and its headers (apt-get install valgrind)")
    work = args.keep or tempfile.mkdtemp(prefix="oh_tape_callgrind_")
    os.makedirs(work, exist_ok=True)
    for name in os.listdir(work):  # an earlier run's files in a kept directory
        if name.startswith("cg.out"):
            os.remove(os.path.join(work, name))
    src, lib = os.path.join(work, "cg.c"), os.path.join(work, "libcg.so")
    with open(src, "w") as f:
        f.write(HELPER)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", src, "-o", lib], check=True)
    out = os.path.join(work, "cg.out")
    subprocess.run(["valgrind", "--tool=callgrind", "--collect-atstart=no",
                    "--callgrind-out-file=" + out, sys.executable, os.path.abspath(__file__),
                    "--child", lib, "--n", str(args.n)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    per_op = {}
    for name in os.listdir(work):
        if name.startswith("cg.out."):
            with open(os.path.join(work, name)) as f:
                text = f.read()
            key = re.search(r"Client Request: (\S+)", text).group(1)
            total = int(re.search(r"^(?:summary|totals): (\d+)", text, re.M).group(1))
            per_op[key] = total / (args.n * OPS)
    print("tf.GradientTape %8.0f instr/op" % per_op["tf"])
    print("oh.GradientTape %8.0f instr/op" % per_op["oh"])
    print("oh / tf         %8.3f" % (per_op["oh"] / per_op["tf"]))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
