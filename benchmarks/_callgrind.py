"""What the *_callgrind.py benchmarks share: running a script's `--child` under valgrind's
callgrind, collection toggled around each configuration's counted loop, and reading one
instruction count per configuration (load-independent, unlike wall-clock timing).

A script's child starts with ``tf, oh, cg = child_setup(helper)`` and counts with ``counted(cg, key, call, n, warm)``; its parent calls
``run(script, args, prefix, keep)``, which compiles the client-request helper, runs
``python script --child LIB *args`` under callgrind and returns ``{key: instructions}``.
Needs valgrind, its headers and gcc.
"""
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile

HELPER = r"""
#include <valgrind/callgrind.h>
void cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void cg_dump(const char* name) { CALLGRIND_DUMP_STATS_AT(name); }
"""


def load(helper):
    """The compiled helper library (in the child, under valgrind)."""
    return ctypes.CDLL(helper)


def child_setup(helper):
    """A child's common start: quiet TensorFlow, this checkout's package first on the path;
    returns (tf, oh, the helper library)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tf_ophandlers as oh  # pylint: disable=import-outside-toplevel
    return tf, oh, load(helper)


def counted(cg, key, call, n, warm):
    """Runs `call` `warm` times, then `n` times with collection on; dumps as `key`."""
    for _ in range(warm):
        call()
    cg.cg_toggle()
    for _ in range(n):
        call()
    cg.cg_toggle()
    cg.cg_dump(key.encode())


def run(script, args, prefix, keep=None):
    """Runs `script`'s child under callgrind; returns total instructions per dumped key
    (summed over the dumps of a key: one per thread)."""
    if not shutil.which("valgrind") or not os.path.exists("/usr/include/valgrind/callgrind.h"):
        sys.exit("needs valgrind and its headers (apt-get install valgrind)")
    work = keep or tempfile.mkdtemp(prefix=prefix)
    os.makedirs(work, exist_ok=True)
    for name in os.listdir(work):  # an earlier run's files in a kept directory
        if name.startswith("cg.out"):
            os.remove(os.path.join(work, name))
    src, lib = os.path.join(work, "cg.c"), os.path.join(work, "libcg.so")
    with open(src, "w") as f:
        f.write(HELPER)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", src, "-o", lib], check=True)
    subprocess.run(["valgrind", "--tool=callgrind", "--collect-atstart=no",
                    "--callgrind-out-file=" + os.path.join(work, "cg.out"), sys.executable,
                    os.path.abspath(script), "--child", lib] + list(args),
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    totals = {}
    for name in os.listdir(work):
        if name.startswith("cg.out."):
            with open(os.path.join(work, name)) as f:
                text = f.read()
            key = re.search(r"Client Request: (\S+)", text).group(1)
            total = int(re.search(r"^(?:summary|totals): (\d+)", text, re.M).group(1))
            totals[key] = totals.get(key, 0) + total
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return totals
