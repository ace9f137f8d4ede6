"""Instructions per small op of the native (C++) and Python pass-through paths, counted
with callgrind: instruction counts repeat on a loaded machine, where wall-clock timing
does not. A full run writes the page docs/benchmarks/native_callgrind.md.

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
import subprocess

import _callgrind
import _common

KEYS = ("plain", "cxx-1", "cxx-2", "py-1", "py-2", "counter", "oplog")
NAMES = {"plain": "plain eager (no handler)", "cxx-1": "one `oh.native.PassThrough()`",
         "cxx-2": "two `oh.native.PassThrough()`", "py-1": "one `oh.OpHandler()`",
         "py-2": "two `oh.OpHandler()`", "counter": "`oh.native.OpCounter()`",
         "oplog": "`oh.OpLogHandler()` (a Python hook per op)"}
SECTION = "native_callgrind"


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
    p.add_argument("--out", default=_common.DEFAULT_MD,
                   help="where a full run writes its section (default: its docs page)")
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
    print("further C++ level %+.0f, further Python level %+.0f instructions per op"
          % (per_op["cxx-2"] - per_op["cxx-1"], per_op["py-2"] - per_op["py-1"]))
    _common.write_section(args.out, SECTION, page(per_op, args.n))
    print("wrote", args.out)


def page(per_op, n):
    """The page's Markdown: instructions per op, and per further nesting level."""
    info = _common.machine_info()
    valgrind = subprocess.run(["valgrind", "--version"], capture_output=True,
                              text=True).stdout.strip()
    plain = per_op["plain"]
    rows = [[NAMES[k], "%.0f" % per_op[k], "%+.0f" % (per_op[k] - plain),
             "%.3fx" % (per_op[k] / plain)] for k in KEYS]
    levels = [["a further C++ pass-through level (two against one)",
               "%+.0f" % (per_op["cxx-2"] - per_op["cxx-1"])],
              ["a further Python pass-through level (two against one)",
               "%+.0f" % (per_op["py-2"] - per_op["py-1"])]]
    return "\n".join([
        "## Native path: instructions per op (`benchmarks/native_callgrind.py`)",
        "",
        "**Method.** The configurations of `benchmarks/native_handlers.py`, counted with "
        "valgrind's callgrind instead of timed: in one process, for each configuration the "
        "scopes are entered from one Python frame, then 50 untimed and %d counted "
        "`r = tf.add(a, b)` on 2x2 float32 with both inputs on the innermost stack. The count "
        "covers the whole loop (Python, TensorFlow's op layer, the dispatcher, the kernel and "
        "the release of each result). Instruction counts do not depend on other processes' "
        "load, so they settle differences of a few instructions that the wall-clock page "
        "cannot resolve from its noise (a ~50 us op varies by some us from run to run)." % n,
        "",
        "**Machine.** %s (%s), Python %s, TensorFlow %s, %s. Run on %s." % (
            info["cpu"], info["os"], info["python"], info["tensorflow"], valgrind,
            info["date"]),
        "",
        _common.md_table(["configuration", "instructions per op", "over plain",
                          "ratio to plain"], rows),
        "",
        _common.md_table(["what one more level adds", "instructions per op"], levels),
        "",
        "A scope of pass-through handlers runs fewer instructions per op than plain eager: "
        "under a scope TensorFlow's per-op stack capture is skipped (`core/skip_trace.py`) "
        "and the op's Python arguments are converted in C (`cc/fast/fast_convert.cc`), "
        "which outweighs the dispatcher's work. A further pass-through level, in C++ or a "
        "Python `oh.OpHandler()` that overrides nothing, adds no measurable instructions: "
        "the C++ fast path's per-op decision for such a stack runs the op on the stack "
        "below without entering Python (`cc/fast/fast_path.h`; the architecture page's "
        "*The path of one op*).",
        "",
        "Reproduce: `python benchmarks/native_callgrind.py` (about 3 min of CPU; writes this "
        "page).",
    ])


if __name__ == "__main__":
    main()
