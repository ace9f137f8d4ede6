"""A tf.function called inside a handler scope on physical arguments is replayed straight
from TensorFlow's Python call path (core/functions/call.py `_scope_execute`), not through
the dispatcher device's execute callback; any other call keeps the device route. Both give
what TensorFlow gives."""
import gc

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.core import stack as stack_module
from tf_ophandlers.core.functions import call as function_calls


@pytest.fixture
def routes():
    """The route of each replayed call: "scope" (straight) or "device" (the callback lends
    the op: a borrowed Op)."""
    seen = []
    rule = stack_module._function_call_rule[0]  # pylint: disable=protected-access

    def recording(stack, op, inputs):
        seen.append("device" if op._borrowed else "scope")  # pylint: disable=protected-access
        return rule(stack, op, inputs)
    stack_module._function_call_rule[0] = recording  # pylint: disable=protected-access
    yield seen
    stack_module._function_call_rule[0] = rule  # pylint: disable=protected-access


def _model():
    k = tf.Variable(tf.random.stateless_normal([3, 3, 3, 4], seed=[1, 2]))

    @tf.function
    def f(x):
        return tf.reduce_sum(tf.nn.relu(tf.nn.conv2d(x, k, 1, "SAME", data_format="NCHW")),
                             axis=[2, 3])

    def twin(x):
        y = tf.nn.conv2d(tf.transpose(x, [0, 2, 3, 1]), k, 1, "SAME")
        return tf.reduce_sum(tf.nn.relu(y), axis=[1, 2])
    return k, f, twin


def test_scope_placed_call_on_physical_arguments_goes_straight(routes):
    k, f, twin = _model()
    x = tf.random.stateless_normal([2, 3, 6, 6], seed=[3, 4])
    for _ in range(2):  # the trace, then a cached replay
        with oh.DataFormat():
            y = f(x)
        np.testing.assert_allclose(y.numpy(), twin(x).numpy(), rtol=1e-5, atol=1e-5)
    assert routes == ["scope", "scope"]
    # Gradients: TensorFlow's tape records the call above the replay.
    with tf.GradientTape() as tape:
        with oh.DataFormat():
            loss = tf.reduce_sum(f(x) ** 2)
    with tf.GradientTape() as ref_tape:
        ref_loss = tf.reduce_sum(twin(x) ** 2)
    np.testing.assert_allclose(tape.gradient(loss, k).numpy(),
                               ref_tape.gradient(ref_loss, k).numpy(), rtol=1e-4, atol=1e-4)


def test_other_calls_keep_the_device_route(routes):
    _, f, twin = _model()
    x = tf.random.stateless_normal([2, 3, 6, 6], seed=[5, 6])
    ref = twin(x).numpy()
    with oh.DataFormat():
        h = tf.identity(x)  # on the handler's stack: a handler tensor argument
        y = f(h)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5)
    assert routes == ["device"]
    del routes[:]
    with oh.DataFormat():
        held = oh.DataFormat()
        with held:  # two replaying handlers
            y = f(x)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5)
    assert routes == ["scope"]
    del routes[:]
    with oh.DataFormat():
        with tf.device("/CPU:0"):  # (the scope keeps placing ops: the device is recorded)
            y = f(x)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5)
    assert routes == ["scope"]


def test_errors_of_a_straight_call_are_the_replays():
    @tf.function
    def bad(x):
        return tf.nn.conv2d(x, tf.zeros([3, 3, 5, 4]), 1, "SAME", data_format="NCHW")

    with pytest.raises(Exception, match="oh.DataFormat|depth|channels|filter|input"):
        with oh.DataFormat():
            bad(tf.zeros([1, 3, 6, 6]))


def test_the_patch_is_listed_and_outside_scopes_tensorflow_runs():
    uses = {p.name: [s.use for s in p.subscribers] for p in oh.patches()}
    assert "scope_function_call" in uses["execute.quick_execute"]
    f = tf.function(lambda t: t * 2.0)
    gc.collect()  # (earlier tests' dropped functions release their replays now)
    before = function_calls.cache_info()
    assert f(tf.constant(2.0)).numpy() == 4.0
    assert function_calls.cache_info() == before  # no replay outside a scope


def test_op_callbacks_see_straight_calls_and_leave_the_path_in_place(routes):
    from tensorflow.python.framework import op_callbacks
    _, f, twin = _model()
    x = tf.random.stateless_normal([2, 3, 6, 6], seed=[7, 8])
    seen = []

    def callback(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        seen.append(op_type if isinstance(op_type, str) else op_type.decode())

    op_callbacks.add_op_callback(callback)  # (TensorFlow swaps its execute function)
    try:
        with oh.DataFormat():
            y = f(x)
    finally:
        op_callbacks.remove_op_callback(callback)  # (and swaps it back)
    np.testing.assert_allclose(y.numpy(), twin(x).numpy(), rtol=1e-5, atol=1e-5)
    assert any(t.startswith("__inference_") for t in seen), seen
    with oh.DataFormat():
        y = f(x)
    assert routes == ["scope", "scope"]
