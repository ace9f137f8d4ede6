"""Gradients of every variable of a Keras CNN and a Transformer block, under oh.GradientTape
combined with each shipped scope handler (both nesting orders), equal tf.GradientTape's:
values, dtype, shape and type (dense vs tf.IndexedSlices)."""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

keras = tf.keras

HANDLERS = {
    "OpHandler": oh.OpHandler,
    "OpLogHandler": oh.OpLogHandler,
    "CheckNumerics": oh.CheckNumericsHandler,
    "ForwardAccumulator": lambda: oh.ForwardAccumulator(tf.constant(0.0), tf.constant(1.0)),
    "TraceAndExecute": oh.TraceAndExecute,
    "Lazy": oh.Lazy,
    "Async": oh.Async,
}


def _cnn():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.BatchNormalization(), keras.layers.MaxPooling2D(),
        keras.layers.DepthwiseConv2D(3, padding="same"), keras.layers.Conv2D(2, 1),
        keras.layers.Flatten(), keras.layers.Dense(3)])
    x = tf.constant(np.random.RandomState(0).randn(2, 8, 8, 3).astype(np.float32))
    return model, x


def _transformer():
    keras.utils.set_random_seed(4)
    ids = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(20, 8)(ids)
    a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(h, h)
    h = keras.layers.LayerNormalization()(h + a)
    f = keras.layers.Dense(8)(keras.layers.Dense(16, activation="gelu")(h))
    h = keras.layers.LayerNormalization()(h + f)
    out = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(h))
    model = keras.Model(ids, out)
    x = tf.constant(np.random.RandomState(1).randint(0, 20, (2, 6)).astype(np.int32))
    return model, x


MODELS = {"cnn": _cnn, "transformer": _transformer}


def _loss(model, x):
    return tf.reduce_sum(tf.square(model(x, training=True)))


def _reference(model, x):
    with tf.GradientTape() as tape:
        loss = _loss(model, x)
    return tape.gradient(loss, model.trainable_variables)


def _dense(g):
    return tf.convert_to_tensor(g).numpy()


@pytest.mark.parametrize("handler", sorted(HANDLERS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("tape_outside", [True, False], ids=["tape_outside", "tape_inside"])
def test_keras_gradients_under_a_handler_pair_equal_tf(model_name, handler, tape_outside):
    model, x = MODELS[model_name]()
    want = _reference(model, x)
    variables = model.trainable_variables
    if tape_outside:
        with oh.GradientTape() as tape:
            with HANDLERS[handler]():
                loss = _loss(model, x)
        got = tape.gradient(loss, variables)
    else:
        with HANDLERS[handler]():
            with oh.GradientTape() as tape:
                loss = _loss(model, x)
            got = tape.gradient(loss, variables)
            got = [g if g is None else (tf.IndexedSlices(tf.identity(g.values), tf.identity(
                g.indices), g.dense_shape) if isinstance(g, tf.IndexedSlices) else g)
                   for g in got]
    assert len(got) == len(want)
    for v, w, g in zip(variables, want, got):
        assert (g is None) == (w is None), v.name
        if w is None:
            continue
        assert type(g) is type(w), (v.name, type(g), type(w))
        assert g.dtype == w.dtype, v.name
        np.testing.assert_allclose(_dense(g), _dense(w), rtol=2e-4, atol=2e-5,
                                   err_msg="%s under %s" % (v.name, handler))
