"""Instructions per call of `benchmarks/data_format.py`'s configurations, counted with
callgrind (load-independent, unlike the wall-clock benchmark; docs/benchmarks.md,
data_format section).

    python benchmarks/data_format_callgrind.py               # tiny input (kernels negligible)
    python benchmarks/data_format_callgrind.py --batch 16 --size 56   # the benchmark's size
    python benchmarks/data_format_callgrind.py --keep /tmp/cg # keep files for callgrind_annotate
    python benchmarks/data_format_callgrind.py --breakdown    # where each call's instructions go

One process, one intra-op thread: the benchmark's CNN channels-first under a fresh
`oh.DataFormat()` per call (entering the scope included, as in data_format.py) and its
channels-last twin in plain TensorFlow, eagerly and as loaded SavedModels; plus `scope`,
entering and leaving `with oh.DataFormat():` alone. Each is warmed up, then N calls
(with `.numpy()`) are counted.
"""
import argparse
import collections
import os
import re
import shutil
import sys
import tempfile

import _callgrind

HERE = os.path.dirname(os.path.abspath(__file__))
KEYS = ("eager-twin", "eager-oh", "saved-twin", "saved-oh", "scope")
WARM = 5  # uncounted calls before each configuration's counted ones


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
        _callgrind.counted(cg, key, calls[key], n, warm=WARM)


# --breakdown: inclusive instructions per call of a few functions (name substrings),
# summed over their call sites: what the handler's own machinery costs, next to what
# TensorFlow's Python op layer costs (overlapping rows: each is inclusive).
PARTS = (
    ("handler device callbacks (incl. the ops they run)",
     "tf_ophandlers::(anonymous namespace)::DeviceExecute("),
    ("  ops the callbacks run (TFE_Execute inside them)", "TFE_Execute'2"),
    ("  Python execute hooks, with the ops they run", "tf_ophandlers::fast::CallHook("),
    ("  ops the hooks run (_C.execute)", "tf_ophandlers::(anonymous namespace)::PyExecute("),
    ("handler shape hooks (dim)", "tf_ophandlers::(anonymous namespace)::PayloadDim("),
    ("handler shape hooks (num_dims)", "tf_ophandlers::(anonymous namespace)::PayloadNumDims("),
    ("handler tensors freed", "tf_ophandlers::(anonymous namespace)::PayloadDeallocate("),
    ("TF: stack traces captured per eager op", "tensorflow::StackTrace::Capture("),
    ("TF: Python slow-path executes (TFE_Py_Execute)", "TFE_Py_ExecuteCancelable("),
    ("TF: fast-path executes (TFE_Py_FastPathExecute)", "TFE_Py_FastPathExecute_C("),
    ("TF: all eager executes (kernels included)", "tensorflow::DoEagerExecute("),
)


def inclusive_by_callee(path):
    """{function name: (calls, inclusive instructions)} summed over the call sites of a
    callgrind output file (names compressed as `(id) name` on first use)."""
    names, calls, incl = {}, collections.Counter(), collections.Counter()
    callee = pending = None
    with open(path) as f:
        for line in f:
            m = re.match(r"c?fn=\((\d+)\)(?: (.*))?", line)
            if m:
                if m.group(2):
                    names[m.group(1)] = m.group(2).strip()
                if line.startswith("cfn="):
                    callee = names.get(m.group(1))
                continue
            if line.startswith("calls="):
                calls[callee] += int(line.split()[0][6:])
                pending = callee
            elif pending is not None:
                parts = line.split()
                if len(parts) >= 2 and parts[1].isdigit():
                    incl[pending] += int(parts[1])
                pending = None
    return {k: (calls[k], incl[k]) for k in calls}


def breakdown(work, n):
    """Prints PARTS per call for each configuration dumped in `work`. (Callgrind counts
    calls while collection is off too: a dump's call counts include the warm-up calls,
    its instructions do not.)"""
    for name in sorted(os.listdir(work)):
        if not name.startswith("cg.out."):
            continue
        path = os.path.join(work, name)
        with open(path) as f:
            key = re.search(r"Client Request: (\S+)", f.read(4096)).group(1)
        if key == "scope":
            continue
        found = inclusive_by_callee(path)
        print("%s (per call):" % key)
        for label, pattern in PARTS:
            hits = [v for k, v in found.items() if k.startswith(pattern) or k == pattern]
            if hits:
                print("  %-52s %10.0f instr %6.1f calls" % (
                    label, sum(v[1] for v in hits) / n, sum(v[0] for v in hits) / (n + WARM)))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=20, help="counted calls per configuration")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--size", type=int, default=8)
    p.add_argument("--configs", default=",".join(KEYS), help="comma-separated configurations")
    p.add_argument("--keep", help="a directory to keep the callgrind output files in")
    p.add_argument("--breakdown", action="store_true",
                   help="also print where the instructions of a call go (PARTS)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    keys = [k for k in KEYS if k in args.configs.split(",")]
    if args.child:
        return child(args.child, args.n, args.batch, args.size, keys)
    keep = args.keep or (tempfile.mkdtemp(prefix="oh_df_callgrind_") if args.breakdown else None)
    totals = _callgrind.run(__file__, ["--n", str(args.n), "--batch", str(args.batch),
                                       "--size", str(args.size), "--configs", ",".join(keys)],
                            "oh_df_callgrind_", keep)
    per = {k: totals[k] / args.n for k in keys}
    print("%-11s %14s" % ("config", "instr/call"))
    for k in keys:
        print("%-11s %14.0f" % (k, per[k]))
    for case in ("eager", "saved"):
        if case + "-oh" in per and case + "-twin" in per:
            oh_, twin = per[case + "-oh"], per[case + "-twin"]
            print("%s oh/twin %.3fx (%+.0f)" % (case, oh_ / twin, oh_ - twin))
    if args.breakdown:
        breakdown(keep, args.n)
        if not args.keep:
            shutil.rmtree(keep, ignore_errors=True)


if __name__ == "__main__":
    main()
