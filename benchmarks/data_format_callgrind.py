"""Instructions per call of `benchmarks/data_format.py`'s configurations, counted with
callgrind (load-independent, unlike the wall-clock benchmark; docs/benchmarks.md,
data_format section).

    python benchmarks/data_format_callgrind.py               # tiny input (kernels negligible)
    python benchmarks/data_format_callgrind.py --batch 16 --size 56   # the benchmark's size
    python benchmarks/data_format_callgrind.py --keep /tmp/cg # keep files for callgrind_annotate

One process, one intra-op thread: the issue's CNN channels-first under a fresh
`oh.DataFormat()` per call (entering the scope included, as in data_format.py) and its
channels-last twin in plain TensorFlow, eagerly and as loaded SavedModels; plus `scope`,
entering and leaving `with oh.DataFormat():` alone. Each is warmed up, then N calls
(with `.numpy()`) are counted.
"""
import argparse
import os
import sys

import _callgrind

HERE = os.path.dirname(os.path.abspath(__file__))
KEYS = ("eager-twin", "eager-oh", "saved-twin", "saved-oh", "scope")


def child(helper, n, batch, size, keys=KEYS):
    tf, oh, cg = _callgrind.child_setup(helper)
    tf.config.threading.set_intra_op_parallelism_threads(1)  # (before the runtime starts)
    sys.path.insert(0, HERE)
    import data_format as bench
    bench.SIZE = size
    cf, cl, x, xl, s_cf, s_cl = bench.twins(batch)
    under = bench.under

    def scope():
        with oh.DataFormat():
            pass

    calls = {"eager-twin": lambda: cl(xl).numpy(), "eager-oh": under(cf, x),
             "saved-twin": lambda: s_cl.serve(xl).numpy(), "saved-oh": under(s_cf.serve, x),
             "scope": scope}
    for key in keys:
        _callgrind.counted(cg, key, calls[key], n, warm=5)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=20, help="counted calls per configuration")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--size", type=int, default=8)
    p.add_argument("--configs", default=",".join(KEYS), help="comma-separated configurations")
    p.add_argument("--keep", help="a directory to keep the callgrind output files in")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    keys = [k for k in KEYS if k in args.configs.split(",")]
    if args.child:
        return child(args.child, args.n, args.batch, args.size, keys)
    totals = _callgrind.run(__file__, ["--n", str(args.n), "--batch", str(args.batch),
                                       "--size", str(args.size), "--configs", ",".join(keys)],
                            "oh_df_callgrind_", args.keep)
    per = {k: totals[k] / args.n for k in keys}
    print("%-11s %14s" % ("config", "instr/call"))
    for k in keys:
        print("%-11s %14.0f" % (k, per[k]))
    for case in ("eager", "saved"):
        if case + "-oh" in per and case + "-twin" in per:
            oh_, twin = per[case + "-oh"], per[case + "-twin"]
            print("%s oh/twin %.3fx (%+.0f)" % (case, oh_ / twin, oh_ - twin))


if __name__ == "__main__":
    main()
