"""tf.custom_gradient inside a replayed tf.function: the override is the node's gradient.

A replay used to drop the node's ``_gradient_op_type``, so the tapes above used
IdentityN's pass-through gradient (silently wrong). Now the replayed node keeps its
override; one whose gradient function reads tensors of the traced function (which a
replay's graph does not have) raises a clear HandlerError when a gradient is asked for.
"""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh


@tf.custom_gradient
def _scaled_gradient(x):  # gradient from its arguments only: replayable
    def grad(dy):
        return dy * 3.0
    return tf.identity(x), grad


@tf.custom_gradient
def _reads_forward(x):  # gradient reads a tensor of the traced function
    def grad(dy):
        return dy * tf.cos(x) * 3.0
    return tf.sin(x), grad


def _function(inner):
    @tf.function
    def f(x):
        return tf.reduce_sum(inner(x * 2.0) * x)
    return f


X = np.array([1.0, 2.0, -0.5], np.float32)


def _tf_gradient(f, x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = f(x)
    return tape.gradient(y, x)


@pytest.mark.parametrize("outer", ["oh", "tf"])
def test_gradient_of_a_replayed_custom_gradient(outer):
    f = _function(_scaled_gradient)
    x = tf.constant(X)
    want = _tf_gradient(f, x)
    tape = oh.GradientTape() if outer == "oh" else tf.GradientTape()
    with tape:
        tape.watch(x)
        with oh.CheckNumericsHandler():  # replays the call op by op
            y = f(x)
    got = tape.gradient(y, x)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)
    # IdentityN's own gradient would give 2 * x + (x * 2): not the override's.
    assert not np.allclose(got.numpy(), 4.0 * X)


def test_jvp_of_a_replayed_custom_gradient():
    f = _function(_scaled_gradient)
    x, t = tf.constant(X), tf.constant([1.0, -1.0, 2.0])
    with tf.autodiff.ForwardAccumulator(x, t) as acc:
        want = acc.jvp(f(x))
    with oh.ForwardAccumulator(x, t) as acc:
        got = acc.jvp(f(x))
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)


def test_custom_gradient_reading_traced_tensors_is_a_clear_error():
    f = _function(_reads_forward)
    x = tf.constant(X)
    want_value = f(x)
    with oh.CheckNumericsHandler():  # no gradient asked for: it runs
        np.testing.assert_allclose(f(x).numpy(), want_value.numpy(), rtol=1e-6)
    # Under a recording tape the replayed call's gradient is built as it is recorded (or
    # when the gradient is asked for): a HandlerError either way, never IdentityN's.
    with pytest.raises(oh.HandlerError, match="tf.custom_gradient"):
        with oh.GradientTape() as tape:
            tape.watch(x)
            with oh.CheckNumericsHandler():
                y = f(x)
        tape.gradient(y, x)
    with pytest.raises(oh.HandlerError, match="reads tensors of the traced function"):
        with oh.ForwardAccumulator(x, tf.ones_like(x)) as acc:
            acc.jvp(f(x))


def test_tf_tape_outside_a_replay_keeps_a_custom_gradient_reading_traced_tensors():
    f = _function(_reads_forward)
    x = tf.constant(X)
    want = _tf_gradient(f, x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        with oh.CheckNumericsHandler():
            y = f(x)
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), want.numpy(), rtol=1e-6)


def test_gradient_override_reading_its_op_inputs_is_replayed():
    # An override registered for any op (gradient_override_map) reads `op.inputs`: the
    # tapes give it the replay's tensors, so it runs (the probe must not flag it).
    @tf.RegisterGradient("OhTestTripleSquareGrad")
    def _grad(op, dy):  # pylint: disable=unused-variable
        return dy * 3.0 * op.inputs[0]

    @tf.function
    def f(x):
        with tf.compat.v1.get_default_graph().gradient_override_map(
                {"Identity": "OhTestTripleSquareGrad"}):
            y = tf.identity(x * 1.0)
        return tf.reduce_sum(y)

    x = tf.constant(X)
    want = _tf_gradient(f, x)
    np.testing.assert_allclose(want.numpy(), 3.0 * X, rtol=1e-6)
    with oh.GradientTape() as tape:
        tape.watch(x)
        with oh.CheckNumericsHandler():
            y = f(x)
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), want.numpy(), rtol=1e-6)
