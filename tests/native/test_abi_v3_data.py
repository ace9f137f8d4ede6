"""ABI version 3 handler-defined tensor state (tensor_set_data / tensor_data) and the
function_output hook: tests/native/lineage_handler.cc keeps each tensor's depth in the op
graph as its own data, next to the tensor of the next stack."""
import gc
import os

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from test_native_handlers import build_handler_library

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def Lineage():  # pylint: disable=invalid-name
    path = build_handler_library(os.path.join(HERE, "lineage_handler.cc"))
    return oh.load_handler_library(path).handler_types()["Lineage"]


def live(handler):
    return int(handler.query("live"))


def test_data_is_kept_per_tensor_and_read_back(Lineage):
    x = tf.random.stateless_normal([3, 4], seed=[4, 2])
    h = Lineage()
    with h:
        a = tf.cos(x)
        b = tf.sin(a)
        c = a * b + 1.0  # Mul (depth 3), then AddV2 (depth 4)
    assert "depth=1" in repr(a) and "depth=2" in repr(b) and "depth=4" in repr(c)
    d = c - x  # type-based dispatch: the op still reaches the handler with c's depth
    assert "depth=5" in repr(d)
    want = np.cos(x.numpy()) * np.sin(np.cos(x.numpy())) + 1.0 - x.numpy()
    np.testing.assert_allclose(d.numpy(), want, rtol=1e-5, atol=1e-6)
    assert d.dtype == tf.float32 and d.shape == [3, 4] and d.shape.rank == 2
    assert live(h) >= 4  # a, b, c, d (a * b is gone already)
    del a, b, c, d
    gc.collect()
    assert live(h) == 0  # every record deleted by the runtime's delete_data call


def test_data_crosses_a_replayed_function(Lineage):
    x = tf.random.stateless_normal([2, 3], seed=[7, 1])
    f = tf.function(lambda t: tf.sin(tf.cos(t)) * 2.0)
    h = Lineage()
    with h:
        a = tf.cos(x)  # depth 1, crosses in through its summary
        z = f(a)       # Cos 2, Sin 3, Mul 4, the body's output Identity 5; rebuilt outside
    assert "depth=5" in repr(z)
    np.testing.assert_allclose(z.numpy(), np.sin(np.cos(np.cos(x.numpy()))) * 2.0,
                               rtol=1e-5, atol=1e-6)
    del a, z
    gc.collect()
    assert live(h) == 0


def test_gradients_through_tensors_with_data(Lineage):
    x = tf.Variable(tf.random.stateless_normal([3], seed=[3, 3]))
    with tf.GradientTape() as want_tape:
        want = tf.reduce_sum(tf.sin(x) * x)
    with oh.GradientTape() as tape:
        with Lineage():
            y = tf.reduce_sum(tf.sin(x) * x)
    np.testing.assert_allclose(y.numpy(), want.numpy(), rtol=1e-6)
    np.testing.assert_allclose(tape.gradient(y, x).numpy(),
                               want_tape.gradient(want, x).numpy(), rtol=1e-6)
