"""OhMoveAxis (cc/handlers/data_format/move_axis.cc, core/move_axis.py) against tf.transpose: values, shapes,
dtypes, gradients, unknown dims; and where oh.DataFormat uses it (only the replay cache's
own functions, never a graph users may export)."""
import os
import tempfile

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.core import move_axis

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.uint8, tf.int16,
          tf.uint16, tf.int32, tf.uint32, tf.int64, tf.uint64, tf.bool, tf.complex64,
          tf.complex128]


def perm_of(rank, to_last):
    return ([0] + list(range(2, rank)) + [1] if to_last
            else [0, rank - 1] + list(range(1, rank - 1)))


def sample(shape, dtype):
    v = np.random.RandomState(len(shape)).uniform(-50, 50, shape)
    if dtype.is_complex:
        v = v + 1j * v[::-1]
    if dtype == tf.bool:
        return tf.constant(v > 0)
    if dtype.is_unsigned:
        v = np.abs(v)
    return tf.cast(tf.constant(v), dtype)


def same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    np.testing.assert_array_equal(tf.cast(a, tf.float64).numpy() if a.dtype == tf.bfloat16
                                  else a.numpy(),
                                  tf.cast(b, tf.float64).numpy() if b.dtype == tf.bfloat16
                                  else b.numpy())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (2, 3, 4, 5, 6), (3, 40, 37, 5)])
@pytest.mark.parametrize("to_last", [True, False])
def test_equals_tf_transpose(dtype, shape, to_last):
    x = sample(shape, dtype)
    same(move_axis.move_axis(x, to_last), tf.transpose(x, perm_of(len(shape), to_last)))


@pytest.mark.parametrize("shape", [(16, 3, 56, 56), (2, 70, 90, 33), (4, 2, 3, 1), (0, 3, 4, 4),
                                   (2, 3, 0, 4), (5, 7, 9)])
@pytest.mark.parametrize("to_last", [True, False])
def test_every_kernel_path(shape, to_last):
    # A few channels, a few pixels, tiles with remainders, zero sizes, rank 3, and inputs
    # above the 1 MiB sharding threshold.
    x = sample(shape, tf.float32)
    same(move_axis.move_axis(x, to_last), tf.transpose(x, perm_of(len(shape), to_last)))


@pytest.mark.parametrize("pixels", range(1, 10))
@pytest.mark.parametrize("dtype", [tf.float32, tf.int32, tf.uint32])
def test_three_channel_moves_keep_every_bit(pixels, dtype):
    # The 3-channel move of 4-byte elements has its own kernel (four pixels per step and a
    # remainder): every remainder, and bit patterns that arithmetic would change (NaN
    # payloads, signalling NaNs, negative zero, denormals).
    bits = np.random.RandomState(pixels).randint(0, 2**32, size=(2, 3, 1, pixels),
                                                 dtype=np.uint64).astype(np.uint32)
    bits.flat[:4] = [0x7FC00001, 0x7F800001, 0x80000000, 0x00000001][:bits.size][:4]
    x = tf.bitcast(tf.constant(bits), dtype)
    got = tf.bitcast(move_axis.move_axis(x, True), tf.uint32).numpy()
    np.testing.assert_array_equal(got, np.transpose(bits, (0, 2, 3, 1)))


@pytest.mark.parametrize("rank", [3, 4, 5])
@pytest.mark.parametrize("to_last", [True, False])
def test_gradient_equals_tf_transpose(rank, to_last):
    shape = (2, 3, 4, 5, 6)[:rank]
    x = sample(shape, tf.float64)
    w = sample([shape[k] for k in perm_of(rank, to_last)], tf.float64)

    def grads(move):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(tf.sin(move(x)) * w)
        return tape.gradient(y, x)

    g = grads(lambda t: move_axis.move_axis(t, to_last))
    same(g, grads(lambda t: tf.transpose(t, perm_of(rank, to_last))))
    same(tf.function(grads)(lambda t: move_axis.move_axis(t, to_last)), g)


@pytest.mark.parametrize("to_last", [True, False])
def test_unknown_dims_in_a_function(to_last):
    spec = tf.TensorSpec([None, 3, None, 5], tf.float32)
    f = tf.function(lambda t: move_axis.move_axis(t, to_last), input_signature=[spec])
    g = tf.function(lambda t: tf.transpose(t, perm_of(4, to_last)), input_signature=[spec])
    out_f = f.get_concrete_function().structured_outputs
    out_g = g.get_concrete_function().structured_outputs
    assert out_f.shape.as_list() == out_g.shape.as_list()
    for shape in [(2, 3, 4, 5), (1, 3, 7, 5)]:
        x = sample(shape, tf.float32)
        same(f(x), g(x))


