"""oh.ForwardAccumulator against tf.autodiff.ForwardAccumulator on gradients recorded
from Python: tf.custom_gradient, tf.recompute_grad, record_operation with a forward
function. TensorFlow computes their JVP when the operation is recorded."""
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import forwardprop_util, record

import tf_ophandlers as oh
from conftest import assert_close

ACCUMULATORS = (tf.autodiff.ForwardAccumulator, oh.ForwardAccumulator)


def _numpy_sin():
    """A custom gradient whose forward pass TensorFlow cannot differentiate (numpy): the
    JVP comes from the gradient function only. Counts the gradient function's calls."""
    calls = []

    @tf.custom_gradient
    def f(x):
        def grad(dy):
            calls.append(1)
            return dy * tf.cos(x)
        return np.sin(x.numpy()), grad
    return f, calls


def test_custom_gradient_jvp_through_the_gradient_function():
    x, t = tf.constant([1., 2.]), tf.constant([0.5, -2.])
    results = []
    for acc_type in ACCUMULATORS:
        f, calls = _numpy_sin()
        with acc_type(x, t) as acc:
            y = f(x)
        results.append((y, acc.jvp(y), len(calls)))
    (y_tf, jvp_tf, calls_tf), (y_oh, jvp_oh, calls_oh) = results
    assert jvp_oh is not None
    assert_close(y_oh, y_tf)
    assert_close(jvp_oh, jvp_tf)
    assert jvp_oh.dtype == jvp_tf.dtype and jvp_oh.shape == jvp_tf.shape
    assert calls_oh == calls_tf == 1


def test_custom_gradient_tangent_of_inner_ops_is_kept():
    # The forward pass is differentiable: TensorFlow keeps the tangent its inner ops
    # gave the outputs, though it runs the gradient function (here a different one).
    x, t = tf.constant(2.), tf.constant(1.)
    results = []
    for acc_type in ACCUMULATORS:
        calls = []

        @tf.custom_gradient
        def f(v):
            def grad(dy):
                calls.append(1)
                return dy * 3.
            return v * v, grad
        with acc_type(x, t) as acc:
            y = f(x)
        results.append((acc.jvp(y), len(calls)))
    assert_close(results[1][0], results[0][0])
    assert results[1][1] == results[0][1]


def test_custom_gradient_several_inputs_and_outputs():
    a, b = tf.constant([1., 2., 3.]), tf.constant([0.5, -1., 2.])
    ta, tb = tf.constant([1., 0., -1.]), tf.constant([2., 1., 0.5])

    @tf.custom_gradient
    def f(u, v):
        p, q = u.numpy(), v.numpy()

        def grad(dy1, dy2):
            return dy1 * v + dy2 * 2., dy1 * u - dy2
        return (p * q, 2. * p - q), grad
    results = []
    for acc_type in ACCUMULATORS:
        with acc_type([a, b], [ta, tb]) as acc:
            y1, y2 = f(a, b)
        results.append(acc.jvp([y1, y2]))
    for got, want in zip(results[1], results[0]):
        assert got is not None
        assert_close(got, want)


def test_custom_gradient_tangent_on_one_input_only():
    a, b = tf.constant([1., 2.]), tf.constant([3., -1.])

    @tf.custom_gradient
    def f(u, v):
        def grad(dy):
            return dy * v, dy * u
        return u.numpy() * v.numpy(), grad
    results = []
    for acc_type in ACCUMULATORS:
        with acc_type(b, tf.constant([1., 1.])) as acc:
            y = f(a, b)
        results.append(acc.jvp(y))
    assert_close(results[1], results[0])


def test_exception_in_custom_gradient_reaches_the_caller():
    c, d = tf.constant(1.), tf.constant(2.)

    @tf.custom_gradient
    def f(unused_x):
        def grad(unused_dy):
            raise ValueError("test_error_string")
        return 1., grad
    errors = []
    for acc_type in ACCUMULATORS:
        with acc_type(c, d) as acc:
            with pytest.raises(ValueError) as info:
                f(c)
            errors.append((type(info.value), str(info.value)))
            y = c * 3.  # the accumulator still records after the error
        assert_close(acc.jvp(y), 6.)
    assert errors[1] == errors[0]


def test_recompute_grad_raises_as_tensorflow():
    # TensorFlow refuses to transpose tf.recompute_grad's gradient (forward mode).
    def fn(v):
        return tf.reduce_prod(tf.tanh(v) ** 2)
    x = tf.constant([1., 2.])
    errors = []
    for acc_type in ACCUMULATORS:
        g = tf.recompute_grad(fn)
        with acc_type(x, tf.constant([1., 1.])) as acc:
            with pytest.raises(Exception) as info:
                g(x)
            y = x * 2.
        assert_close(acc.jvp(y), [2., 2.])
        errors.append((type(info.value), str(info.value)))
    assert errors[1] == errors[0]


def test_custom_gradient_under_nested_accumulators():
    x = tf.constant(0.7)

    @tf.custom_gradient
    def f(v):
        def grad(dy):
            return dy * tf.cos(v)
        return tf.constant(np.sin(v.numpy())), grad
    results = []
    for acc_type in ACCUMULATORS:
        with acc_type(x, tf.constant(1.)) as outer:
            with acc_type(x, tf.constant(1.)) as inner:
                y = f(x)
            first = inner.jvp(y)
        results.append((first, outer.jvp(y), outer.jvp(first)))
    for got, want in zip(results[1], results[0]):
        if want is None:
            assert got is None
        else:
            assert got is not None
            assert_close(got, want)


def test_record_operation_forward_function():
    c, d = tf.constant(1.), tf.constant(2.)
    results = []
    for acc_type in ACCUMULATORS:
        with acc_type(c, tf.constant(10.)) as acc:
            out = tf.identity(d)
            record.record_operation("ForwardIsSpecial", [out], [c], None,
                                    lambda jvp: [-2. * jvp])
        results.append(acc.jvp(out))
    assert results[1] is not None
    assert_close(results[1], results[0])


def test_push_forwardprop_state_inside_the_custom_gradient_function():
    # TensorFlow's accumulator ignores the ops of its own JVP computation until
    # push_forwardprop_state, inside which it records again (TensorFlow's
    # testPushPopAccumulatorState): here a JVP computed in the gradient function.
    c, d = tf.constant(1.), tf.constant(2.)
    results = []
    for acc_type in ACCUMULATORS:
        with acc_type(c, d) as acc:
            @tf.custom_gradient
            def f(x):
                def grad(dy):
                    with forwardprop_util.push_forwardprop_state():
                        x_copy = tf.constant(x.numpy())
                        acc._watch(x_copy, dy)  # pylint: disable=protected-access,cell-var-from-loop
                        y_copy = tf.sin(x_copy)
                    return dy * acc.jvp(y_copy)  # pylint: disable=cell-var-from-loop
                return np.sin(x.numpy()), grad
            out = f(c)
        results.append(acc.jvp(out))
    assert results[1] is not None
    assert_close(results[1], results[0])
    assert_close(results[1], d * tf.cos(c))
