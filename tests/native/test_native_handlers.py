"""Handlers in C++ (cc/include/tf_ophandlers/handler.h): oh.native.PassThrough and
OpCounter, a third-party library built with oh.sysconfig, against plain TensorFlow."""
import collections
import hashlib
import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

# tests/native/failing_handler.cc is built once with the oh.sysconfig flags (cached by the
# hash of the source, the header and the flags, so reruns skip the compiler).
HERE = os.path.dirname(os.path.abspath(__file__))


def build_handler_library(source, include_dirs=()):
    """`source` built into a handler library with the oh.sysconfig one-liner; headers of
    `include_dirs` come first (tests/native/abi_v1: a library of the version 1 header)."""
    cflags = ["-I" + d for d in include_dirs] + oh.sysconfig.get_compile_flags()
    lflags = oh.sysconfig.get_link_flags()
    with open(source, "rb") as f:
        text = f.read()
    for d in list(include_dirs) + [oh.sysconfig.get_include()]:
        header = os.path.join(d, "tf_ophandlers", "handler.h")
        if os.path.exists(header):
            with open(header, "rb") as f:
                text += f.read()
            break
    key = hashlib.sha256(text + repr((cflags, lflags)).encode()).hexdigest()[:16]
    out_dir = os.path.join(tempfile.gettempdir(), "tf_ophandlers_test_libs")
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, "%s_%s.so" % (os.path.basename(source)[:-3], key))
    if not os.path.exists(out):
        compiler = shutil.which("g++") or pytest.skip("no g++ to build a handler library")
        tmp = out + ".%d.tmp" % os.getpid()
        # The one-liner of docs/guide.md: g++ -shared -fPIC $(flags) h.cc -o h.so $(link)
        subprocess.run([compiler, "-shared", "-fPIC", "-O1"] + cflags + [source, "-o", tmp]
                       + lflags, check=True)
        os.replace(tmp, out)
    return out


@pytest.fixture(scope="session")
def failing_library():
    return oh.load_handler_library(build_handler_library(os.path.join(HERE, "failing_handler.cc")))



def program(x, w):
    h = tf.tanh(tf.matmul(x, w)) + tf.sin(x[:, :3])
    idx = tf.constant([0, 2, 1])
    g = tf.gather(h, idx)
    return tf.reduce_sum(g * g, axis=1), tf.concat([h, g], axis=0)


@pytest.fixture
def xw():
    x = tf.random.stateless_normal([3, 4], seed=[1, 2])
    w = tf.random.stateless_normal([4, 3], seed=[3, 4])
    return x, w


def assert_same(got, want):
    for g, t in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        assert g.dtype == t.dtype and g.shape == t.shape
        np.testing.assert_allclose(g.numpy(), t.numpy(), rtol=1e-6, atol=1e-6)


def make(name):
    return getattr(oh.native, name)()


@pytest.mark.parametrize("name", ["PassThrough", "OpCounter"])
def test_values_eager_and_in_fresh_function(name, xw):
    want = program(*xw)
    with make(name):
        got = program(*xw)
        assert oh.handler_of(got[0]) is not None
    assert_same(got, want)
    fn = tf.function(program)  # fresh: traced (and replayed) under the handler
    with make(name):
        got = fn(*xw)
    assert_same(got, want)


def _counts(records):
    return dict(collections.Counter(r.op_type for r in records))


def test_op_counter_counts_what_op_log_records(xw):
    fn = tf.function(lambda x, w: program(x, w)[0] * 2.0)
    model = tf.keras.Sequential([tf.keras.layers.Dense(5, activation="relu"),
                                 tf.keras.layers.Dense(2)])
    model(xw[0])  # built outside: same variables for both runs

    def run():
        a = program(*xw)
        b = fn(*xw)
        c = model(xw[0])
        return a, b, c

    log, counter = oh.OpLogHandler(), oh.native.OpCounter()
    with log:
        want = run()
    with counter:
        got = run()
    assert_same(got, want)
    assert counter.counts == _counts(log.records)
    assert counter.total == len(log.records) > 10
    # Nested in either order, each sees every op once.
    log2, counter2 = oh.OpLogHandler(), oh.native.OpCounter()
    with counter2:
        with log2:
            program(*xw)
    log3, counter3 = oh.OpLogHandler(), oh.native.OpCounter()
    with log3:
        with counter3:
            program(*xw)
    assert counter2.counts == _counts(log2.records) == counter3.counts == _counts(log3.records)


def _grads(tape_cls, outer, inner, xw):
    x, w = tf.Variable(xw[0]), tf.Variable(xw[1])
    with outer:
        with tape_cls() as tape:
            with inner:
                y = program(x, w)[0]
                loss = tf.reduce_sum(y * y)
    grads = tape.gradient(loss, [x, w])
    return [loss] + grads


