"""`rc.in_order = True`: each segment's gradient function runs its ops one at a time, in
the order they were made (recompute/segments.py `run_in_order`). Checked on the
functions' graphs (every op after the first waits for the one made before it; without
the setting the recomputation's ops do not) and on gradients against
tf.GradientTape's, with a Keras residual CNN with batch norm. The peak it lowers is
measured in benchmarks/recompute_resnet.py."""

import keras
import numpy as np
import tensorflow as tf

import tf_ophandlers as oh
import recompute_helpers
from tf_ophandlers.handlers.recompute import segments

def _residual_cnn():
    keras.utils.set_random_seed(3)
    inp = keras.Input((16, 16, 3))
    h = keras.layers.Conv2D(8, 3, padding="same")(inp)
    for _ in range(4):
        r = keras.layers.Conv2D(8, 3, padding="same")(h)
        r = keras.layers.BatchNormalization()(r)
        r = keras.layers.ReLU()(r)
        r = keras.layers.Conv2D(8, 1)(r)
        h = keras.layers.ReLU()(keras.layers.Add()([h, r]))
    out = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(h))
    return keras.Model(inp, out)


def _step(model, x, rc):
    with oh.GradientTape() as tape:
        with rc:
            loss = tf.reduce_mean(tf.square(model(x, training=False)))
    return loss, tape.gradient(loss, model.trainable_variables)


def _chained(function):
    """Whether every op of a gradient function (but constants, arguments and the
    Identity ops tf.function adds for its results) has the op made before it among its
    control inputs."""
    graph = function.function.graph
    results = {t.op for t in graph.outputs}
    previous, chained = None, True
    for op in graph.get_operations():
        if op.type in segments.UNCHAINED_OPS or op in results:
            continue
        if previous is not None and previous not in op.control_inputs:
            chained = False
        previous = op
    return chained


def _built_by(step):
    """The gradient functions the segments' backward calls of `step()` built."""
    segments._gradients.clear()  # pylint: disable=protected-access
    step()
    return list(segments._gradients.values())  # pylint: disable=protected-access


def test_in_order_gradient_functions_chain_every_op():
    model = _residual_cnn()
    x = tf.constant(np.random.default_rng(0).standard_normal((4, 16, 16, 3)), tf.float32)
    plain, ordered = oh.Recompute(), oh.Recompute()
    ordered.in_order = True
    free = _built_by(lambda: _step(model, x, plain))
    chained = _built_by(lambda: _step(model, x, ordered))
    assert ordered.stats["segments"] >= 2, ordered.stats
    assert free and chained
    assert all(_chained(f) for f in chained)
    assert not any(_chained(f) for f in free)


def test_in_order_gradients_equal_tf_gradient_tape():
    model = _residual_cnn()
    x = tf.constant(np.random.default_rng(1).standard_normal((4, 16, 16, 3)), tf.float32)
    with tf.GradientTape() as ref:
        want = tf.reduce_mean(tf.square(model(x, training=False)))
    expected = ref.gradient(want, model.trainable_variables)
    rc = oh.Recompute()
    rc.in_order = True
    for _ in range(2):  # the second step plans with the first one's size
        loss, got = _step(model, x, rc)
        recompute_helpers.assert_grads(expected, got)
        np.testing.assert_allclose(loss.numpy(), want.numpy(), rtol=1e-6)
    assert rc.stats["segments"] >= 2, rc.stats
