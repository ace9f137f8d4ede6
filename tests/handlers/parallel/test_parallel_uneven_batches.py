"""oh.ParallelHandler with a partial last batch split unevenly over the replicas (found by
tests/compositions/test_fuzz_keras.py): a packed tensor whose components differ in length
has an unknown dim, and eager `tf.size` computed its size from the static dims in Python
(numpy raised a TypeError, e.g. in the gradient of an embedding's gather).

`model.fit(run_eagerly=True)` on such batches trains as MirroredStrategy on the same two
logical CPUs (its replicas get 3 + 2 examples of a batch of 5)."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from parallel_mirrored import mirrored_strategy

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


# -- model.fit(run_eagerly=True) with batches split unevenly, against MirroredStrategy --

def _dense():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def _conv_batch_norm():
    # No bias before the normalization: its gradient is zero up to round-off, which Adam
    # would scale up to whole steps of either sign.
    return keras.Sequential([keras.Input((6, 6, 2)), keras.layers.Conv2D(3, 3, use_bias=False),
                             keras.layers.BatchNormalization(), keras.layers.ReLU(),
                             keras.layers.Flatten(), keras.layers.Dense(1)])


def _embedding():
    return keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(9, 3),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])


def _data(n, model):
    rng = np.random.RandomState(0)
    shape = (n,) + tuple(model.input_shape[1:])
    if model.inputs[0].dtype == "int32":
        x = rng.randint(0, 9, shape).astype(np.int32)
    else:
        x = rng.randn(*shape).astype(np.float32)
    return x, (x.reshape(n, -1).sum(1, keepdims=True) * 0.5).astype(np.float32)


def _train(make, n, batch_size, scope, run_eagerly=True, optimizer=keras.optimizers.Adam):
    keras.utils.set_random_seed(0)
    with scope:
        model = make()
        model.compile(optimizer(0.05), "mse", metrics=["mae"], run_eagerly=run_eagerly)
        x, y = _data(n, model)
        history = model.fit(x, y, batch_size=batch_size, epochs=2, verbose=0,
                            shuffle=False).history
        # Equal components (all-reduced updates): copied off. (A batch normalization's
        # moving statistics are each component's own, as each replica's under
        # MirroredStrategy.)
        weights = [v.numpy() for v in model.trainable_weights]
    return history, weights, model


@pytest.fixture(scope="module")
def strategy():
    return mirrored_strategy()  # one per process (collective keys)


@pytest.mark.parametrize("make,n,batch_size,optimizer", [
    # (MirroredStrategy's own fit fails on a first batch that splits unevenly: Keras
    # reduces it over the replicas to build the model, and AddN gets two shapes.)
    (_dense, 15, 10, keras.optimizers.Adam),  # batches 10 (5 + 5), 5 (3 + 2)
    pytest.param(_dense, 11, 4, keras.optimizers.Adam, marks=pytest.mark.slow),  # a partial last batch of 3: 2 + 1
    pytest.param(_dense, 9, 4, keras.optimizers.Adam, marks=pytest.mark.slow),  # a last batch of 1: 1 + 0 (one empty)
    # Batch statistics per component: a last batch of 3 + 2.
    pytest.param(_conv_batch_norm, 15, 10, keras.optimizers.Adam, marks=pytest.mark.slow),
    # A sparse (IndexedSlices) gradient: a last batch of 2 + 1. Adam's sparse update
    # sees each component's rows (duplicates kept), as after MirroredStrategy's gather.
    pytest.param(_embedding, 9, 6, keras.optimizers.Adam, marks=pytest.mark.slow),
])
def test_eager_fit_with_uneven_splits_matches_mirrored_strategy(
        strategy, make, n, batch_size, optimizer):
    # MirroredStrategy's own eager step gives NaN for an empty replica (1 + 0); its
    # compiled step, which the compiled data-parallel fit matches, does not.
    want, want_w, _ = _train(make, n, batch_size, strategy.scope(),
                             run_eagerly=n % batch_size != 1, optimizer=optimizer)
    parallel = oh.ParallelHandler(DEVICES)
    got, got_w, model = _train(make, n, batch_size, parallel, optimizer=optimizer)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(got[key], want[key], rtol=2e-6, err_msg=key)
    for g, w in zip(got_w, want_w):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    for v in model.trainable_weights:  # one buffer per device, equal after each step
        parts = parallel.unpack(tf.convert_to_tensor(v))
        np.testing.assert_array_equal(parts[0].numpy(), parts[1].numpy())


def test_eager_and_compiled_fit_agree_on_a_first_batch_split_unevenly():
    """A first batch of 5 (3 + 2), which MirroredStrategy's own fit cannot take."""
    eager, eager_w, _ = _train(_dense, 7, 5, oh.ParallelHandler(DEVICES), run_eagerly=True)
    compiled, compiled_w, _ = _train(_dense, 7, 5, oh.ParallelHandler(DEVICES),
                                     run_eagerly=False)
    np.testing.assert_allclose(eager["loss"], compiled["loss"], rtol=2e-6)
    for e, c in zip(eager_w, compiled_w):
        np.testing.assert_allclose(e, c, rtol=1e-5, atol=1e-6)


class OwnStep(keras.Sequential):
    """A train_step of the user's own, recording on TensorFlow's tape."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x, y, self(x, training=True))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables),
                                           self.trainable_variables))
        return {"loss": loss}


def test_own_eager_train_step_with_tf_tape_and_uneven_split_is_a_clear_error():
    """Only Keras's own train_step is recorded on oh.GradientTape: a user's tf.GradientTape
    cannot record components of different lengths, and says what to do, before anything
    is written."""
    def make():
        return OwnStep([keras.Input((4,)), keras.layers.Dense(1)])

    parallel = oh.ParallelHandler(DEVICES)
    keras.utils.set_random_seed(0)
    with parallel:
        model = make()
        model.compile(keras.optimizers.SGD(0.1), "mse", run_eagerly=True)
        x, y = _data(5, model)
        before = [w.copy() for w in model.get_weights()]
        with pytest.raises(ValueError, match=r"has no single length.*tf\.GradientTape.*"
                                             r"oh\.GradientTape"):
            model.fit(x, y, batch_size=5, epochs=1, verbose=0)
        for b, w in zip(before, model.get_weights()):
            np.testing.assert_array_equal(b, w)
        assert int(model.optimizer.iterations.numpy()) == 0


# (12, batches of 6 (3 + 3), is slow: the time budget of make test; 9: a last batch 2 + 1)
@pytest.mark.parametrize("n", [pytest.param(12, marks=pytest.mark.slow), 9])
def test_compiled_fit_with_sparse_gradients_matches_mirrored_strategy(strategy, n):
    """An embedding's gradient (tf.IndexedSlices) all-reduced as MirroredStrategy does it:
    the components' rows gathered, not summed dense (Adam's sparse update differs)."""
    want, want_w, _ = _train(_embedding, n, 6, strategy.scope(), run_eagerly=False)
    got, got_w, _ = _train(_embedding, n, 6, oh.ParallelHandler(DEVICES), run_eagerly=False)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(got[key], want[key], rtol=2e-6, err_msg=key)
    for g, w in zip(got_w, want_w):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
