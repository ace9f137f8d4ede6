"""The op fast path without TensorFlow's stack capture (core/skip_trace.py,
cc/fast/fast_trace.cc), tested mostly under oh.Lazy: installed only while a handler scope
places ops on the dispatcher, it runs the common op itself (values equal eager's) and
leaves every other call to TensorFlow's function: ops a tape or accumulator records, ops
off the dispatcher, Python numbers it cannot convert, dtype errors (same errors as
eager)."""
import threading

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python import pywrap_tfe

import tf_ophandlers as oh
import tf_ophandlers._C as _C
from tf_ophandlers.core import scope
from tf_ophandlers.core import skip_trace

from conftest import assert_same_tensors


def _taken():
    return _C.skip_trace_stats()["taken"]


def _chain(h):
    for _ in range(10):
        h = tf.tanh(h) * 1.01 + 2  # a float and an int converted with the tensor's dtype
        h = tf.maximum(h, 0.5) - tf.sin(h)
    return h


@pytest.mark.parametrize("make", [oh.Lazy, oh.OpHandler])
def test_installed_only_while_a_handler_scope_is_open(make):
    original = skip_trace._fast_path_execute  # pylint: disable=protected-access
    assert pywrap_tfe.TFE_Py_FastPathExecute is original
    outer = make()
    with outer:
        assert pywrap_tfe.TFE_Py_FastPathExecute is _C.skip_trace_execute
        with make(), oh.GradientTape():
            pass
        with outer:  # re-entered: still installed
            pass
        with tf.device("CPU:0"):  # the stack's physical placement: still the dispatcher
            assert pywrap_tfe.TFE_Py_FastPathExecute is _C.skip_trace_execute
        assert pywrap_tfe.TFE_Py_FastPathExecute is _C.skip_trace_execute
    assert pywrap_tfe.TFE_Py_FastPathExecute is original
    with pytest.raises(tf.errors.InvalidArgumentError):
        with oh.Lazy():  # a failing flush at the exit uninstalls it too
            float(tf.reshape(tf.ones([4]), [3]) * 2.0)
    assert pywrap_tfe.TFE_Py_FastPathExecute is original

    class Refuses(oh.OpHandler):
        def scope_entered(self):
            raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        with Refuses():  # a scope that fails to open uninstalls it
            pass
    assert pywrap_tfe.TFE_Py_FastPathExecute is original


def test_ops_under_a_pass_through_handler_skip_the_capture():
    x = tf.random.stateless_normal([4, 5], seed=[3, 4])
    before = _taken()
    with oh.OpHandler():
        got = _chain(x)
    assert _taken() - before == 60
    assert_same_tensors(_chain(x), got)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"Op:AddV2"):
        with oh.OpHandler():
            tf.ones([2]) + tf.ones([3])  # the kernel's error, as eager names it


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_ops_it_runs_equal_eager(jit, dtype):
    x = tf.cast(tf.random.stateless_normal([4, 5], seed=[1, 2]), dtype)
    before = _taken()
    with oh.Lazy(jit_compile=jit) as lazy:
        got = _chain(x)
        got.numpy()
    assert _taken() - before == 60  # every op of the chain, none through TensorFlow's
    assert lazy.flushes == 1
    assert_same_tensors(_chain(x), got, tol=1e-5 if jit else 0)


def test_tapes_and_accumulators_get_tensorflows_path():
    x = tf.random.stateless_normal([3, 3], seed=[3, 4])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(_chain(x))
    want = tape.gradient(y, x)
    with oh.Lazy():
        before = _taken()
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(_chain(x))
        assert _taken() == before  # recorded by the tape: TensorFlow's function
        got = tape.gradient(y, x)  # (its ops, under no tape, are taken)
        tangent = tf.ones_like(x)
        before = _taken()
        with tf.autodiff.ForwardAccumulator(x, tangent) as acc:
            z = tf.tanh(x) * 3.0
        assert _taken() == before
        jvp = acc.jvp(z)
        got.numpy()
    assert_same_tensors(want, got, tol=1e-5)
    assert_same_tensors((1.0 - tf.tanh(x) ** 2) * 3.0, jvp, tol=1e-5)


def test_ops_off_the_dispatcher_and_other_threads_get_tensorflows_path():
    x = tf.constant([1.0, 2.0])
    with oh.Lazy():
        before = _taken()
        with scope.physical():
            y = tf.tanh(x) * 2.0  # a physical op: TensorFlow's own path
        assert _taken() == before
        assert oh.handler_of(y) is None
        results = []
        worker = threading.Thread(target=lambda: results.append(tf.sin(x) * 3.0))
        worker.start()  # another thread's eager ops, while this thread's scope is open
        worker.join()
        assert _taken() == before
        assert oh.handler_of(results[0]) is None
    np.testing.assert_allclose(y.numpy(), np.tanh([1.0, 2.0]) * 2.0, rtol=1e-6)
    np.testing.assert_allclose(results[0].numpy(), np.sin([1.0, 2.0]) * 3.0, rtol=1e-6)


def _error_of(fn):
    try:
        fn()
    except Exception as e:  # pylint: disable=broad-except
        return type(e), str(e)
    return None


_INT = tf.constant([1, 2])
_FLOAT = tf.ones([2])


@pytest.mark.parametrize("name, fn", [
    ("int tensor times 1.5", lambda: _INT * 1.5),
    ("tanh of int32", lambda: tf.tanh(_INT).numpy()),
    ("float plus int32", lambda: tf.add(_FLOAT, _INT).numpy()),
])
def test_errors_are_tensorflows(name, fn):
    want = _error_of(fn)
    assert want is not None, name
    with oh.Lazy():
        before = _taken()
        got = _error_of(fn)
        assert _taken() == before  # left to TensorFlow's function, which raised
    assert got is not None and got[0] is want[0], (name, got, want)


