"""Function calls under handlers: replay into handler-free functions (issue 7).

Every test compares against plain TensorFlow on the same inputs.
"""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.core import replay

from tests.conftest import assert_close


@tf.function
def _inner(a):
    return a * 2.0


@tf.function
def _program(a, b):
    """A nested call, a cond and a while loop."""
    v = _inner(a)
    c = tf.cond(b > 0, lambda: v * v, lambda: tf.sin(v))
    return tf.while_loop(lambda i, s: i < 3, lambda i, s: (i + 1, s * c), [0, c])[1]


def test_replay_shows_the_body_ops_and_gives_the_plain_result():
    a, b = tf.constant(1.5), tf.constant(2.0)
    log = oh.OpLogHandler()
    with log:
        y = _program(a, b)
    assert_close(y, _program(a, b))
    seen = log.op_types_seen()
    # The nested call is inlined; cond branches and the loop body are replayed too.
    for op_type in ("Mul", "Greater", "Sin", "Less", "AddV2"):
        assert op_type in seen, (op_type, seen)
    assert not any(t.startswith("__inference") for t in seen)
    assert y.device.endswith("CPU:0")  # a transparent handler's outputs


def test_cached_replay_is_reused_and_keyed_by_handler_and_specs():
    f = tf.function(lambda t: tf.sin(t) * 3.0)
    log = oh.OpLogHandler()
    before = replay.cache_info()
    with log:
        f(tf.constant([1.0, 2.0]))
        f(tf.constant([3.0, 4.0]))  # same specs: cached, the log sees no more ops
    assert replay.cache_info() == before + 1
    assert log.op_types_seen() == ["Sin", "Mul", "Identity"]
    with log:
        y = f(tf.constant([1.0, 2.0, 3.0]))  # new shape: replayed again
    assert replay.cache_info() == before + 2
    assert len(log.records) == 6
    assert_close(y, np.sin([1.0, 2.0, 3.0]) * 3.0)
    other = oh.OpLogHandler()  # a new log replays, so it sees the ops
    with other:
        f(tf.constant([1.0, 2.0]))
    assert other.op_types_seen() == ["Sin", "Mul", "Identity"]


def test_check_numerics_inside_a_replayed_function_runs_at_every_call():
    f = tf.function(lambda t: tf.math.log(t) * 2.0)
    handler = oh.CheckNumericsHandler()
    with handler:
        assert_close(f(tf.constant([1.0, 2.0])), np.log([1.0, 2.0]) * 2.0)
        with pytest.raises(tf.errors.InvalidArgumentError, match="op Log produced"):
            f(tf.constant([1.0, -2.0]))  # cached replay: the check is in the function


def test_handler_scopes_compose_in_replay():
    log = oh.OpLogHandler()
    a, b = tf.constant(0.5), tf.constant(-1.0)
    with oh.CheckNumericsHandler():
        with log:
            y = _program(a, b)
    assert_close(y, _program(a, b))
    assert "Sin" in log.op_types_seen()


def test_type_based_dispatch_replays_only_dependent_ops():
    log = oh.OpLogHandler()
    with log:
        x = tf.identity(tf.constant(2.0))  # a tensor of the log's stack
    log.clear()
    f = tf.function(lambda t, u: (tf.sin(t), tf.cos(u)))
    s, c = f(x, tf.constant(0.0))  # no scope: placed by its input
    assert log.op_types_seen() == ["Sin", "Identity"]
    assert_close(s, np.sin(2.0))
    assert_close(c, 1.0)


def test_case_and_switch_case():
    @tf.function
    def f(i, x):
        return tf.switch_case(i, [lambda: x + 1.0, lambda: x * 10.0, lambda: -x])

    log = oh.OpLogHandler()
    for i in range(3):
        with log:
            y = f(tf.constant(i), tf.constant(2.0))
        assert_close(y, f(tf.constant(i), tf.constant(2.0)))
    assert {"AddV2", "Mul", "Neg"} <= set(log.op_types_seen())


def test_variables_updated_once_per_call_in_order():
    v = tf.Variable(1.0)

    @tf.function
    def step(x):
        v.assign_add(x)
        w = v.read_value() * 2.0  # reads after the write
        v.assign(w)
        return w

    ref = tf.Variable(1.0)

    @tf.function
    def ref_step(x):
        ref.assign_add(x)
        w = ref.read_value() * 2.0
        ref.assign(w)
        return w

    for k in range(3):
        with oh.OpLogHandler():
            y = step(tf.constant(float(k)))
        assert_close(y, ref_step(tf.constant(float(k))))
        assert_close(v, ref)


@pytest.mark.parametrize("tape_kind", ["oh_over", "oh_under", "tf_over"])
def test_gradients_through_replayed_control_flow(tape_kind):
    a, b = tf.constant(1.5), tf.constant(2.0)
    with tf.GradientTape() as ref_tape:
        ref_tape.watch(a)
        ref_y = _program(a, b)
    expected = ref_tape.gradient(ref_y, a)
    log = oh.OpLogHandler()
    if tape_kind == "oh_over":
        with oh.GradientTape() as tape:
            tape.watch(a)
            with log:
                y = _program(a, b)
    elif tape_kind == "oh_under":
        with log:
            with oh.GradientTape() as tape:
                tape.watch(a)
                y = _program(a, b)
    else:
        with tf.GradientTape() as tape:
            tape.watch(a)
            with log:
                y = _program(a, b)
    assert_close(y, ref_y)
    assert_close(tape.gradient(y, a), expected)
    assert "Less" in log.op_types_seen()  # the log replayed the loop


def test_second_order_through_replayed_function():
    a, b = tf.constant(0.7), tf.constant(-1.0)
    with tf.GradientTape() as t2:
        t2.watch(a)
        with tf.GradientTape() as t1:
            t1.watch(a)
            y = _program(a, b)
        g = t1.gradient(y, a)
    expected = t2.gradient(g, a)
    with oh.GradientTape() as t2:
        t2.watch(a)
        with oh.GradientTape() as t1:
            t1.watch(a)
            with oh.OpLogHandler():
                y = _program(a, b)
        g = t1.gradient(y, a)
    assert_close(t2.gradient(g, a), expected)


def test_keras_model_under_replay_matches_plain():
    import keras
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)])
    call = tf.function(lambda x: model(x, training=False))
    x = tf.random.stateless_normal([4, 6], seed=[1, 2])
    with tf.GradientTape() as ref_tape:
        ref = call(x)
        ref_loss = tf.reduce_sum(ref ** 2)
    ref_grads = ref_tape.gradient(ref_loss, model.trainable_variables)
    log = oh.OpLogHandler()
    with oh.GradientTape() as tape:
        with log:
            y = call(x)
            loss = tf.reduce_sum(y ** 2)
    assert log.op_types_seen().count("MatMul") == 2  # the forward call, replayed
    grads = tape.gradient(loss, model.trainable_variables)
    assert_close(y, ref)
    for g, r in zip(grads, ref_grads):
        assert_close(g, r)
    # The backward function runs on the forward op's stack (RFC), so it is replayed
    # through the log too: two MatMuls per layer.
    assert log.op_types_seen().count("MatMul") == 6
