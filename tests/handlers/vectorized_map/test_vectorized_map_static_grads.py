"""oh.GradientTape's static-shape Add/AddV2/Sub/Mul/Sum gradients on oh.vectorized_map's stack
(handlers/gradient_tape/static_gradients.py): per-example gradients against
tf.GradientTape under tf.vectorized_map (values, dtypes, shapes) over broadcasting
patterns, and the ops they save (no Shape/BroadcastGradientArgs/Tile reach the map)."""
import collections

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.handlers.vectorized_map import handler as vm

B = 5
_rng = np.random.default_rng(3)
X = tf.constant(_rng.standard_normal((B, 1, 4)).astype(np.float32))
# Captured values of shapes that broadcast with an example [1, 4] differently.
CAPTURES = {shape: tf.Variable(_rng.standard_normal(shape).astype(np.float32))
            for shape in ((), (4,), (1, 4), (3, 1), (2, 1, 4), (1, 1))}


def _loss(x, v, op, order):
    a, b = (x, v) if order else (v, x)
    y = op(a, b)
    return tf.reduce_sum(tf.tanh(y) * tf.reduce_sum(x))


def _per_example(tape_cls, op, shape, order):
    v = CAPTURES[shape]

    def fn(x):
        with tape_cls() as t:
            t.watch(x)
            loss = _loss(x, v, op, order)
        return t.gradient(loss, [x, v])
    return fn


@pytest.mark.parametrize("shape", sorted(CAPTURES, key=len))
@pytest.mark.parametrize("op", [tf.add, tf.subtract, tf.multiply], ids=["add", "sub", "mul"])
@pytest.mark.parametrize("order", [True, False], ids=["x_first", "v_first"])
def test_broadcast_gradients_match_tensorflow(shape, op, order):
    got = oh.vectorized_map(_per_example(oh.GradientTape, op, shape, order), X)
    want = tf.vectorized_map(_per_example(tf.GradientTape, op, shape, order), X)
    for g, w in zip(got, want):
        assert isinstance(g, tf.Tensor) and isinstance(w, tf.Tensor)
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6, atol=1e-6)


def test_one_element_sum_and_skipped_input():
    """Sum of a [1, 1] per-example value; a scalar capture that is not a source (its
    gradient skipped, as TensorFlow's skip_input_indices)."""
    c = tf.constant(2.5)

    def fn(tape_cls):
        def f(x):
            with tape_cls() as t:
                t.watch(x)
                loss = tf.reduce_sum(tf.reduce_sum(x, axis=1, keepdims=True)[:, :1] + c)
            return t.gradient(loss, x)
        return f
    got = oh.vectorized_map(fn(oh.GradientTape), X)
    want = tf.vectorized_map(fn(tf.GradientTape), X)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)


def _op_types(monkeypatch, static):
    monkeypatch.setattr(vm.VectorizedMap, "static_shape_gradients", static)
    seen = collections.Counter()
    run = vm.VectorizedMap.execute

    def execute(self, op, inputs):
        seen[op.type] += 1
        return run(self, op, inputs)
    monkeypatch.setattr(vm.VectorizedMap, "execute", execute)
    oh.vectorized_map(_per_example(oh.GradientTape, tf.add, (4,), True), X)
    monkeypatch.undo()
    return seen


def test_static_gradients_run_fewer_ops(monkeypatch):
    static = _op_types(monkeypatch, True)
    dynamic = _op_types(monkeypatch, False)
    # TensorFlow's eager gradients ask for the shapes at run time; the static ones do not.
    assert dynamic["BroadcastGradientArgs"] >= 1
    assert static["BroadcastGradientArgs"] == 0
    assert sum(static.values()) < sum(dynamic.values())


@pytest.mark.parametrize("dtype", [tf.float64, tf.complex64])
@pytest.mark.parametrize("example,capture", [((0, 4), (4,)), ((1, 4), (2, 1, 1)),
                                             ((), (3, 1)), ((2, 1, 1), ())])
@pytest.mark.parametrize("op", [tf.add, tf.subtract, tf.multiply], ids=["add", "sub", "mul"])
def test_static_gradients_other_dtypes_and_zero_size(op, example, capture, dtype):
    """The rules' reductions where TensorFlow's eager gradients ask for shapes at run
    time: an empty example (a Sum over a size-0 axis), broadcasting on both sides or to
    a higher rank, complex (Mul's conj) and float64 values."""
    def values(shape):  # (complex with imaginary parts: conj matters)
        r = _rng.standard_normal(shape) + (1j * _rng.standard_normal(shape)
                                           if dtype.is_complex else 0)
        return tf.constant(r, dtype=dtype)
    xs, v = values((B,) + example), tf.Variable(values(capture))

    def fn(tape_cls):
        def f(x):
            with tape_cls() as t:
                t.watch(x)
                y = op(x, v) * 1.5 + op(v, x)
                loss = tf.reduce_sum(y * tf.reduce_sum(x))
            return t.gradient(loss, [x, v])
        return f
    got = oh.vectorized_map(fn(oh.GradientTape), xs)
    want = tf.vectorized_map(fn(tf.GradientTape), xs)
    for g, w in zip(got, want):
        assert isinstance(g, tf.Tensor) and g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6, atol=1e-6)
