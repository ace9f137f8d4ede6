"""oh.Mesh's rule for SparseSoftmaxCrossEntropyWithLogits (Keras's sparse categorical
crossentropy from logits) on a 2x2 ("batch", "model") mesh, against plain TensorFlow on
the same inputs: values, gradients, layouts, and no gather to one device."""
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_close

DEVICES = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]


@pytest.fixture
def mesh():
    return oh.Mesh({"batch": 2, "model": 2}, DEVICES)


def _inputs(seed=0, rows=8, classes=6):
    rng = np.random.default_rng(seed)
    logits = tf.constant(rng.normal(size=(rows, classes)).astype("float32") * 3)
    labels = tf.constant(rng.integers(0, classes, size=rows).astype("int32"))
    return logits, labels


def _loss_and_grads(tape_type, logits, labels, weights):
    """(per-row loss, gradient of a weighted sum of it w.r.t. the logits)."""
    with tape_type() as tape:
        tape.watch(logits)
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        total = tf.reduce_sum(loss * weights)
    return loss, tape.gradient(total, logits)


# (logits layout, labels layout, expected loss layout)
LAYOUTS = [(("batch", None), ("batch",), ("batch",)),
           (("batch", "model"), ("batch",), ("batch",)),
           ((None, "model"), (None,), (None,)),
           (("model", "batch"), ("model",), ("model",)),
           ((None, None), ("batch",), ("batch",)),
           (("batch", None), (None,), ("batch",)),
           ((None, "model"), ("model",), (None,))]  # labels sharded like the classes


@pytest.mark.parametrize("tape_type", [oh.GradientTape, tf.GradientTape])
@pytest.mark.parametrize("logits_layout,labels_layout,loss_layout", LAYOUTS)
def test_sparse_softmax_cross_entropy_runs_sharded(mesh, caplog, tape_type, logits_layout,
                                                   labels_layout, loss_layout):
    logits, labels = _inputs()
    weights = tf.range(1., 9.)  # distinct per row: a wrong row order changes the gradient
    ref_loss, ref_grad = _loss_and_grads(tf.GradientTape, logits, labels, weights)
    with caplog.at_level(logging.WARNING, logger="tf_ophandlers"), mesh:
        x = mesh.shard(logits, logits_layout)
        y = mesh.shard(labels, labels_layout)
        loss, grad = _loss_and_grads(tape_type, x, y, mesh.shard(weights, loss_layout))
        assert mesh.layout_of(loss) == loss_layout
        assert mesh.layout_of(grad) == (loss_layout[0], logits_layout[1])
    assert not mesh.fallbacks, mesh.fallbacks
    assert not [r for r in caplog.records if "no SPMD rule" in r.getMessage()]
    assert loss.dtype == ref_loss.dtype and loss.shape == ref_loss.shape
    assert_close(loss, ref_loss, 1e-5)
    assert_close(grad, ref_grad, 1e-5)


def test_sparse_softmax_cross_entropy_second_order_and_float64(mesh):
    logits, labels = _inputs(1)
    logits = tf.cast(logits, tf.float64)

    def hessian_diag(tape_type, x, y):
        with tape_type() as outer:
            outer.watch(x)
            with tape_type() as inner:
                inner.watch(x)
                loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(y, x))
            g = inner.gradient(loss, x)
            s = tf.reduce_sum(g * g)
        return g, outer.gradient(s, x)

    ref = hessian_diag(tf.GradientTape, logits, labels)
    for layout in [("batch", None), ("batch", "model")]:
        with mesh:
            got = hessian_diag(oh.GradientTape, mesh.shard(logits, layout),
                               mesh.shard(labels, layout[:1]))
        for g, r in zip(got, ref):
            assert g.dtype == tf.float64
            assert_close(g, r, 1e-9)
    assert "SparseSoftmaxCrossEntropyWithLogits" not in mesh.fallbacks


@pytest.mark.parametrize("logits_layout", [("batch", None), ("batch", "model")])
@pytest.mark.parametrize("bad", [6, -1])
def test_sparse_softmax_cross_entropy_bad_labels_raise(mesh, logits_layout, bad):
    logits, labels = _inputs()
    labels = tf.tensor_scatter_nd_update(labels, [[5]], [bad])
    with pytest.raises(tf.errors.InvalidArgumentError):
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
    with mesh, pytest.raises(tf.errors.InvalidArgumentError) as info:
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
            mesh.shard(labels, ("batch",)), mesh.shard(logits, logits_layout))
        loss.numpy()
    message = str(info.value)
    assert ("oh.Mesh: SparseSoftmaxCrossEntropyWithLogits" in message
            or "outside the valid range" in message), message


def test_keras_classifier_trains_with_batch_sharded_data_like_a_single_device(mesh):
    def build():
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(5)])
    with mesh:
        model = build()
    ref = build()
    ref.set_weights(model.get_weights())
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 8)).astype("float32")
    y = rng.integers(0, 5, size=8).astype("int32")
    losses = []
    for _ in range(4):
        with mesh:
            xs, ys = mesh.shard(x, ("batch", None)), mesh.shard(y, ("batch",))
            with oh.GradientTape() as tape:
                loss = loss_fn(ys, model(xs))
            grads = tape.gradient(loss, model.trainable_variables)
            for v, g in zip(model.trainable_variables, grads):
                v.assign_sub(0.5 * g)
        with tf.GradientTape() as tape:
            ref_loss = loss_fn(y, ref(x))
        for v, g in zip(ref.trainable_variables,
                        tape.gradient(ref_loss, ref.trainable_variables)):
            v.assign_sub(0.5 * g)
        losses.append((float(loss), float(ref_loss)))
    losses = np.array(losses)
    np.testing.assert_allclose(losses[:, 0], losses[:, 1], rtol=1e-5, atol=1e-5)
    assert losses[-1, 0] < losses[0, 0]
    assert not mesh.fallbacks, mesh.fallbacks


@pytest.mark.parametrize("logits_layout", [("batch", None), ("batch", "model")])
def test_sparse_softmax_cross_entropy_in_a_replayed_tf_function(mesh, logits_layout):
    logits, labels = _inputs(2)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, x))
        return loss, tape.gradient(loss, x)

    ref_loss, ref_grad = step(logits, labels)
    with mesh:
        x, y = mesh.shard(logits, logits_layout), mesh.shard(labels, ("batch",))
        for _ in range(2):
            loss, grad = step(x, y)
            assert mesh.layout_of(grad) == logits_layout
            assert_close(loss, ref_loss, 1e-5)
            assert_close(grad, ref_grad, 1e-5)
    assert not mesh.fallbacks, mesh.fallbacks
