"""oh.vectorized_map's elements and outputs against tf.vectorized_map / tf.map_fn: unit
leading dimensions broadcast, and variables returned by the mapped function."""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_same_tensors

RNG = np.random.default_rng(7)


def _rand(*shape):
    return tf.constant(RNG.standard_normal(shape).astype(np.float32))


def _affine(e):
    x, w, b = e
    return tf.tanh(tf.linalg.matvec(w, x) + b)


@pytest.mark.parametrize("as_function", [False, True], ids=["eager_fn", "tf_function_fn"])
@pytest.mark.parametrize("unit", [(1,), (2,), (1, 2)], ids=["w", "b", "w_and_b"])
def test_unit_leading_dimensions_broadcast_as_in_tf_vectorized_map(unit, as_function):
    """[1, ...] elements broadcast against [n, ...] ones: values, and the gradients of
    a tape outside with respect to every element (the unit ones sum over examples)."""
    shapes = [(5, 3), (5, 4, 3), (5, 4)]
    elems = [_rand(*((1,) + s[1:] if i in unit else s)) for i, s in enumerate(shapes)]
    fn = tf.function(_affine) if as_function else _affine

    def run(vmap, tape_type):
        with tape_type() as tape:
            tape.watch(elems)
            y = vmap(fn, tuple(elems))
            loss = tf.reduce_sum(y * y)
        return y, tape.gradient(loss, elems)

    # (Under a recording tf.GradientTape oh.vectorized_map is tf.vectorized_map, so the
    # map's own path is checked with no tape and under oh.GradientTape.)
    want = run(tf.vectorized_map, tf.GradientTape)
    assert_same_tensors(want[0], oh.vectorized_map(fn, tuple(elems)))
    got = run(oh.vectorized_map, oh.GradientTape)
    assert got[0].shape == (5, 4)
    assert_same_tensors(want, got)


def test_unit_leading_dimension_inside_a_fresh_tf_function():
    a, b = _rand(1, 3), _rand(4, 3)
    f = lambda a, b: oh.vectorized_map(lambda e: e[0] * e[1] + 1., (a, b))  # noqa: E731
    want = tf.vectorized_map(lambda e: e[0] * e[1] + 1., (a, b))
    assert_same_tensors(want, f(a, b))
    assert_same_tensors(want, tf.function(f)(a, b))


def test_unequal_leading_dimensions_other_than_one_raise_a_clear_error():
    # tf.vectorized_map fails later with a gather InvalidArgumentError ("indices[2] = 2
    # is not in [0, 2)"); oh.vectorized_map says why at once.
    with pytest.raises(ValueError, match="oh.vectorized_map: elems need one static leading"):
        oh.vectorized_map(lambda e: e[0] + e[1], (tf.ones([2, 2]), tf.ones([3, 2])))


def test_a_returned_variable_update_is_read_per_example_or_refused():
    """`return v.assign_add(x)` returns an unread variable: read after the map it gave the
    final value for every example ([6, 6, 6], tf.map_fn: [1, 3, 6]). It is now read
    inside the map, where reading a per-example update raises the map's clear error."""
    v = tf.Variable(0.)
    xs = tf.constant([1., 2., 3.])
    want = tf.map_fn(lambda x: v.assign_add(x), xs)
    assert want.numpy().tolist() == [1., 3., 6.]
    v.assign(0.)
    with pytest.raises(ValueError, match="updated once per example"):
        oh.vectorized_map(lambda x: v.assign_add(x), xs)


def test_a_returned_variable_without_updates_is_its_value_for_every_example():
    v = tf.Variable([1., 2.])
    xs = tf.constant([1., 2., 3.])
    # tf.vectorized_map refuses a variable output (no BatchableTypeSpec); tf.map_fn
    # reads it per example.
    want = tf.map_fn(lambda x: v, xs, fn_output_signature=tf.float32)
    got = oh.vectorized_map(lambda x: v, xs)
    assert_same_tensors(want, got)
