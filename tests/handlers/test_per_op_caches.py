"""Per-signature caches of vectorized_map's batching rules and of Async (issue 17)."""
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
    assert part[1] == (1, 2)
    assert async_execution._outside_part(a) is part  # pylint: disable=protected-access
    # A float tensor carries no value: described directly (a constant made afresh for
    # every op would only churn the cache), the same description each time.
    f = tf.constant([[1.0, 2.0]])
    assert async_execution._outside_part(f) == (tf.float32, (1, 2), None)  # pylint: disable=protected-access
    # No entry describes f (an entry under f's id may remain from a dead tensor whose id
    # f reuses; its weak reference is then dead or another object).
    stale = async_execution._outside_parts.get(id(f))  # pylint: disable=protected-access
    assert stale is None or stale[0]() is not f
    # A dead tensor whose id a new tensor reuses: the weak reference tells them apart.
    b = tf.constant([1, 2, 3])
    dead = tf.constant(0.0)
    ref = weakref.ref(dead)
    del dead
    gc.collect()
    async_execution._outside_parts[id(b)] = (ref, part)  # pylint: disable=protected-access
    got = async_execution._outside_part(b)  # pylint: disable=protected-access
    assert got[0] == tf.int32 and got[1] == (3,)
    assert got[2] is not None  # a small integer tensor: its value is part of it


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