@pytest.mark.parametrize("order", ["cxx_under_tape", "tape_under_cxx", "cxx_in_tf_tape"])
def test_gradients_match_tensorflow(order, xw):
    import contextlib
    want = _grads(tf.GradientTape, contextlib.nullcontext(), contextlib.nullcontext(), xw)
    counter = oh.native.OpCounter()
    if order == "cxx_under_tape":  # the tape outside the C++ handler
        got = _grads(oh.GradientTape, contextlib.nullcontext(), counter, xw)
    elif order == "tape_under_cxx":  # the C++ handler outside the tape
        got = _grads(oh.GradientTape, counter, contextlib.nullcontext(), xw)
    else:
        got = _grads(tf.GradientTape, contextlib.nullcontext(), counter, xw)
    assert_same(got, want)
    assert counter.counts["MatMul"] >= 1


def test_python_handler_under_and_over_cxx(xw):
    want = program(*xw)

    class Double(oh.OpHandler):
        def execute(self, op, inputs):
            outputs = self.next.execute(op, inputs)
            return [o * 2.0 if op.type == "Sin" else o for o in outputs]

    with oh.native.PassThrough():
        with Double():
            a = program(*xw)
    with Double():
        with oh.native.PassThrough():
            b = program(*xw)
    with Double():
        ref = program(*xw)
    assert_same(a, ref)
    assert_same(b, ref)
    assert not np.allclose(ref[0].numpy(), want[0].numpy())


def test_keras_fit_under_op_counter():
    x = tf.random.stateless_normal([10, 4], seed=[5, 6])
    y = tf.random.stateless_normal([10, 1], seed=[7, 8])

    def fit(ctx):
        tf.keras.utils.set_random_seed(0)
        model = tf.keras.Sequential([tf.keras.Input([4]), tf.keras.layers.Dense(3),
                                     tf.keras.layers.Dense(1)])
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
        with ctx:
            hist = model.fit(x, y, batch_size=4, epochs=2, verbose=0)  # partial last batch
        return hist.history["loss"], model.get_weights()

    import contextlib
    want_loss, want_w = fit(contextlib.nullcontext())
    counter = oh.native.OpCounter()
    got_loss, got_w = fit(counter)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for g, w in zip(got_w, want_w):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert counter.counts.get("MatMul", 0) > 0


def test_check_handler_passes():
    for cls in (oh.native.PassThrough, oh.native.OpCounter):
        report = oh.testing.check_handler(cls)
        assert report.checks and not report.failures, report.failures


