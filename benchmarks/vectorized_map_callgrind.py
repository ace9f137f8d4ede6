"""Instructions per op-by-op `oh.vectorized_map` call of per-example gradients (the pe-grads
figure of benchmarks/small_ops.py; benchmarks/vectorized_map.py's `Workload`), and per
eager `tf.vectorized_map` call of the same, counted with callgrind (load-independent,
unlike wall-clock timing).

    python benchmarks/vectorized_map_callgrind.py                    # prints the counts
    python benchmarks/vectorized_map_callgrind.py --n 3 --keep /tmp/cg  # for callgrind_annotate
    python benchmarks/vectorized_map_callgrind.py --no-eager         # oh only (faster)

Counts cover all threads inside the counted calls: `oh` N calls after 4 warm-up calls,
`eager` 1 call after 2 (it re-traces on every call). Needs valgrind, its headers and gcc.
"""
import argparse
import sys

import _callgrind


def child(helper, n, eager):
    """Runs under valgrind: counts each configuration's calls."""
    _callgrind.child_setup(helper)
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import vectorized_map as _vm  # pylint: disable=import-outside-toplevel
    cg = _callgrind.load(helper)
    w = _vm.Workload()
    _callgrind.counted(cg, "oh", w.grads_oh, n, warm=4)
    if eager:
        _callgrind.counted(cg, "eager", w.grads_eager, 1, warm=2)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=5, help="counted oh.vectorized_map calls")
    p.add_argument("--no-eager", action="store_true", help="skip eager tf.vectorized_map")
    p.add_argument("--keep", help="a directory to keep the callgrind output files in")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child, args.n, not args.no_eager)
    extra = ["--no-eager"] if args.no_eager else []
    totals = _callgrind.run(__file__, ["--n", str(args.n)] + extra, "oh_vmap_callgrind_",
                            args.keep)
    oh_call = totals["oh"] / args.n
    print("oh.vectorized_map      %12.0f instr/call" % oh_call)
    if "eager" in totals:
        print("eager tf.vectorized_map %11.0f instr/call  (%.1fx oh)"
              % (totals["eager"], totals["eager"] / oh_call))


if __name__ == "__main__":
    main()
