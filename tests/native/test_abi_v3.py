"""ABI version 3 of cc/include/tf_ophandlers/handler.h: ops a C++ handler builds and runs
on the next stack (op_new, op_set_attr_*, execute_next), the function_cache_key hook, and
libraries of the version 2 header still loading and working.

tests/native/fake_quant_handler.cc fake-quantizes the float inputs of MatMul and Conv2D
with ops it emits (Const, Mul, Round, Sub, StopGradient, AddV2); each test compares with
the same computation written in plain TensorFlow."""
import os

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from test_native_handlers import build_handler_library

HERE = os.path.dirname(os.path.abspath(__file__))
SCALE = 4.0


@pytest.fixture(scope="module")
def FakeQuant():  # pylint: disable=invalid-name
    path = build_handler_library(os.path.join(HERE, "fake_quant_handler.cc"))
    return oh.load_handler_library(path).handler_types()["FakeQuant"]


def quant(x, scale=SCALE):
    """The handler's fake quantization in plain TensorFlow (straight-through gradient)."""
    return x + tf.stop_gradient(tf.round(x * scale) * (1.0 / scale) - x)


def program(x, w, q=lambda t: t):
    h = tf.tanh(tf.matmul(q(x), q(w))) + tf.sin(x[:, :3])
    return tf.reduce_sum(h * h, axis=1), tf.concat([h, tf.gather(h, [2, 0])], axis=0)


def inputs():
    return (tf.random.stateless_normal([3, 4], seed=[1, 6]),
            tf.random.stateless_normal([4, 3], seed=[2, 8]))


def assert_same(got, want):
    for g, t in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        assert g.dtype == t.dtype and g.shape == t.shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(t), rtol=1e-6, atol=1e-6)


def test_emitted_ops_give_plain_tensorflow_values(FakeQuant):
    x, w = inputs()
    want = program(x, w, quant)
    with FakeQuant(str(SCALE)):
        got = program(x, w)
    assert_same(got, want)
    # Quantization changed the result (the test can fail).
    assert not np.allclose(got[0].numpy(), program(x, w)[0].numpy(), atol=1e-4)


def _grads(tape_cls, handler, q):
    x, w = (tf.Variable(v) for v in inputs())
    with tape_cls() as tape:
        with handler:
            y = program(x, w, q)[0]
            loss = tf.reduce_sum(y * y)
    return [loss] + tape.gradient(loss, [x, w])


def test_gradients_under_oh_gradient_tape(FakeQuant):
    """The tape below the handler records the emitted ops: the straight-through gradient
    TensorFlow gives for the same ops."""
    import contextlib
    want = _grads(tf.GradientTape, contextlib.nullcontext(), quant)
    got = _grads(oh.GradientTape, FakeQuant(str(SCALE)), lambda t: t)
    assert_same(got, want)
    plain = _grads(tf.GradientTape, contextlib.nullcontext(), lambda t: t)
    assert not np.allclose(got[2].numpy(), plain[2].numpy(), atol=1e-4)


def test_replayed_function_and_shared_replays(FakeQuant):
    """A fresh tf.function replayed under the handler emits the ops symbolically; the
    function_cache_key hook (the config) lets a new handler of the same config reuse the
    replay, while another config replays again."""
    x, w = inputs()
    f = tf.function(program)
    from tf_ophandlers.core.functions import call as function_calls
    # Counted by entries, so start empty: the cache is bounded (512) and earlier tests in
    # the process may have filled it, when a new replay evicts one and the count stays.
    function_calls.clear_cache()
    replays = lambda: oh.caches()["functions.replays"][0]  # noqa: E731
    with FakeQuant(str(SCALE)):
        got = f(x, w)
    assert_same(got, program(x, w, quant))
    n = replays()
    with FakeQuant(str(SCALE)):
        again = f(x, w)
    assert_same(again, got)
    assert replays() == n
    with FakeQuant("2"):
        other = f(x, w)
    assert_same(other, program(x, w, lambda t: quant(t, 2.0)))
    assert replays() == n + 1
    assert FakeQuant(str(SCALE)).function_cache_key() == FakeQuant(str(SCALE)).function_cache_key()


def test_keras_model(FakeQuant):
    tf.keras.utils.set_random_seed(3)
    model = tf.keras.Sequential([tf.keras.Input([4]), tf.keras.layers.Dense(5, activation="relu"),
                                 tf.keras.layers.Dense(2)])
    x = inputs()[0]
    (k1, b1), (k2, b2) = [(layer.kernel, layer.bias) for layer in model.layers]
    want = tf.matmul(quant(tf.nn.relu(tf.matmul(quant(x), quant(k1)) + b1)), quant(k2)) + b2
    with FakeQuant(str(SCALE)):
        eager = model(x)
        traced = tf.function(model)(x)
    assert_same(eager, want)
    assert_same(traced, want)


@pytest.mark.parametrize("config, error, message", [
    ("16;no_type_attr", tf.errors.InvalidArgumentError,
     r"FakeQuant\(16;no_type_attr\)\.execute failed for op MatMul: .*the outputs of the "
     r"built op Round are not known"),
    ("16;unknown_op", tf.errors.InvalidArgumentError,
     r"execute failed for op MatMul: .*unknown op type NoSuchOpForFakeQuant"),
])
def test_errors_reach_python_with_their_message(FakeQuant, config, error, message):
    x, w = inputs()
    with FakeQuant(config):
        with pytest.raises(error, match=message):
            tf.matmul(x, w)
        # The handler keeps working for the ops it does not touch.
        np.testing.assert_allclose(tf.sin(x).numpy(), np.sin(x.numpy()), rtol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="FakeQuant needs a positive scale, got 'abc'"):
        FakeQuant("abc")


def test_library_built_against_the_version_2_header_still_works():
    """tests/native/static_value_handler.cc compiled against the frozen version 2 header
    (tests/native/abi_v2): it loads, forwards, and its static_value hook answers; the
    version 3 hook reads as absent."""
    path = build_handler_library(os.path.join(HERE, "static_value_handler.cc"),
                                 include_dirs=[os.path.join(HERE, "abi_v2")])
    types = oh.load_handler_library(path).handler_types()
    cls = types["StaticValue"]
    assert cls._oh_hooks["static_value"] and not cls._oh_hooks["function_cache_key"]
    x, w = inputs()
    with cls("resolve"):
        got = program(x, w)
        known = tf.get_static_value(got[0])
    assert_same(got, program(x, w))
    np.testing.assert_allclose(known, program(x, w)[0].numpy(), rtol=1e-6)
