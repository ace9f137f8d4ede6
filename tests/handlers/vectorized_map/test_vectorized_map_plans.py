"""oh.vectorized_map's per-signature plans against tf.vectorized_map: random op
programs from a seeded generator (every plan: forwarding, rank alignment, unbatched ops,
rules; several dtypes), run twice so that the second run takes the cached plans, eagerly
and with the mapped function a fresh tf.function (replayed, no plans); per-example
gradients under oh.GradientTape against tf.GradientTape under tf.vectorized_map; a Keras
model's per-example gradients with a partial batch; the plan cache is bounded."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.core.cache import caches
from tf_ophandlers.handlers.vectorized_map import handler as vm
from conftest import assert_close

# Per-example shapes of every value a program makes: all broadcast with each other.
_CAPTURE_SHAPES = ((), (3,), (1, 3), (4, 3), (2, 4, 3))
_OPS = ("unary", "binary", "capture_binary", "reduce", "expand", "matmul", "bias_add",
        "softmax", "relu_grad", "int_roundtrip", "where", "unbatched", "reshape")


def _program(seed, length=14):
    """A random program: (op kind, operand choices) steps, interpreted by `_run`."""
    rng = np.random.default_rng(seed)
    return [(_OPS[rng.integers(len(_OPS))], tuple(int(v) for v in rng.integers(0, 1000, 3)))
            for _ in range(length)]


def _captures(seed):
    rng = np.random.default_rng(1000 + seed)
    caps = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in _CAPTURE_SHAPES]
    matrix = tf.constant(rng.standard_normal((3, 3)).astype(np.float32) / 2)
    return caps, matrix


def _run(program, x, caps, matrix):
    """Interprets `program` on the per-example value `x` (shape [4, 3]); returns the last
    values made (several shapes and dtypes)."""
    values = [x]
    unary = (tf.tanh, tf.sin, tf.nn.relu, tf.square, tf.negative, tf.sigmoid, tf.abs)
    binary = (tf.add, tf.multiply, tf.subtract, tf.maximum, tf.math.squared_difference)
    for kind, (a, b, c) in program:
        v = values[a % len(values)]
        w = values[b % len(values)]
        rank = v.shape.rank
        if kind == "unary":
            out = unary[c % len(unary)](v)
        elif kind == "binary":
            out = binary[c % len(binary)](v, w)
        elif kind == "capture_binary":
            out = binary[c % len(binary)](caps[b % len(caps)], v)
        elif kind == "reduce" and rank >= 1:
            out = (tf.reduce_sum, tf.reduce_max, tf.reduce_mean)[c % 3](v, axis=0)
        elif kind == "expand" and rank < 2:
            out = tf.expand_dims(v, 0)
        elif kind == "matmul" and rank >= 2:
            out = tf.matmul(v, matrix, transpose_b=bool(c % 2))
        elif kind == "bias_add" and rank >= 2:
            out = tf.nn.bias_add(v, caps[1])
        elif kind == "softmax" and rank >= 1:
            out = tf.nn.softmax(v)
        elif kind == "relu_grad":
            out = tf.raw_ops.ReluGrad(gradients=tf.cos(v), features=v)
        elif kind == "int_roundtrip":
            out = tf.cast(tf.cast(v * 4., tf.int32) + tf.constant(c % 5), tf.float32)
        elif kind == "where":
            out = tf.where(v > 0., v, w * 0.5)
        elif kind == "unbatched":  # only captured inputs: the op runs once, unbatched
            out = tf.tanh(caps[c % len(caps)]) * 2. + caps[b % len(caps)]
        elif kind == "reshape" and v.shape.as_list() in ([3], [1, 3]):
            out = tf.reshape(v, [1, 3] if rank == 1 else [3])
        else:
            out = tf.exp(-tf.abs(v))
        values.append(out)
    return values[-4:]


def _elems(seed, size):
    rng = np.random.default_rng(2000 + seed)
    return tf.constant(rng.standard_normal((size, 4, 3)).astype(np.float32))


def _assert_same(got, ref, tol=1e-5):
    got, ref = tf.nest.flatten(got), tf.nest.flatten(ref)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape, (g, r)
        assert_close(g, r, tol)


@pytest.mark.parametrize("seed", range(8))
def test_random_programs_match_tf_vectorized_map(seed):
    program = _program(seed)
    caps, matrix = _captures(seed)
    fn = lambda e: _run(program, e, caps, matrix)  # noqa: E731
    x = _elems(seed, 6)
    ref = tf.vectorized_map(fn, x)
    first = oh.vectorized_map(fn, x)  # decides the plans of new signatures
    again = oh.vectorized_map(fn, x)  # takes the cached plans
    _assert_same(first, ref)
    _assert_same(again, ref)
    partial = x[:5]  # a partial last batch: the same signatures, another size
    _assert_same(oh.vectorized_map(fn, partial), tf.vectorized_map(fn, partial))


@pytest.mark.parametrize("seed", range(3))
def test_random_programs_in_a_fresh_tf_function(seed):
    program = _program(seed)
    caps, matrix = _captures(seed)
    fn = lambda e: _run(program, e, caps, matrix)  # noqa: E731
    x = _elems(seed, 5)
    ref = tf.vectorized_map(fn, x)
    oh.vectorized_map(fn, x)  # plans cached eagerly first
    # A fresh tf.function as the mapped function (replayed through the handler with
    # symbolic tensors, which take the generic path) and around the call.
    _assert_same(oh.vectorized_map(tf.function(fn), x), ref)
    _assert_same(tf.function(lambda: oh.vectorized_map(fn, x))(), ref)


@pytest.mark.parametrize("seed", range(5))
def test_random_programs_per_example_gradients(seed):
    program = _program(seed)
    caps, matrix = _captures(seed)
    v = tf.Variable(matrix)

    def per_example(tape_type):
        def fn(e):
            with tape_type() as tape:
                tape.watch(e)
                outs = _run(program, e, caps, v)
                loss = tf.add_n([tf.reduce_sum(o * 0.5) for o in outs
                                 if o.dtype == tf.float32])
            return tape.gradient(loss, [e, v])
        return fn

    x = _elems(seed, 6)
    ref = tf.vectorized_map(per_example(tf.GradientTape), x)
    for _ in range(2):  # the second run takes the cached plans
        got = oh.vectorized_map(per_example(oh.GradientTape), x)
        for g, r in zip(got, ref):
            if r is None:
                assert g is None
                continue
            assert isinstance(g, tf.IndexedSlices) == isinstance(r, tf.IndexedSlices)
            _assert_same(tf.convert_to_tensor(g), tf.convert_to_tensor(r), 1e-4)


def test_per_example_gradients_of_a_keras_model_partial_batch():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4, 3)), keras.layers.Flatten(),
                              keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3), keras.layers.Softmax()])
    labels = tf.constant([0, 2, 1, 1, 0, 2, 2])

    def per_example(tape_type):
        def fn(args):
            e, y = args
            with tape_type() as tape:
                p = model(e[None])
                loss = keras.losses.sparse_categorical_crossentropy(y[None], p)[0]
            return tape.gradient(loss, model.trainable_variables)
        return fn

    for size in (7, 5):  # a full batch, then a partial last batch
        x, y = _elems(7, size), labels[:size]
        ref = tf.vectorized_map(per_example(tf.GradientTape), (x, y))
        got = oh.vectorized_map(per_example(oh.GradientTape), (x, y))
        _assert_same(got, ref, 1e-5)
        fresh = tf.function(lambda: oh.vectorized_map(per_example(oh.GradientTape), (x, y)))
        _assert_same(fresh(), ref, 1e-5)


def test_plans_follow_the_signature():
    """One op type with inputs batched or not, and ranks that need alignment or not,
    takes one plan per signature (every result matches the loop)."""
    c1, c2 = tf.constant([1., 2., 3.]), tf.constant([[1.], [2.]])
    fns = (lambda e: e + c1, lambda e: c1 + c1 + e, lambda e: e[0] + e,
           lambda e: e + c2, lambda e: tf.reduce_sum(e) + e)
    x = _elems(9, 4)[:, :2]
    for fn in fns:
        for _ in range(2):
            got = oh.vectorized_map(fn, x)
            _assert_same(got, tf.stack([fn(x[i]) for i in range(4)]))
    keys = [k for k in vm._plans if k[0] == "AddV2"]  # pylint: disable=protected-access
    assert len({k[2] for k in keys}) >= 4  # several signatures, several entries


def test_plan_cache_is_bounded_and_listed():
    plans = vm._plans  # pylint: disable=protected-access
    entries, maxsize = caches()["vectorized_map.plans"]
    assert entries == len(plans) and maxsize == plans.maxsize >= 1024
    fn = lambda e: tf.tanh(e) * 2.  # noqa: E731
    oh.vectorized_map(fn, _elems(10, 3))
    size = len(plans)
    oh.vectorized_map(fn, _elems(10, 3))  # the same signatures: no new entry
    assert len(plans) == size


def test_rules_with_unknown_per_example_rank_match_tensorflow():
    """An op without a batching rule (a variable's ResourceGather) runs once per example
    in a while loop whose output has an unknown rank when a called tf.function is
    replayed: the rules after it that shift axes or permutations (transpose, concat,
    pack, gather, expand_dims, squeeze, batch matmul) must fall back or use what is
    known, not fail on the rank (fuzz finding: Transpose raised TypeError on None)."""
    table = tf.Variable(tf.random.stateless_normal((6, 2, 2), seed=(5, 6)))

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32)])
    def per_example(ids):
        t = tf.gather(table, ids)[0]  # ResourceGather: no rule, a while loop
        a = tf.transpose(t, [1, 0])
        b = tf.concat([a, a], axis=-1)
        c = tf.stack([b, b], axis=-1)
        d = tf.gather(b, [1, 0], axis=-1)
        e = tf.squeeze(tf.expand_dims(d, -1), -1)
        f = tf.linalg.matmul(e, e, transpose_b=True)
        return tf.reduce_sum(c) + f

    for batch in (4, 1):  # a partial last batch
        ids = tf.constant([[i % 6, (i + 2) % 6] for i in range(batch)], tf.int32)
        assert_close(oh.vectorized_map(per_example, ids), tf.vectorized_map(per_example, ids))


def test_strided_slices_seen_before_match_tensorflow():
    """The StridedSlice rule keeps its rewritten op and constants per (attributes, begin,
    end, strides): slices that share their attributes but not their bounds,
    strides or index dtype, each taken twice (the second from the cache), eagerly and in a
    replayed tf.function (no cache: its constants belong to the graph), match
    tf.vectorized_map; the cache is bounded."""
    rng = np.random.default_rng(7)
    x = tf.constant(rng.standard_normal((5, 6, 4)).astype(np.float32))

    def fn(e):
        parts = [e[None], e[1:3], e[0:2], e[::2], e[::3], e[..., 0], e[None, :, 1],
                 e[-2:, 1:], e[1], tf.strided_slice(e, tf.constant([1, 0], tf.int64),
                                                    tf.constant([3, 4], tf.int64))]
        return [tf.reduce_sum(p * p, axis=0) for p in parts]

    want = tf.vectorized_map(fn, x)
    for _ in range(2):
        for got, expected in zip(oh.vectorized_map(fn, x), want):
            assert got.dtype == expected.dtype
            assert_close(got, expected)
    replayed = tf.function(fn)
    for _ in range(2):
        for got, expected in zip(oh.vectorized_map(replayed, x), want):
            assert_close(got, expected)
    entries, maxsize = caches()["vectorized_map.strided_slices"]
    assert 0 < entries <= maxsize
