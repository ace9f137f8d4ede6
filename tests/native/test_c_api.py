"""tf_ophandlers/c_api.h: native handler stacks from TensorFlow's C API, with no Python
in the process. `make c-api-programs` builds libtf_ophandlers_c.so, examples/c_api/
c_api_example.c and tests/native/c_api_errors.c as plain C programs; these tests run
them (separate processes: this one has an interpreter) and check what they print
against TensorFlow's own results.

Marked slow: the first run compiles the library (a minute or more on a loaded machine);
make rebuilds nothing afterwards."""
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
import tensorflow as tf

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "build", "c_api")
LIB = os.path.join(ROOT, "tf_ophandlers", "libtf_ophandlers_c.so")

# The computation of examples/c_api/c_api_example.c, in Python.
X = np.array([0.1, -0.2, 0.3, 0.4, 0.5, -0.6, 0.7, 0.8, 0.9], np.float32).reshape(3, 3)
W = np.array([1.0, 0.5, -0.5, 0.25, 2.0, 0.0, -1.0, 0.75, 1.5], np.float32).reshape(3, 3)


@pytest.fixture(scope="module")
def programs():
    """Builds the C programs with the Makefile (this interpreter's TensorFlow; no venv
    install: STAMP empty)."""
    for tool in ("make", "gcc", "g++"):
        if shutil.which(tool) is None:
            pytest.fail("%s is needed to build the C API programs" % tool)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    subprocess.run(["make", "-s", "c-api-programs", "VPY=" + sys.executable, "STAMP="],
                   cwd=ROOT, check=True, env=env, timeout=900)
    return env


def run(env, *args, extra_env=None):
    e = dict(env, **(extra_env or {}))
    return subprocess.run(list(args), cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=300)


def parse_counts(stdout, title):
    """The lines under "<title> (<key>):" up to the next header."""
    lines = stdout.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith(title + " ("))
    rows = {}
    for line in lines[start + 1:]:
        if not line or ":" in line:
            break
        parts = line.split("\t")
        rows[parts[0]] = [int(p) for p in parts[1:]]
    return rows


def test_example_equals_tensorflow_and_counts_ops(programs):
    r = run(programs, os.path.join(OUT, "c_api_example"), os.path.join(OUT, "op_timer.so"))
    assert r.returncode == 0, r.stdout + r.stderr
    want = tf.reduce_sum(tf.tanh(tf.matmul(X, W) + X), axis=1).numpy()
    got = {}
    for name in ("plain", "handlers"):
        m = re.search(r"^%s:\s+(.*)$" % name, r.stdout, re.M)
        got[name] = np.array([float(v) for v in m.group(1).split()], np.float32)
    # The C program compares bit for bit itself; here: against Python TensorFlow.
    np.testing.assert_allclose(got["handlers"], want, rtol=1e-6)
    np.testing.assert_array_equal(got["handlers"], got["plain"])
    # Both handlers saw each op once: the counter below the timer, each op executed once.
    ops = {"MatMul", "AddV2", "Tanh", "Sum"}
    counts = parse_counts(r.stdout, "OpCounter")
    assert counts == {op: [1] for op in ops}
    timings = parse_counts(r.stdout, "OpTimer")
    assert set(timings) == ops and all(n == 1 and ns > 0 for n, ns in timings.values())
    assert "OK: values equal plain execution" in r.stdout


def test_no_libpython_in_the_c_process(programs):
    # The library needs no libpython ...
    dynamic = subprocess.run(["readelf", "-d", LIB], capture_output=True, text=True).stdout
    needed = [l for l in dynamic.splitlines() if "(NEEDED)" in l]
    assert any("libtensorflow_cc.so.2" in l for l in needed)
    assert not [l for l in needed if "python" in l.lower()]
    # ... and the process never mapped one (the program reads /proc/self/maps).
    r = run(programs, os.path.join(OUT, "c_api_example"), os.path.join(OUT, "op_timer.so"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "libpython loaded: no" in r.stdout
    assert "mapped:" not in r.stdout


def test_libpython_check_can_fail(programs):
    """The /proc/self/maps check sees a libpython when one is loaded (preloaded here)."""
    libdir, name = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY")
    path = os.path.join(libdir or "", name or "")
    if not name or not name.startswith("libpython") or not os.path.exists(path):
        pytest.skip("this interpreter has no shared libpython to preload")
    r = run(programs, os.path.join(OUT, "c_api_example"), os.path.join(OUT, "op_timer.so"),
            extra_env={"LD_PRELOAD": path})
    assert r.returncode == 1
    assert "libpython loaded: yes" in r.stdout


def test_bad_input_fails_with_a_status(programs):
    r = run(programs, os.path.join(OUT, "c_api_errors"),
            *[os.path.join(OUT, name) for name in
              ("bad_abi_handler.so", "failing_handler.so", "c_api_bad_handler.so")])
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert not [l for l in lines if l.startswith("FAIL")]
    cases = {l[3:].split(":")[0] for l in lines if l.startswith("ok ")}
    for case in ("missing library", "wrong handler ABI version", "future C API version",
                 "pop not on top", "pop with no scope open", "scopes are per thread", "scopes intact after a refused pop",
                 "push after the context is gone", "pop after the context is gone",
                 "new handler after the context is gone", "input of an unrelated stack",
                 "kernel error under a handler", "unknown type", "create hook fails",
                 "unknown query key", "execute hook fails", "wrong output dtype",
                 "too few outputs", "hook throws", "copy_off refused",
                 # Tensors outlive their scopes: the same handlers pushed again, or pushed
                 # on another thread, take them (values: plain execution's).
                 "re-pushed scopes take a tensor of the popped ones",
                 "an earlier scope's tensor lifted onto re-pushed scopes",
                 "a tensor of a higher stack under a lower one",
                 "a handler's tensor under its scope on another thread",
                 "a stack's tensor under the same stack on another thread",
                 "create hook fails with a state", "the failed create's state was deleted"):
        assert case in cases, r.stdout
    assert lines[-1] == "OK: every bad input failed with a status"


def test_example_builds_with_oh_sysconfig_flags(programs, tmp_path):
    """The documented one-liner: oh.sysconfig's C compile flags and C API link flags build
    the example outside the Makefile; it runs as the Makefile's build does."""
    import tf_ophandlers as oh
    assert oh.sysconfig.get_c_api_library() == LIB
    assert not [f for f in oh.sysconfig.get_c_api_link_flags() if "python" in f.lower()
                and not f.startswith(("-L", "-Wl,-rpath"))]
    exe = str(tmp_path / "c_api_example")
    subprocess.run(["gcc", "-std=c11", "-Wall", "-Werror"] + oh.sysconfig.get_c_compile_flags()
                   + [os.path.join(ROOT, "examples", "c_api", "c_api_example.c"), "-o", exe]
                   + oh.sysconfig.get_c_api_link_flags(), check=True, timeout=300)
    r = run(programs, exe, os.path.join(OUT, "op_timer.so"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "libpython loaded: no" in r.stdout
    assert "OK: values equal plain execution" in r.stdout
