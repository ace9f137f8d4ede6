"""The Bazel build (BUILD, WORKSPACE, `make bazel`): its libraries, loaded and checked
against TensorFlow.

`make bazel` builds `//...` and runs this file with TFOH_BAZEL_BIN set to its bazel-bin;
then a missing library is a failure. Without TFOH_BAZEL_BIN (plain `make test`) the tests
are skipped with that reason: they test what Bazel built, which `make test` does not build.
"""
import collections
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BAZEL_BIN = os.environ.get("TFOH_BAZEL_BIN", "")
PACKAGE_LIBRARIES = ["_C.so", "_copy_ops.so", "_native_handlers.so", "_null_device.so"]

pytestmark = pytest.mark.skipif(
    not BAZEL_BIN, reason="TFOH_BAZEL_BIN is not set: `make bazel` builds the libraries "
                          "with Bazel and runs these tests on them")


def bazel_library(*parts):
    """A library of bazel-bin; a failure (not a skip) when `make bazel` did not build it."""
    path = os.path.join(BAZEL_BIN, *parts)
    if not os.path.isfile(path):
        pytest.fail("%s was not built: `bazel build //...` must produce it" % path)
    return path


def program(x, w):
    h = tf.tanh(tf.matmul(x, w)) + tf.sin(x[:, :3])
    g = tf.gather(h, tf.constant([0, 2, 1]))
    return tf.reduce_sum(g * g, axis=1), tf.concat([h, g], axis=0)


def inputs():
    return (tf.random.stateless_normal([3, 4], seed=[1, 2]),
            tf.random.stateless_normal([4, 3], seed=[3, 4]))


def assert_same(got, want):
    for g, t in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        assert g.dtype == t.dtype and g.shape == t.shape
        np.testing.assert_allclose(g.numpy(), t.numpy(), rtol=1e-6, atol=1e-6)


def op_counts(records):
    return dict(collections.Counter(r.op_type for r in records))


def queried_counts(counter):
    """An OpCounter's `query("counts")` ("type\tcount" lines) as a dict; what
    `oh.native.OpCounter.counts` reads."""
    rows = [line.rpartition("\t") for line in counter.query("counts").decode().splitlines()]
    return {op: int(n) for op, _, n in rows}


def test_bazel_native_handler_library_counts_what_op_log_records():
    """bazel-bin/tf_ophandlers/_native_handlers.so through oh.load_handler_library: eager,
    a fresh tf.function and a Keras model give TensorFlow's values, and OpCounter counts
    exactly the ops OpLogHandler records."""
    types = oh.load_handler_library(
        bazel_library("tf_ophandlers", "_native_handlers.so")).handler_types()
    assert sorted(types) == ["OpCounter", "PassThrough"]
    x, w = inputs()
    model = tf.keras.Sequential([tf.keras.layers.Dense(5, activation="relu"),
                                 tf.keras.layers.Dense(2)])
    model(x)

    def run():
        return program(x, w), tf.function(program)(x, w), model(x)

    want = run()
    log, counter = oh.OpLogHandler(), types["OpCounter"]()
    with log:
        logged = run()
    with counter:
        got = run()
    assert_same(got, want)
    assert_same(logged, want)
    assert queried_counts(counter) == op_counts(log.records)
    assert int(counter.query("total")) == len(log.records) > 10

    # Gradients under the Bazel-built PassThrough, against tf.GradientTape alone.
    def grads(scope):
        xv, wv = tf.Variable(x), tf.Variable(w)
        with scope:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(program(xv, wv)[0])
        return [loss] + tape.gradient(loss, [xv, wv])

    import contextlib
    assert_same(grads(types["PassThrough"]()), grads(contextlib.nullcontext()))


def test_bazel_example_handler_times_every_op():
    """//examples/cc_handler:op_timer.so: its per-op counts are OpLogHandler's, its values
    TensorFlow's."""
    OpTimer = oh.load_handler_library(
        bazel_library("examples", "cc_handler", "op_timer.so")).OpTimer
    x, w = inputs()
    want = program(x, w)
    log, timer = oh.OpLogHandler(), OpTimer()
    with log:
        program(x, w)
    with timer:
        got = program(x, w)
    assert_same(got, want)
    rows = [line.split("\t") for line in timer.query("timings").decode().splitlines()]
    assert {op: int(n) for op, n, _ in rows} == op_counts(log.records)
    assert all(int(nanos) > 0 for _, _, nanos in rows)