class _Refuses(oh.OpHandler):
    def execute(self, op, inputs):
        if op.type == "Tanh":
            raise ValueError("tanh refused by the handler")
        return self.next.execute(op, inputs)


def test_a_handlers_exception_reaches_the_program_unchanged():
    x = tf.ones([2])
    with oh.Lazy():
        with _Refuses():
            before = _taken()
            with pytest.raises(ValueError, match="^tanh refused by the handler$"):
                tf.tanh(x)
            assert _taken() == before + 1  # run here, failed in the handler's hook
            y = tf.sin(x) * 2.0  # and the next op runs normally
        assert _taken() == before + 3
        np.testing.assert_allclose(y.numpy(), np.sin([1.0, 1.0]) * 2.0, rtol=1e-6)


def _attribute_ops(x, w, k):
    # Ops whose wrappers pass bool / int / float / string / list(int) attributes by name.
    y = tf.matmul(x, w, transpose_b=True)               # bool
    y = tf.nn.leaky_relu(y, alpha=0.3)                   # float
    z = tf.nn.conv2d(tf.reshape(x, [1, 4, 5, 1]), k, strides=[1, 1, 1, 1],
                     padding="SAME", data_format="NHWC")  # string, list(int)
    z = tf.nn.bias_add(z, tf.ones([2]))                  # string
    s = tf.raw_ops.Sum(input=z, axis=tf.constant([1, 2]), keep_dims=True)  # bool
    c = tf.raw_ops.Cumsum(x=y, axis=tf.constant(1), exclusive=True, reverse=False)
    return y, z, s, c


def test_ops_with_plain_attributes_skip_the_capture():
    x = tf.random.stateless_normal([4, 5], seed=[5, 6])
    w = tf.random.stateless_normal([3, 5], seed=[7, 8])
    k = tf.random.stateless_normal([2, 2, 1, 2], seed=[9, 1])
    want = _attribute_ops(x, w, k)
    before = _taken()
    with oh.OpHandler():
        got = _attribute_ops(x, w, k)
    assert _taken() - before >= 6
    for a, b in zip(want, got):
        assert_same_tensors(a, b)
    with oh.Lazy():
        lazy = _attribute_ops(x, w, k)
    for a, b in zip(want, lazy):
        assert_same_tensors(a, b, tol=1e-6)


def test_attribute_errors_are_tensorflows():
    x = tf.ones([1, 4, 4, 1])
    k = tf.ones([2, 2, 1, 1])
    for make in (lambda: tf.nn.conv2d(x, k, strides=[1, 1, 1, 1], padding="NOPE"),
                 lambda: tf.raw_ops.Conv2D(input=x, filter=k, strides=[1, 1, 1],
                                           padding="SAME")):
        with pytest.raises(Exception) as plain:
            make()
        with pytest.raises(Exception) as under:
            with oh.OpHandler():
                make()
        assert type(under.value) is type(plain.value)


def _explicit_type_ops(x, v):
    return (tf.cast(x, tf.int32), tf.raw_ops.Cast(x=x, DstT=tf.float64.as_datatype_enum),
            tf.shape(x, out_type=tf.int64), v.read_value() * 2.0,
            tf.bitcast(x, tf.int32), tf.zeros_like(x, dtype=tf.float16))


def test_ops_with_explicit_type_attributes_skip_the_capture():
    x = tf.random.stateless_normal([3, 4], seed=[2, 3]) * 10
    v = tf.Variable(tf.ones([2]))
    want = _explicit_type_ops(x, v)
    before = _taken()
    with oh.OpHandler():
        got = _explicit_type_ops(x, v)
    assert _taken() - before >= 6
    for a, b in zip(want, got):
        assert_same_tensors(a, b)
    with pytest.raises(Exception) as plain:
        tf.raw_ops.Cast(x=x, DstT=tf.string)
    with pytest.raises(Exception) as under:
        with oh.OpHandler():
            tf.raw_ops.Cast(x=x, DstT=tf.string)
    assert type(under.value) is type(plain.value)


def _multi_output_ops(x, labels):
    loss, backprop = tf.raw_ops.SparseSoftmaxCrossEntropyWithLogits(
        features=x, labels=labels)
    mean, variance = tf.nn.moments(x, axes=[0])  # (single-output ops)
    y, idx = tf.unique(labels)
    return loss, backprop, mean, variance, y, idx


def test_ops_with_several_outputs_skip_the_capture():
    x = tf.random.stateless_normal([5, 4], seed=[3, 4])
    labels = tf.constant([1, 0, 3, 1, 2])
    want = _multi_output_ops(x, labels)
    before = _taken()
    with oh.OpHandler():
        ssce = tf.raw_ops.SparseSoftmaxCrossEntropyWithLogits(features=x, labels=labels)
        assert _taken() - before == 1  # (TensorFlow's function before: two outputs)
        assert type(ssce).__name__ == "SparseSoftmaxCrossEntropyWithLogits"  # its tuple
        got = _multi_output_ops(x, labels)
    for a, b in zip(want, got):
        assert_same_tensors(a, b)
    with pytest.raises(Exception) as plain:
        tf.raw_ops.SparseSoftmaxCrossEntropyWithLogits(features=x, labels=labels[:2])
    with pytest.raises(Exception) as under:
        with oh.OpHandler():
            tf.raw_ops.SparseSoftmaxCrossEntropyWithLogits(features=x, labels=labels[:2])
    assert type(under.value) is type(plain.value)
