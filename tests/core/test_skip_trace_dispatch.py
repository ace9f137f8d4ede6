"""skip_trace_execute's call of the dispatcher without TFE_Execute (cc/boundary/device.h
ExecuteOnDispatcherHeld): an op it placed on the dispatcher runs the device's execute
callback with the GIL kept, as TensorFlow would route it; an op TensorFlow's placement
rules could send elsewhere (a resource input) and an op the no-GIL path of a C++
handler takes still go through TFE_Execute. Values and errors equal eager's."""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
import tf_ophandlers._C as _C


def _stats():
    s = _C.skip_trace_stats()
    return s["taken"], s["held"]


def _chain(h):
    for _ in range(5):
        h = tf.tanh(h) * 1.01 + 2
    return h


def _nogil():
    s = _C.fast_stats()
    return s["nogil_ops"] + s["nogil_forward_ops"]


def test_common_ops_call_the_dispatcher_without_tfe_execute():
    x = tf.random.stateless_uniform([4, 4], seed=[1, 2])
    want = _chain(x).numpy()
    with oh.Lazy():
        taken, held = _stats()
        y = _chain(x)
        taken2, held2 = _stats()
        got = y.numpy()
    assert taken2 - taken == 15
    assert held2 - held == 15
    np.testing.assert_array_equal(got, want)


def test_a_pass_through_level_keeps_its_no_gil_path():
    # A Python pass-through level over PHYSICAL is in the thread's no-GIL plan after its
    # first op of a type: its ops still reach the dispatcher through TFE_Execute, without the GIL.
    x = tf.random.stateless_uniform([4, 4], seed=[1, 2])
    want = _chain(x).numpy()
    with oh.OpHandler():
        taken, held = _stats()
        nogil = _nogil()
        y = _chain(x)
        taken2, held2 = _stats()
        ran = _nogil() - nogil
        got = y.numpy()
    assert taken2 - taken == 15
    assert ran >= 12 and held2 - held <= 15 - ran  # (one op per type makes the plan)
    np.testing.assert_array_equal(got, want)


def test_a_resource_input_goes_through_tfe_execute():
    v = tf.Variable([1.0, 2.0])
    with oh.OpHandler():
        taken, held = _stats()
        r = tf.raw_ops.ReadVariableOp(resource=v.handle, dtype=tf.float32)
        assert _stats() == (taken + 1, held)  # taken, not held
        got = (r * 2.0).numpy()
    np.testing.assert_array_equal(got, [2.0, 4.0])


def test_the_no_gil_path_of_a_cxx_handler_keeps_its_ops():
    x = tf.constant([1.0, -2.0])
    before = _C.fast_stats()
    with oh.native.PassThrough():
        ys = [tf.math.abs(x) * 3.0 for _ in range(10)]
        got = [y.numpy() for y in ys]
    after = _C.fast_stats()
    ran = (after["nogil_ops"] + after["nogil_forward_ops"]
           - before["nogil_ops"] - before["nogil_forward_ops"])
    assert ran >= 15  # (the first op of the scope takes the GIL path and makes the plan)
    for g in got:
        np.testing.assert_array_equal(g, [3.0, 6.0])


@pytest.mark.parametrize("make", [oh.Lazy, oh.OpHandler])
def test_kernel_errors_equal_eagers(make):
    a = tf.constant([1, 2], tf.int32)
    b = tf.constant([0, 1], tf.int32)
    with pytest.raises(tf.errors.InvalidArgumentError) as eager:
        tf.math.floordiv(a, b).numpy()
    with pytest.raises(tf.errors.InvalidArgumentError) as handled:
        with make():
            tf.math.floordiv(a, b).numpy()
    assert "Integer division by zero" in str(eager.value)
    assert "Integer division by zero" in str(handled.value)
