"""Instructions per recorded op of `with oh.Lazy(jit_compile=True)` (benchmarks/small_ops.py's
"Lazy XLA" program), counted with callgrind (load-independent, unlike wall-clock timing;
docs/benchmarks.md, the R/C arithmetic of the Lazy XLA row).

    python benchmarks/lazy_callgrind.py          # runs itself under valgrind, prints
    python benchmarks/lazy_callgrind.py --n 4    # fewer counted calls
    python benchmarks/lazy_callgrind.py --keep /tmp/cg  # keep the files for callgrind_annotate
    python benchmarks/lazy_callgrind.py --configs record --size 16 --no-jit
        # a quick look at recording alone (the same record path; no XLA compile or run)

In one process, 3 untimed and then N counted calls of each configuration, on small_ops'
x [256, 256] and its chain (`h = tf.tanh(h) * 1.01` 100 times: 200 ops):

  xla      `tf.function(chain, jit_compile=True)(x).numpy()`: C, the compiled call
  lazyxla  `with oh.Lazy(jit_compile=True): chain(x).numpy()`, a fresh handler per call
  record   the same, but only `chain(x)` inside the open scope is counted: the 200 ops'
           recording (and the release of the intermediate tensors), without the scope's
           enter and exit or the value request

Per recorded op: record / 200, the recording thread's instructions (R of the R/C
arithmetic without the scope's enter and exit and the value request). Collection is
toggled on the calling thread: the compiled loop's instructions count only as far as
XLA:CPU runs it on that thread, which differs from run to run by more than the whole
recording costs, so xla and lazyxla are information, compared by hand without the compiled loop
(callgrind_annotate's inclusive `xla::LocalExecutable::Run` of a kept run subtracted).
Needs valgrind, its headers and gcc.
"""
import argparse

import _callgrind

OPS = 200  # per call


def chain(tf, h):
    for _ in range(OPS // 2):
        h = tf.tanh(h) * 1.01
    return h


KEYS = ("xla", "lazyxla", "record")


def child(helper, n, keys, size, jit):
    """Runs under valgrind: counts each configuration's calls."""
    tf, oh, cg = _callgrind.child_setup(helper)
    x = tf.random.stateless_uniform([size, size], seed=[1, 2])
    xla = tf.function(lambda h: chain(tf, h), jit_compile=jit)

    def lazyxla():
        with oh.Lazy(jit_compile=jit):
            return chain(tf, x).numpy()

    def record(on):
        with oh.Lazy(jit_compile=jit):
            if on:
                cg.cg_toggle()
            h = chain(tf, x)
            if on:
                cg.cg_toggle()
            return h.numpy()

    if "xla" in keys:
        _callgrind.counted(cg, "xla", lambda: xla(x).numpy(), n, warm=3)
    if "lazyxla" in keys:
        _callgrind.counted(cg, "lazyxla", lazyxla, n, warm=3)
    if "record" not in keys:
        return
    for _ in range(3):
        record(False)
    for _ in range(n):
        record(True)
    cg.cg_dump(b"record")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=10, help="counted calls per configuration")
    p.add_argument("--configs", default=",".join(KEYS), help="comma-separated configurations")
    p.add_argument("--size", type=int, default=256, help="x is [size, size]")
    p.add_argument("--no-jit", action="store_true",
                   help="jit_compile=False on both sides (recording is the same)")
    p.add_argument("--keep", help="a directory to keep the callgrind output files in")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    keys = [k for k in KEYS if k in args.configs.split(",")]
    if args.child:
        return child(args.child, args.n, keys, args.size, not args.no_jit)
    flags = ["--n", str(args.n), "--configs", ",".join(keys), "--size", str(args.size)]
    totals = _callgrind.run(__file__, flags + (["--no-jit"] if args.no_jit else []),
                            "oh_lazy_callgrind_", args.keep)
    per_call = {key: total / args.n for key, total in totals.items()}
    for key in ("xla", "lazyxla"):
        if key in per_call:
            print("%-8s %12.0f instr/call" % (key, per_call[key]))
    if "record" in per_call:
        print("record   %12.0f instr/call  %8.0f instr/recorded op"
              % (per_call["record"], per_call["record"] / OPS))
    if "xla" in per_call and "lazyxla" in per_call:
        print("(lazyxla - xla) / %d: %8.0f instr/recorded op (information: includes the "
              "compiled loop's instructions counted on this thread)"
              % (OPS, (per_call["lazyxla"] - per_call["xla"]) / OPS))


if __name__ == "__main__":
    main()
