"""cc/include/tf_ophandlers/handler.h is valid C: a handler library written in C
(tests/native/c_handler.c) builds with gcc -std=c11 -Wall -Werror and
oh.sysconfig.get_c_compile_flags(), loads, and gives plain TensorFlow's values."""
import collections
import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "c_handler.c")
WARNINGS = ["-Wall", "-Wextra", "-Werror", "-pedantic"]


def _gcc():
    return shutil.which("gcc") or pytest.skip("no gcc to build a C handler library")


def build_c_library(std="c11"):
    """tests/native/c_handler.c built as C with the documented one-liner (cached by the
    hash of the source, the header and the flags)."""
    cflags = ["-std=" + std] + WARNINGS + oh.sysconfig.get_c_compile_flags()
    lflags = oh.sysconfig.get_link_flags()
    header = os.path.join(oh.sysconfig.get_include(), "tf_ophandlers", "handler.h")
    with open(SOURCE, "rb") as f, open(header, "rb") as g:
        text = f.read() + g.read()
    key = hashlib.sha256(text + repr((cflags, lflags)).encode()).hexdigest()[:16]
    out_dir = os.path.join(tempfile.gettempdir(), "tf_ophandlers_test_libs")
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, "c_handler_%s_%s.so" % (std, key))
    if not os.path.exists(out):
        tmp = out + ".%d.tmp" % os.getpid()
        subprocess.run([_gcc(), "-shared", "-fPIC", "-O1"] + cflags + [SOURCE, "-o", tmp]
                       + lflags, check=True)
        os.replace(tmp, out)
    return out


@pytest.fixture(scope="module")
def CCounter():
    return oh.load_handler_library(build_c_library()).handler_types()["CCounter"]


def program(x, w):
    h = tf.tanh(tf.matmul(x, w)) + tf.sin(x[:, :3])
    g = tf.gather(h, tf.constant([0, 2, 1]))
    return tf.reduce_sum(g * g, axis=1), tf.concat([h, g], axis=0)


@pytest.fixture
def xw():
    return (tf.random.stateless_normal([3, 4], seed=[1, 2]),
            tf.random.stateless_normal([4, 3], seed=[3, 4]))


def assert_same(got, want):
    for g, t in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        assert g.dtype == t.dtype and g.shape == t.shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(t), rtol=1e-6, atol=1e-6)


def counts(handler):
    text = handler.query("counts").decode()
    return {line.split()[0]: int(line.split()[1]) for line in text.splitlines()}


def test_c_flags_have_no_cxx_only_flag():
    flags = oh.sysconfig.get_c_compile_flags()
    assert not any(f.lstrip("-").startswith("std=") and "++" in f for f in flags)
    # Everything else of the C++ flags is kept (include directories, defines).
    assert flags == [f for f in oh.sysconfig.get_compile_flags() if "c++" not in f]
    assert "-I" + oh.sysconfig.get_include() in flags


@pytest.mark.parametrize("std", ["c99", "c11"])
def test_header_alone_compiles_as_c(std, tmp_path):
    """The public header by itself, as strict C, with and without TensorFlow's eager C
    header after it (the struct tags it declares are that header's types)."""
    for extra in ("", '#include "tensorflow/c/eager/c_api.h"\n'):
        src = tmp_path / "h.c"
        src.write_text('#include "tf_ophandlers/handler.h"\n' + extra
                       + "size_t v1(void) { return TFOH_HANDLER_TYPE_V1_SIZE; }\n")
        res = subprocess.run([_gcc(), "-std=" + std] + WARNINGS + ["-fsyntax-only"]
                             + oh.sysconfig.get_c_compile_flags() + [str(src)],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr


def test_c_handler_values_eager_and_in_fresh_function(CCounter, xw):
    want = program(*xw)
    c = CCounter()
    with c:
        got = program(*xw)
        assert oh.handler_of(got[0]) is not None
    assert_same(got, want)
    assert c.query("dims") == b"2"  # the last op (ConcatV2) output's rank
    fn = tf.function(program)  # fresh: traced and replayed under the handler
    with CCounter():
        got = fn(*xw)
    assert_same(got, want)


def test_c_handler_counts_what_op_log_records(CCounter, xw):
    model = tf.keras.Sequential([tf.keras.layers.Dense(5, activation="relu"),
                                 tf.keras.layers.Dense(2)])
    model(xw[0])
    fn = tf.function(lambda x, w: program(x, w)[0] * 2.0)

    def run():
        return program(*xw), fn(*xw), model(xw[0])

    log, c = oh.OpLogHandler(), CCounter()
    with log:
        want = run()
    with c:
        got = run()
    assert_same(got, want)
    assert counts(c) == dict(collections.Counter(r.op_type for r in log.records))
    assert int(c.query("total")) == len(log.records) > 10
    assert "CCounter" in repr(c) or "CCounter" in str(c)


@pytest.mark.parametrize("order", ["c_under_tape", "tape_under_c", "c_in_tf_tape"])
def test_c_handler_gradients_match_tensorflow(CCounter, order, xw):
    def grads(tape_cls, outer, inner):
        x, w = tf.Variable(xw[0]), tf.Variable(xw[1])
        with outer:
            with tape_cls() as tape:
                with inner:
                    loss = tf.reduce_sum(program(x, w)[0] ** 2)
        return [loss] + tape.gradient(loss, [x, w])

    none = contextlib.nullcontext()
    want = grads(tf.GradientTape, none, none)
    c = CCounter()
    got = {"c_under_tape": lambda: grads(oh.GradientTape, none, c),
           "tape_under_c": lambda: grads(oh.GradientTape, c, none),
           "c_in_tf_tape": lambda: grads(tf.GradientTape, none, c)}[order]()
    assert_same(got, want)
    assert counts(c)["MatMul"] >= 1


def test_c_handler_errors_reach_python(CCounter, xw):
    with pytest.raises(tf.errors.InvalidArgumentError, match="CCounter refuses op Sin"):
        with CCounter("fail:Sin"):
            tf.sin(xw[0])
    with pytest.raises(Exception, match="CCounter config must be"):
        CCounter("bogus")
    with pytest.raises(Exception, match="unknown query key"):
        CCounter().query("nope")
    want = tf.cos(xw[0])
    with CCounter("fail:Sin") as c:  # still usable after an error; other ops run
        got = tf.cos(xw[0])
    assert_same(got, want)
    assert counts(c) == {"Cos": 1}


def test_c_handler_under_and_over_python_handler(CCounter, xw):
    class Double(oh.OpHandler):
        def execute(self, op, inputs):
            outputs = self.next.execute(op, inputs)
            return [o * 2.0 if op.type == "Sin" else o for o in outputs]

    with Double():
        want = program(*xw)
    with CCounter():
        with Double():
            a = program(*xw)
    with Double():
        with CCounter():
            b = program(*xw)
    assert_same(a, want)
    assert_same(b, want)


def test_c_handler_built_as_c99_loads(xw):
    lib = oh.load_handler_library(build_c_library("c99"))
    with lib.handler_types()["CCounter"]() as c:
        got = tf.matmul(*xw)
    assert_same(got, tf.matmul(*xw))
    assert counts(c) == {"MatMul": 1}
