"""oh.ParallelHandler with a partial last batch split unevenly over the replicas (found by
tests/compositions/test_fuzz_keras.py): a packed tensor whose components differ in length
has an unknown dim, and eager `tf.size` computed its size from the static dims in Python
(numpy raised a TypeError, e.g. in the gradient of an embedding's gather)."""
import keras
import numpy as np
import tensorflow as tf

import tf_ophandlers as oh

from conftest import assert_close

DEVICES = ["CPU:0", "CPU:1"]


def test_size_of_components_of_different_lengths():
    parallel = oh.ParallelHandler(DEVICES)
    with parallel:
        x = parallel.pack([tf.constant([[1.0, 2.0]]), tf.constant([[1.0, 2.0]] * 3)])
        assert x.shape.as_list() == [None, 2]
        sizes = [int(s) for s in parallel.unpack(tf.size(x))]
        sizes64 = [int(s) for s in parallel.unpack(tf.size(x, out_type=tf.int64))]
    assert sizes == sizes64 == [2, 6]
    assert int(tf.size(tf.ones([3, 2]))) == 6  # plain tensors: TensorFlow's own path


def test_embedding_gradient_with_a_partial_batch_split_unevenly():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(9, 3),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])
    ids = np.random.default_rng(0).integers(0, 9, (3, 4)).astype(np.int32)
    parts = [ids[:1], ids[1:]]  # a last batch of 3: 1 + 2 examples
    want = None
    for part in parts:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(part))) / 3.0
        g = [tf.convert_to_tensor(e) for e in tape.gradient(loss, model.trainable_variables)]
        want = g if want is None else [a + b for a, b in zip(want, g)]
    parallel = oh.ParallelHandler(DEVICES)
    with parallel:
        with oh.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(parallel.pack(parts)))) / 3.0
        got = [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]
        got = [tf.add_n(parallel.unpack(g)) if oh.handler_of(g) is not None else g for g in got]
    for w, g in zip(want, got):
        assert_close(g, w, 1e-5)
