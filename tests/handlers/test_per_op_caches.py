"""Per-signature caches of vectorized_map's batching rules and of Async."""
import gc
import weakref

import numpy as np
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.handlers import async_execution

from conftest import assert_close


def _per_example(x):
    # Rules that build constants (axes, permutations, shapes) and rewritten ops.
    y = tf.transpose(tf.reshape(x, [2, 3]), [1, 0])          # Reshape, Transpose
    y = tf.concat([y, tf.expand_dims(tf.reduce_sum(y, 1), 1)], axis=1)  # Sum, ExpandDims
    y = tf.squeeze(tf.stack([y, y * 2.0], axis=-1)[:, :2, :1])  # Pack, StridedSlice, Squeeze
    return tf.gather(y, [1, 0], axis=1) * tf.cast(tf.shape(y)[0], tf.float32)


def test_batching_rules_reuse_constants_and_ops_and_stay_correct():
    xs = tf.random.stateless_normal([5, 6], seed=[1, 2])
    expected = tf.stack([_per_example(xs[i]) for i in range(5)])
    assert_close(oh.vectorized_map(_per_example, xs), expected)
    sizes = {k: v for k, v in oh.caches().items()
             if k in ("vectorized_map.shape_constants", "vectorized_map.replaced_ops")}
    assert len(sizes) == 2
    for seed in range(3):  # the same signatures: nothing new is built
        xs = tf.random.stateless_normal([5, 6], seed=[seed, 7])
        got = oh.vectorized_map(_per_example, xs)
        assert_close(got, tf.stack([_per_example(xs[i]) for i in range(5)]))
        assert {k: oh.caches()[k] for k in sizes} == sizes
    # Another batch size and dtype: other constants, same correctness.
    xs = tf.cast(tf.random.stateless_normal([3, 6], seed=[4, 4]), tf.float64)
    got = oh.vectorized_map(lambda x: _per_example(tf.cast(x, tf.float32)), xs)
    assert got.shape == (3, 3, 2)
    assert_close(got, tf.stack([_per_example(tf.cast(xs[i], tf.float32)) for i in range(3)]))


def test_async_outside_parts_never_describe_another_tensor():
    a = tf.constant([[1, 2]])
    part = async_execution._outside_part(a)  # pylint: disable=protected-access
    assert part[0] == tf.int32.as_datatype_enum and part[1] == (1, 2)
    assert part[2] == ("<i4", np.array([[1, 2]], np.int32).tobytes(), (1, 2))  # its value
    assert async_execution._outside_part(a) is part  # pylint: disable=protected-access
    # A float tensor carries no value: described directly (a constant made afresh for
    # every op would only churn the cache), and never cached.
    f = tf.constant([[1.0, 2.0]])
    assert async_execution._outside_part(f) == (tf.float32.as_datatype_enum, (1, 2), None)  # pylint: disable=protected-access
    assert oh.tensor_key(f) not in async_execution._outside_parts  # pylint: disable=protected-access
    # The cache is keyed by TensorFlow handle and its entry holds the tensor, so a
    # handle freed and reused by a new tensor can never find a stale entry: every fresh
    # tensor (many allocated after dead ones) is described by its own value.
    for i in range(300):
        t = tf.constant([i, i + 1, 7])
        got = async_execution._outside_part(t)  # pylint: disable=protected-access
        assert got[1] == (3,) and got[2][1] == t.numpy().tobytes(), i
        del t
        if i % 50 == 0:
            gc.collect()


def test_async_small_integer_input_is_read_once_per_tensor(monkeypatch):
    # An axis tensor used by op after op: its value is read once (the C++ path hands
    # the hook a new Python object for it at every op; the cache keys the handle).
    reads = []
    known_value = async_execution.shapes.known_value
    monkeypatch.setattr(async_execution.shapes, "known_value",
                        lambda t: reads.append(1) or known_value(t))
    axis = tf.constant(1)
    x = tf.random.stateless_normal([3, 4], seed=[5, 6])
    with oh.Async():
        sums = [tf.reduce_sum(x * float(i), axis=axis) for i in range(5)]
        assert [s.shape for s in sums] == [(3,)] * 5  # inferred with the axis' value
    assert len(reads) == 1
    for i, s in enumerate(sums):
        assert_close(s, tf.reduce_sum(x * float(i), axis=1))


def test_async_chain_with_constants_matches_eager_across_shapes():
    runner = oh.Async()
    for shape in ([2, 3], [3, 2], [2, 3]):
        x = tf.random.stateless_normal(shape, seed=[len(shape), shape[0]])
        with runner:
            h = x
            for _ in range(5):
                h = tf.tanh(h) * 1.01 + tf.reduce_sum(h, axis=0)
            got = h.numpy()
        h = x
        for _ in range(5):
            h = tf.tanh(h) * 1.01 + tf.reduce_sum(h, axis=0)
        np.testing.assert_allclose(got, h.numpy(), rtol=1e-6)


def test_async_signatures_tell_dtypes_broadcasts_and_attributes_apart():
    # Mul/AddV2 are keyed without attribute bytes (their only attribute is the dtype of
    # their inputs); Sum and Cast keep theirs. Every inferred shape and dtype is eager's.
    def program(a, b, i):
        return [a * b, b * a, a * 2.0, tf.cast(a, tf.float64) * 2.0, i * i, i + 1,
                tf.reduce_sum(a, axis=1), tf.reduce_sum(a, axis=1, keepdims=True),
                tf.cast(i, tf.float16), tf.cast(i, tf.int64) + 1]

    a = tf.random.stateless_normal([3, 4], seed=[1, 1])
    b = tf.random.stateless_normal([1, 4], seed=[2, 2])
    i = tf.constant([[1, 2, 3, 4]] * 3)
    want = program(a, b, i)
    with oh.Async():
        got = program(a, b, i)
        shapes = [(t.shape, t.dtype) for t in got]  # read inside the scope
    assert shapes == [(t.shape, t.dtype) for t in want]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.numpy(), w.numpy())


def test_async_op_kinds_key_attributes_only_where_inputs_do_not_imply_them():
    kind = async_execution._op_kind  # pylint: disable=protected-access
    implied, attrs = async_execution._IMPLIED, async_execution._ATTRS  # pylint: disable=protected-access
    for op_type in ("Tanh", "Mul", "AddV2", "ConcatV2", "AddN", "IdentityN"):
        assert kind(op_type) == implied, op_type  # T, N, Tidx: the inputs' dtypes/count
    assert kind("Transpose") == implied  # T and Tperm: its inputs' dtypes
    for op_type in ("Sum", "Cast", "Pack", "MatMul"):  # keep_dims, DstT, axis, transpose_a
        assert kind(op_type) == attrs, op_type
    assert kind("__inference_f_1") == async_execution._FUNCTION  # pylint: disable=protected-access
    assert kind("EagerPyFunc") == async_execution._RUNS_PYTHON  # pylint: disable=protected-access
