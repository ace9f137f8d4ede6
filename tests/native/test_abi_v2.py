"""ABI version 2 of cc/include/tf_ophandlers/handler.h: the static_value hook
(tf.get_static_value of a C++ handler's tensors), and libraries of the version 1 header
still loading and working."""
import contextlib
import os

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from test_native_handlers import build_handler_library

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def types():
    path = build_handler_library(os.path.join(HERE, "static_value_handler.cc"))
    return oh.load_handler_library(path).handler_types()


def program(x, w):
    h = tf.tanh(tf.matmul(x, w)) + tf.sin(x[:, :3])
    return tf.reduce_sum(h * h, axis=1), tf.concat([h, tf.gather(h, [2, 0])], axis=0)


def inputs():
    return (tf.random.stateless_normal([3, 4], seed=[5, 6]),
            tf.random.stateless_normal([4, 3], seed=[7, 8]))


def assert_same(got, want):
    for g, t in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        assert g.dtype == t.dtype and g.shape == t.shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(t), rtol=1e-6, atol=1e-6)


def test_static_value_hook_answers_get_static_value(types):
    x, w = inputs()
    want = program(x, w)
    assert types["StaticValue"]._oh_hooks["static_value"]
    with types["StaticValue"]("resolve"):
        got = program(x, w)
        known = [tf.get_static_value(t) for t in got]
    assert all(oh.handler_of(t) is not None for t in got)
    assert_same(got, want)
    for k, t in zip(known, want):
        assert isinstance(k, np.ndarray) and k.dtype == t.dtype.as_numpy_dtype
        np.testing.assert_allclose(k, t.numpy(), rtol=1e-6)
    # The hook decides: "unknown" hides values a handler without the hook shows.
    with types["StaticValue"]("unknown"):
        hidden = program(x, w)[0]
        assert tf.get_static_value(hidden) is None
    with oh.native.PassThrough():
        shown = program(x, w)[0]
        np.testing.assert_allclose(tf.get_static_value(shown), want[0].numpy(), rtol=1e-6)


@pytest.mark.parametrize("mode", ["resolve", "unknown"])
def test_gradients_functions_and_keras_under_either_answer(types, mode):
    """TensorFlow's gradient functions consult tf.get_static_value (e.g. Sum's axes):
    whichever answer the hook gives, values and gradients are plain TensorFlow's, eagerly,
    in a fresh tf.function and through a Keras model."""
    x, w = inputs()
    model = tf.keras.Sequential([tf.keras.layers.Dense(4, activation="relu"),
                                 tf.keras.layers.Dense(2)])
    model(x)

    def run(scope):
        xv, wv = tf.Variable(x), tf.Variable(w)
        with scope:
            with tf.GradientTape() as tape:
                y = program(xv, wv)[0]
                loss = tf.reduce_sum(y) + tf.reduce_sum(model(xv))
            grads = tape.gradient(loss, [xv, wv] + model.trainable_variables)
            fn = tf.function(program)(x, w)
        return [loss] + grads + list(fn)

    assert_same(run(types["StaticValue"](mode)), run(contextlib.nullcontext()))


@pytest.mark.parametrize("mode, error, message", [
    ("fail", tf.errors.InvalidArgumentError,
     r"StaticValue\(\)\.static_value failed: StaticValue\(fail\) knows nothing"),
    ("bad_dtype", tf.errors.InvalidArgumentError,
     r"StaticValue\(\)\.static_value failed: it returned a tensor of dtype enum 3 for a "
     r"tensor of dtype enum 1"),
    ("no_tensor", tf.errors.InternalError,
     r"StaticValue\(\)\.static_value failed: the hook returned 1 \(known\) without a tensor"),
    ("bad_shape", oh.HandlerOutputError,
     r"StaticValue\(\)\.static_value returned a value of shape \(7,\) for a tensor of "
     r"shape \(3, 3\)"),
])
def test_static_value_errors_name_the_handler_and_hook(types, mode, error, message):
    x = tf.ones([3, 3])
    with types["StaticValue"](mode):
        y = tf.sin(x)
        with pytest.raises(error, match=message):
            tf.get_static_value(y)
        # The handler keeps working after its hook failed.
        np.testing.assert_allclose((y + 1.0).numpy(), (tf.sin(x) + 1.0).numpy())


def test_version_1_type_never_reads_the_version_2_field(types):
    """V1Layout registers abi_version 1 with a full-size struct whose static_value is
    garbage: the runtime reads only what version 1 defines, so the default answers."""
    v1 = types["V1Layout"]
    assert not v1._oh_hooks["static_value"]
    x, w = inputs()
    with v1():
        got = program(x, w)
        np.testing.assert_allclose(tf.get_static_value(got[0]), program(x, w)[0].numpy(),
                                   rtol=1e-6)
    assert_same(got, program(x, w))


def test_library_built_against_the_version_1_header_still_works():
    """tests/native/failing_handler.cc compiled against the frozen version 1 header
    (tests/native/abi_v1): it loads, forwards, fails with its message, and its tensors
    answer tf.get_static_value by default."""
    path = build_handler_library(os.path.join(HERE, "failing_handler.cc"),
                                 include_dirs=[os.path.join(HERE, "abi_v1")])
    types = oh.load_handler_library(path).handler_types()
    assert sorted(types) == ["FailOn", "HiddenDims", "NoCopyOff", "OldLayout"]
    assert not any(cls._oh_hooks["static_value"] for cls in types.values())
    x, w = inputs()
    with types["FailOn"]("Cos"):
        got = program(x, w)
        np.testing.assert_allclose(tf.get_static_value(got[0]), program(x, w)[0].numpy(),
                                   rtol=1e-6)
        with pytest.raises(tf.errors.InvalidArgumentError, match="FailOn refuses op Cos"):
            tf.cos(x)
    assert_same(got, program(x, w))
