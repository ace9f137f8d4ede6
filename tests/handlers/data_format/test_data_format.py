"""oh.DataFormat: channels-first models on the CPU equal their channels-last twins.

Every comparison runs the channels-first program under `oh.DataFormat()` and the same
program written channels-last (same weights) in plain TensorFlow, on the same inputs;
TensorFlow itself refuses the channels-first program on the CPU (checked, so these tests
can fail).
"""
import os
import tempfile

import numpy as np
import pytest
import tensorflow as tf
import keras

import tf_ophandlers as oh
from layout_probe import refused_on_cpu, skip_unless_refused

TOL = 1e-4
TO_NHWC, TO_NCHW = [0, 2, 3, 1], [0, 3, 1, 2]


def close(a, b, tol=TOL):
    """`a` equals `b` to `tol`, relative to the largest magnitude of `b`."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = max(1.0, float(np.abs(b).max())) if b.size else 1.0
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * scale)


def all_close(xs, ys, tol=TOL):
    assert len(xs) == len(ys)
    scale = max([1.0] + [float(np.abs(np.asarray(y)).max()) for y in ys])
    for x, y in zip(xs, ys):
        assert x is not None and y is not None
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol * scale)


def transposes(log):
    return log.op_types_seen().count("Transpose")


# -- the Keras CNN of the issue and its channels-last twin --------------------------------

def build(data_format, seed=0):
    keras.utils.set_random_seed(seed)
    cf = data_format == "channels_first"
    inp = keras.Input((3, 20, 20) if cf else (20, 20, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", data_format=data_format)(inp)
    h = keras.layers.BatchNormalization(axis=1 if cf else -1)(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.MaxPooling2D(2, data_format=data_format)(h)
    h = keras.layers.DepthwiseConv2D(3, padding="same", data_format=data_format)(h)
    h = keras.layers.Conv2D(16, 1, data_format=data_format)(h)  # 1x1
    h = keras.layers.GlobalAveragePooling2D(data_format=data_format)(h)
    return keras.Model(inp, keras.layers.Dense(4)(h))


def _weights(model):
    # Non-zero biases and BatchNormalization statistics, so that every weight matters.
    return [(np.random.RandomState(i).uniform(0.5, 1.5, w.shape) * (0.3 if w.ndim > 1 else 1))
            .astype("float32") for i, w in enumerate(model.get_weights())]


@pytest.fixture(scope="module")
def twins():
    cf, cl = build("channels_first"), build("channels_last")
    weights = _weights(cf)
    cf.set_weights(weights)
    cl.set_weights(weights)
    x = tf.random.stateless_normal([2, 3, 20, 20], seed=[1, 2])
    return cf, cl, weights, x


def _reference(cl, weights, x, training):
    cl.set_weights(weights)
    with tf.GradientTape() as tape:
        y = cl(tf.transpose(x, TO_NHWC), training=training)
        loss = tf.reduce_sum(y * y)
    return y, tape.gradient(loss, cl.trainable_variables)


def test_tensorflow_refuses_channels_first_on_cpu(twins):
    skip_unless_refused()  # oneDNN on: TensorFlow runs these itself
    cf, _, _, x = twins
    with pytest.raises(tf.errors.UnimplementedError, match="NHWC"):
        tf.nn.conv2d(x, tf.ones([3, 3, 3, 4]), 1, "SAME", data_format="NCHW")
    with pytest.raises(tf.errors.InvalidArgumentError, match="NHWC"):
        tf.nn.max_pool2d(x, 2, 2, "VALID", data_format="NCHW")
    with pytest.raises(Exception, match="NHWC"):
        cf(x)


@pytest.mark.parametrize("training", [False, True])
def test_keras_cnn_forward_equals_the_channels_last_twin(twins, training):
    cf, cl, weights, x = twins
    ref, _ = _reference(cl, weights, x, training)
    cf.set_weights(weights)
    log = oh.OpLogHandler()
    with log:
        with oh.DataFormat() as df:
            y = cf(x, training=training)
    close(y, ref)
    assert y.shape == (2, 4)
    assert "Conv2D" in log.op_types_seen() and "MaxPool" in log.op_types_seen()
    # The input is transposed once; every other op runs on channels-last data.
    assert transposes(log) <= 3
    assert transposes(log) == 1
    assert dict(df.fallbacks) == {}
    if training:  # BatchNormalization's moving statistics updated as by the twin
        all_close(cf.get_weights(), cl.get_weights())


def test_keras_cnn_ops_skip_tensorflows_python_fallback(twins):
    """Keras's channels-first layers pass tuples (`perm`, `shape`, `axis`) and Keras
    variables, which TensorFlow's C fast path refuses (its Python fallback captures the
    stack twice per op); under the handler every op of the call skips both."""
    import tf_ophandlers._C as _C  # pylint: disable=import-outside-toplevel
    from conftest import ops_left_to_tensorflow  # pylint: disable=import-outside-toplevel
    cf, cl, weights, x = twins
    ref, _ = _reference(cl, weights, x, False)
    cf.set_weights(weights)
    with oh.DataFormat():
        with ops_left_to_tensorflow() as seen:
            before = _C.skip_trace_stats()["taken"]
            y = cf(x, training=False)
            taken = _C.skip_trace_stats()["taken"] - before
    close(y, ref)
    assert seen == []
    assert taken >= 30  # (8 of them Transposes and Reshapes of tuples)


@pytest.mark.parametrize("tape_inside", [False, True], ids=["tape_outside", "tape_inside"])
def test_keras_cnn_gradients_equal_the_channels_last_twin(twins, tape_inside):
    cf, cl, weights, x = twins
    ref, ref_grads = _reference(cl, weights, x, True)
    cf.set_weights(weights)
    if tape_inside:
        with oh.DataFormat():
            with oh.GradientTape() as tape:
                loss = tf.reduce_sum(cf(x, training=True) ** 2)
            grads = tape.gradient(loss, cf.trainable_variables)
    else:
        with oh.GradientTape() as tape:
            with oh.DataFormat():
                y = cf(x, training=True)
            loss = tf.reduce_sum(y * y)  # on the handler's stack (y lives there)
        grads = tape.gradient(loss, cf.trainable_variables)
    close(loss, tf.reduce_sum(ref * ref))
    all_close([g.numpy() for g in grads], [g.numpy() for g in ref_grads])
    assert [g.shape for g in grads] == [v.shape for v in cf.trainable_variables]


def test_keras_cnn_training_step_with_tape_outside_matches(twins):
    """An optimizer step on the channels-first model under the handler trains as the
    channels-last twin does (two steps, losses and weights equal)."""
    cf, cl, weights, x = twins
    labels = tf.constant([0, 3])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    losses = {}
    for name, model, inp in (("cf", cf, x), ("cl", cl, tf.transpose(x, TO_NHWC))):
        model.set_weights(weights)
        opt = keras.optimizers.SGD(0.01)
        losses[name] = []
        for _ in range(2):
            with oh.GradientTape() as tape:
                with oh.DataFormat() if name == "cf" else oh.OpHandler():
                    loss = loss_fn(labels, model(inp, training=True))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
            losses[name].append(float(loss))
    np.testing.assert_allclose(losses["cf"], losses["cl"], rtol=TOL)
    all_close(cf.get_weights(), cl.get_weights())


def test_keras_cnn_in_a_tf_function_is_replayed_with_unknown_batch(twins):
    cf, cl, weights, x = twins
    cf.set_weights(weights)
    ref, _ = _reference(cl, weights, x, False)
    fn = tf.function(lambda t: cf(t), input_signature=[tf.TensorSpec([None, 3, 20, 20])])
    with refused_on_cpu(Exception, match="NHWC"):
        fn(x)  # TensorFlow alone fails on the CPU (without oneDNN)
    log = oh.OpLogHandler()
    with log:
        with oh.DataFormat():
            y = fn(x)
    close(y, ref)
    assert "Conv2D" in log.op_types_seen() and transposes(log) <= 3
    with oh.DataFormat():  # a partial last batch, and the replay cached
        close(fn(x[:1]), ref[:1])
        close(fn(x), ref)
    # Gradients through the replayed function, the tape outside the handler's scope.
    _, ref_grads = _reference(cl, weights, x, False)
    with oh.GradientTape() as tape:
        with oh.DataFormat():
            loss = tf.reduce_sum(fn(x) ** 2)
    all_close(tape.gradient(loss, cf.trainable_variables), ref_grads)
    with oh.DataFormat():  # the tape inside: TensorFlow's function gradient, replayed
        with oh.GradientTape() as tape:
            loss = tf.reduce_sum(fn(x) ** 2)
        grads = tape.gradient(loss, cf.trainable_variables)
    all_close(grads, ref_grads)


def test_saved_model_runs_under_the_handler(twins):
    cf, cl, weights, x = twins
    cf.set_weights(weights)
    ref, ref_grads = _reference(cl, weights, x, False)
    path = os.path.join(tempfile.mkdtemp(), "cf_model")
    cf.export(path, verbose=False)
    loaded = tf.saved_model.load(path)
    with refused_on_cpu(Exception, match="NHWC"):
        loaded.serve(x)
    log = oh.OpLogHandler()
    with log:
        with oh.DataFormat():
            y = loaded.serve(x)
    close(y, ref)
    assert transposes(log) <= 3
    with oh.DataFormat():
        close(loaded.serve(x[1:]), ref[1:])
    # Each loaded variable is one of the model's (same value): gradients per variable.
    variables = list(loaded.trainable_variables)
    index = [next(i for i, v in enumerate(cf.trainable_variables)
                  if v.shape == lv.shape and np.array_equal(v.numpy(), lv.numpy()))
             for lv in variables]
    assert sorted(index) == list(range(len(cf.trainable_variables)))
    with oh.GradientTape() as tape:
        with oh.DataFormat():
            loss = tf.reduce_sum(loaded.serve(x) ** 2)
    grads = tape.gradient(loss, variables)
    all_close([g.numpy() for g in grads], [ref_grads[i].numpy() for i in index])


def test_model_fit_with_a_partial_last_batch(twins):
    """`fit` under the handler (its train step replayed, the step's TensorFlow tape
    gradients converted) trains as the channels-last twin does."""
    cf, cl, weights, x = twins
    images = np.random.RandomState(0).normal(size=(10, 3, 20, 20)).astype("float32")
    labels = np.arange(10) % 4
    histories = {}
    for name, model, inp in (("cf", cf, images), ("cl", cl, images.transpose(0, 2, 3, 1))):
        model.set_weights(weights)
        model.compile(keras.optimizers.SGD(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        with oh.DataFormat() if name == "cf" else oh.OpHandler():
            histories[name] = model.fit(inp, labels, batch_size=4, epochs=2, verbose=0,
                                        shuffle=False).history["loss"]
    np.testing.assert_allclose(histories["cf"], histories["cl"], rtol=TOL)
    all_close(cf.get_weights(), cl.get_weights())


def test_conforms():
    report = oh.testing.check_handler(oh.DataFormat)
    assert report.failures == []
    assert len(report.checks) >= 14
