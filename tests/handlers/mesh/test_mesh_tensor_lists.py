"""TensorLists (tf.map_fn, tf.scan, a Keras LSTM) in a tf.function called in an oh.Mesh
scope: the replay folds small constant inputs of stateless ops, and must leave ops whose
outputs are TensorLists (variants) to run, not read them as NumPy values. Compared with
the same function run by TensorFlow without the mesh."""
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


def _map(x, w):
    return tf.map_fn(lambda r: tf.tanh(r * w), x)


def _scan(x, w):
    return tf.scan(lambda a, r: a * 0.5 + r * w, x)


@pytest.mark.parametrize("body", [_map, _scan], ids=["map_fn", "scan"])
def test_tensor_list_loops_in_a_replayed_function(mesh, body):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 6)).astype("float32")
    w0 = rng.normal(size=(6,)).astype("float32")

    def make(w):
        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                y = body(x, w)
                loss = tf.reduce_sum(y * y)
            return y, loss, tape.gradient(loss, w)
        return step

    with mesh:
        w = tf.Variable(w0)
    ref = make(tf.Variable(w0))(x)
    with mesh:
        got = make(w)(mesh.shard(x, ("batch", None)))
    assert mesh.layout_of(got[0]) is not None
    for a, b in zip(got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert_close(mesh.unshard(a), b, 1e-5)


def test_keras_lstm_in_a_replayed_function(mesh):
    keras.utils.set_random_seed(0)
    ref = keras.layers.LSTM(4, return_sequences=True)
    ref.build((None, 3, 2))
    with mesh:
        layer = keras.layers.LSTM(4, return_sequences=True)
        layer.build((None, 3, 2))
    with mesh:
        for a, b in zip(layer.weights, ref.weights):
            a.assign(b.numpy())
    x = np.random.default_rng(1).normal(size=(4, 3, 2)).astype("float32")
    want = tf.function(lambda x: ref(x))(x)
    with mesh:
        got = tf.function(lambda x: layer(x))(mesh.shard(x, ("batch", None, None)))
    assert got.shape == want.shape
    assert_close(mesh.unshard(got), want, 1e-5)