def test_bad_inputs_are_refused_with_the_op_named():
    with pytest.raises(Exception, match="OhMoveAxis|rank"):
        move_axis.move_axis(tf.zeros([2, 3]), True)
    with pytest.raises(Exception, match="OhMoveAxis"):
        move_axis.move_axis(tf.constant([[["a"]]]), True)
    assert move_axis.direction((0, 2, 3, 1), tf.string) is None
    assert move_axis.direction((0, 2, 1, 3), tf.float32) is None
    assert move_axis.direction((0, 2, 3, 1), tf.float32) is True
    assert move_axis.direction((0, 4, 1, 2, 3), tf.float32) is False


# -- where oh.DataFormat uses it --------------------------------------------------------

def _ops_of(concrete):
    types = {op.type for op in concrete.graph.get_operations()}
    for f in concrete.graph._functions.values():  # pylint: disable=protected-access
        types |= {n.op for n in f.definition.node_def}
    return types


def _cnn():
    k = tf.Variable(tf.random.stateless_normal([3, 3, 3, 4], seed=[3, 4]))

    def model(x):  # channels-first, as an exported GPU model would be
        y = tf.nn.conv2d(x, k, 1, "SAME", data_format="NCHW")
        return tf.reduce_mean(tf.nn.relu(y), axis=[2, 3])

    def twin(x):
        return tf.reduce_mean(tf.nn.relu(tf.nn.conv2d(x, k, 1, "SAME")), axis=[1, 2])
    return k, model, twin


def test_data_format_replay_uses_it_and_the_users_graph_does_not():
    from tf_ophandlers.core.functions import call as fcall
    k, model, twin = _cnn()
    fn = tf.function(model, input_signature=[tf.TensorSpec([None, 3, 9, 9])])
    x = tf.random.stateless_normal([2, 3, 9, 9], seed=[1, 2])
    ref = twin(tf.transpose(x, [0, 2, 3, 1]))
    fcall.clear_cache()
    with oh.DataFormat():
        y = fn(x)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(fn(x) ** 2)
        grad = tape.gradient(loss, k)
    np.testing.assert_allclose(y.numpy(), ref.numpy(), rtol=1e-5, atol=1e-5)
    with tf.GradientTape() as tape:
        ref_loss = tf.reduce_sum(twin(tf.transpose(x, [0, 2, 3, 1])) ** 2)
    np.testing.assert_allclose(grad.numpy(), tape.gradient(ref_loss, k).numpy(),
                               rtol=1e-4, atol=1e-4)
    cached = fcall._cache.values()  # pylint: disable=protected-access
    replays = [e.compiled.function for e in cached]
    assert replays and all("OhMoveAxis" in _ops_of(f) for f in replays)
    assert not any("Transpose" in _ops_of(f) for f in replays)
    # The user's function, traced under the handler, and a SavedModel of it afterwards
    # keep TensorFlow's own ops (loadable without this library).
    assert "OhMoveAxis" not in _ops_of(fn.get_concrete_function())
    module = tf.Module()
    module.k, module.fn = k, fn
    path = os.path.join(tempfile.mkdtemp(), "m")
    tf.saved_model.save(module, path)
    with open(os.path.join(path, "saved_model.pb"), "rb") as f:
        assert b"OhMoveAxis" not in f.read()


def test_a_handler_below_sees_tf_transpose():
    # Below DataFormat, another handler records the replay's ops: they stay TensorFlow's.
    from tf_ophandlers.core.functions import call as fcall
    _, model, twin = _cnn()
    fn = tf.function(model)
    x = tf.random.stateless_normal([2, 3, 9, 9], seed=[5, 6])
    fcall.clear_cache()
    log = oh.OpLogHandler()
    with log:
        with oh.DataFormat():
            y = fn(x)
    np.testing.assert_allclose(y.numpy(), twin(tf.transpose(x, [0, 2, 3, 1])).numpy(),
                               rtol=1e-5, atol=1e-5)
    seen = log.op_types_seen()
    assert "Transpose" in seen and "OhMoveAxis" not in seen


def test_unknown_rank_gives_an_unknown_static_shape():
    # final read: with an unknown input rank the shape function built a rank-2 shape.
    from tf_ophandlers.core import move_axis as _move_axis

    @tf.function(input_signature=[tf.TensorSpec(None, tf.float32)])
    def moved(x):
        y = _move_axis.move_axis(x, True)
        assert y.shape.rank is None, y.shape
        return y

    x = tf.random.stateless_normal([2, 3, 4, 5], seed=[1, 1])
    np.testing.assert_array_equal(moved(x).numpy(), tf.transpose(x, [0, 2, 3, 1]).numpy())