def test_error_reaches_python_with_message(failing_library, xw):
    FailOn = failing_library.handler_types()["FailOn"]
    with pytest.raises(tf.errors.InvalidArgumentError, match="FailOn refuses op Sin"):
        with FailOn("Sin"):
            tf.sin(xw[0])
    # The handler stays usable; other ops run; inside a function too.
    with FailOn("Sin"):
        assert_same(tf.cos(xw[0]), tf.cos(xw[0]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="FailOn refuses op Sin"):
        with FailOn("Sin"):
            tf.function(lambda x: tf.sin(x) + 1.0)(xw[0])
    # Under a Python tape (the Python path) and over a Python handler.
    with pytest.raises(tf.errors.InvalidArgumentError, match="refuses op Tanh"):
        with FailOn("Tanh"):
            with oh.GradientTape():
                program(*xw)
    with pytest.raises(tf.errors.InvalidArgumentError, match="refuses op Tanh"):
        with oh.OpLogHandler():
            with FailOn("Tanh"):
                program(*xw)


def test_python_error_below_cxx_keeps_its_identity(xw):
    class Boom(Exception):
        pass

    class Raises(oh.OpHandler):
        def execute(self, op, inputs):
            if op.type == "Sin":
                raise Boom("no Sin here")
            return self.next.execute(op, inputs)

    with pytest.raises(Boom, match="no Sin here"):
        with Raises():
            with oh.native.PassThrough():
                tf.sin(xw[0])


def test_copy_off_refusal_and_debug_string(failing_library, xw):
    NoCopyOff = failing_library.handler_types()["NoCopyOff"]
    h = NoCopyOff()
    assert h.debug_string() == "NoCopyOff(strict)"
    with h:
        y = tf.sin(xw[0])
        z = y * 2.0  # stays on the handler
    with pytest.raises(tf.errors.FailedPreconditionError, match="keeps its tensors"):
        z.numpy()


def test_library_errors(tmp_path):
    with pytest.raises(OSError, match="does not exist"):
        oh.load_handler_library(str(tmp_path / "missing.so"))
    not_lib = tmp_path / "x.so"
    not_lib.write_bytes(b"not an ELF file")
    with pytest.raises(OSError, match="cannot load handler library"):
        oh.load_handler_library(str(not_lib))
    with pytest.raises(TypeError, match="takes a str"):
        oh.native.PassThrough(3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="takes no configuration"):
        oh.native.OpCounter("x")
    with pytest.raises(ValueError, match="no queries"):
        oh.native.PassThrough().query("counts")
    with pytest.raises(tf.errors.InvalidArgumentError, match="no query 'nope'"):
        oh.native.OpCounter().query("nope")


def test_library_object():
    lib = oh.native.library()
    types = lib.handler_types()
    assert set(types) >= {"PassThrough", "OpCounter"}
    assert issubclass(types["PassThrough"], oh.OpHandler)
    assert oh.load_handler_library(lib.path) is lib
    c = oh.native.OpCounter()
    with c:
        t = tf.constant([1.0]) + 1.0
    assert "device:CPU" in t.device  # transparent: shows the physical device
    assert repr(c) == "<OpCounter(1 ops)>"


def test_eager_ops_on_native_stacks_run_without_python_frames(xw):
    """The per-op path of C++ handlers (nested, too) never enters the package's Python."""
    import sys
    calls = []

    def profile(frame, event, arg):
        if event == "call" and "tf_ophandlers" in frame.f_code.co_filename:
            calls.append(frame.f_code.co_name)

    want = tf.sin(tf.sin(tf.sin(xw[0])))
    with oh.native.OpCounter() as outer, oh.native.PassThrough():
        a = tf.identity(xw[0])  # physical input under a non-bottom stack: the Python path
        sys.setprofile(profile)
        try:
            for _ in range(3):
                a = tf.sin(a)
        finally:
            sys.setprofile(None)
    assert calls == []
    assert outer.counts == {"Identity": 1, "Sin": 3}
    assert_same(a, want)


def test_cc_handler_example_runs(capsys):
    """examples/cc_handler: built with the oh.sysconfig one-liner, loaded, used."""
    import os
    import runpy
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    example = runpy.run_path(os.path.join(root, "examples", "cc_handler", "op_timer.py"))
    assert example["main"]() == 0
    out = capsys.readouterr().out
    assert "MatMul" in out


def test_variables_devices_py_function_and_threads():
    import threading
    with oh.native.PassThrough():
        v = tf.Variable([1.0, 2.0])
        v.assign_add([1.0, 1.0])
        with tf.device("/cpu:0"):
            a = v * 2.0
        i = tf.range(5) * 3
        s = tf.strings.join(["a", "b"])
        # The body runs below the handler (as under a Python pass-through).
        p = tf.py_function(lambda x: x * 10.0, [a], tf.float32)
    np.testing.assert_array_equal(v.numpy(), [2.0, 3.0])
    np.testing.assert_array_equal(p.numpy(), [40.0, 60.0])
    np.testing.assert_array_equal(i.numpy(), [0, 3, 6, 9, 12])
    assert s.numpy() == b"ab" and a.shape == (2,) and "value=[4. 6.]" in repr(a)

    shared, errors = oh.native.OpCounter(), []

    def work():
        try:
            own = oh.native.OpCounter()
            with shared, own:
                x = tf.ones([3])
                for _ in range(30):
                    x = x + 1.0
            assert own.counts == {"Fill": 1, "AddV2": 30}, own.counts
            assert float(x[0]) == 31.0  # x[0] reaches the stacks by type: one StridedSlice
        except Exception as e:  # pylint: disable=broad-except
            errors.append(e)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert shared.counts == {"Fill": 4, "AddV2": 120, "StridedSlice": 4}


def test_shape_hooks_answer_rank_and_dims(failing_library, xw):
    Hidden = failing_library.handler_types()["HiddenDims"]
    with Hidden():
        a = tf.sin(xw[0])  # the C path
    with oh.OpLogHandler():
        with Hidden():
            b = tf.sin(xw[0])  # the Python path (a physical input over another handler)
    for t in (a, b):
        assert t.shape.rank == 2 and t.shape.as_list() == [None, None]
        np.testing.assert_allclose(t.numpy(), tf.sin(xw[0]).numpy())


def test_abi_versions(failing_library, xw):
    OldLayout = failing_library.handler_types()["OldLayout"]
    assert not OldLayout._oh_hooks["copy_on"] and not OldLayout._oh_hooks["query"]
    with OldLayout():
        y = tf.sin(xw[0]) + 1.0
    assert_same(y, tf.sin(xw[0]) + 1.0)
    with pytest.raises(ValueError, match="no queries"):
        OldLayout().query("x")
    bad = build_handler_library(os.path.join(HERE, "bad_abi_handler.cc"))
    with pytest.raises(RuntimeError, match="unknown abi_version"):
        oh.load_handler_library(bad)