def test_bazel_c_api_example_runs_without_python():
    """//examples/c_api:c_api_example (the C API runtime linked in) runs OpTimer inside
    OpCounter with TensorFlow's values and no libpython mapped; //:libtf_ophandlers_c.so
    needs no libpython."""
    library = bazel_library("tf_ophandlers", "libtf_ophandlers_c.so")
    dynamic = subprocess.run(["readelf", "-d", library], capture_output=True, text=True).stdout
    assert not [l for l in dynamic.splitlines() if "(NEEDED)" in l and "python" in l.lower()]
    example = bazel_library("examples", "c_api", "c_api_example")
    result = subprocess.run(
        [example, bazel_library("examples", "cc_handler", "op_timer.so")],
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "libpython loaded: no" in result.stdout
    assert "OK: values equal plain execution" in result.stdout


_PACKAGE_CHECK = textwrap.dedent("""
    import os, sys, glob
    import numpy as np
    import tensorflow as tf
    import tf_ophandlers as oh
    here = os.path.realpath(sys.argv[1])
    # Every compiled library of this copy of the package is Bazel's.
    assert os.path.realpath(oh._C.__file__) == os.path.join(here, "_C.so"), oh._C.__file__
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(here, "*.so"))) == \\
        %(libraries)r

    # The copy-op library, loaded with tf.load_op_library: CopyOn is the identity on a
    # physical device and its gradient (CopyOnGrad) is identity's.
    ops = tf.load_op_library(os.path.join(here, "_copy_ops.so"))
    x = tf.constant([[1.0, -2.0], [3.0, 0.5]])
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y, ref = ops.copy_on(x) * x, tf.identity(x) * x
    np.testing.assert_array_equal(y.numpy(), ref.numpy())
    np.testing.assert_array_equal(tape.gradient(y, x).numpy(), tape.gradient(ref, x).numpy())

    # Handlers of the Bazel-built extension: a Python handler over the Bazel-built
    # OpCounter, in a fresh tf.function and under oh.GradientTape, give TensorFlow's
    # values and gradients; the counter counts what the log records.
    w = tf.Variable([[0.5, -1.0], [2.0, 1.5]])
    def step(x):
        return tf.reduce_sum(tf.tanh(tf.matmul(x, w)) * x)
    with tf.GradientTape() as tape:
        want = step(x)
    want_grad = tape.gradient(want, w)
    log, counter = oh.OpLogHandler(), oh.native.OpCounter()
    with log:
        with counter:
            with oh.GradientTape() as tape:
                got = step(x)
            got_fn = tf.function(step)(x)
    got_grad = tape.gradient(got, w)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)
    np.testing.assert_allclose(got_fn.numpy(), want.numpy(), rtol=1e-6)
    np.testing.assert_allclose(got_grad.numpy(), want_grad.numpy(), rtol=1e-6)
    counts = {}
    for r in log.records:
        counts[r.op_type] = counts.get(r.op_type, 0) + 1
    assert counter.counts == counts and counter.counts.get("MatMul", 0) >= 1, (
        counter.counts, counts)
    print("bazel package ok", counter.total)
""")


def test_bazel_built_package_imports_and_runs(tmp_path):
    """The package's Python sources with only Bazel's four libraries beside them (the
    extension _C.so, the copy ops, the native handlers, the null device), in a fresh
    interpreter: it imports and gives TensorFlow's values, gradients and counts."""
    libraries = [bazel_library("tf_ophandlers", name) for name in PACKAGE_LIBRARIES]
    package = tmp_path / "tf_ophandlers"
    shutil.copytree(os.path.join(ROOT, "tf_ophandlers"), package,
                    ignore=shutil.ignore_patterns("*.so", "__pycache__", "include"))
    for path in libraries:
        shutil.copyfile(path, package / os.path.basename(path))
    env = dict(os.environ, PYTHONPATH=str(tmp_path), TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, "-c", _PACKAGE_CHECK % {"libraries": sorted(PACKAGE_LIBRARIES)},
         str(package)], cwd=str(tmp_path), env=env, capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bazel package ok" in result.stdout
