"""tf.experimental.Optional values read inside oh.vectorized_map, against
tf.vectorized_map with the loop fallback off (OptionalGetValue had no
batching rule; pfor's batched Optional is one scalar variant holding every example's
values, which the pfor fallback then tried to index per example)."""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_same_tensors

X = tf.constant(np.arange(12, dtype=np.float32).reshape(3, 4))
IDS = tf.constant([[1, 2], [3, 4], [5, 6]], dtype=tf.int64)


def read_back(elems):
    x, ids = elems
    opt = tf.experimental.Optional.from_value((x * 2., {"ids": ids, "first": x[0]}))
    doubled, rest = opt.get_value()
    return doubled + rest["first"], rest["ids"] * 3


def mixed_with_a_capture(x):
    # An Optional of a per-example value and a captured one (pfor stacks both).
    opt = tf.experimental.Optional.from_value((x, tf.constant([10., 20., 30., 40.])))
    a, b = opt.get_value()
    return a * b


@pytest.mark.parametrize("traced", [False, True], ids=["eager_fn", "tf_function_fn"])
@pytest.mark.parametrize("fn,elems", [
    (read_back, lambda: (X, IDS)),
    (mixed_with_a_capture, lambda: X),
], ids=["read_back", "mixed_with_a_capture"])
def test_get_value_without_the_loop_fallback(fn, elems, traced):
    want = tf.vectorized_map(fn, elems(), fallback_to_while_loop=False)
    mapped = tf.function(fn) if traced else fn
    got = oh.vectorized_map(mapped, elems(), fallback_to_while_loop=False)
    assert_same_tensors(want, got)


def test_get_value_inside_a_fresh_function():
    @tf.function
    def step(x):
        return oh.vectorized_map(mixed_with_a_capture, x, fallback_to_while_loop=False)
    want = tf.vectorized_map(mixed_with_a_capture, X, fallback_to_while_loop=False)
    assert_same_tensors(want, step(X))


def test_has_value_is_tf_map_fns():
    """pfor has no converter for OptionalHasValue (tf.vectorized_map raises ValueError
    with the fallback on or off): tf.map_fn's result is the reference. The presence is
    one for the whole batch, so a tf.cond on it runs one branch in the map."""
    def fn(x):
        opt = tf.experimental.Optional.from_value(x)
        value = tf.cond(opt.has_value(), opt.get_value, lambda: tf.zeros_like(x))
        return value * 2., opt.has_value()

    with pytest.raises(ValueError):
        tf.vectorized_map(fn, X, fallback_to_while_loop=False)
    want = tf.map_fn(fn, X, fn_output_signature=(tf.float32, tf.bool))
    got = oh.vectorized_map(fn, X, fallback_to_while_loop=False)
    assert_same_tensors(want, got)


@pytest.mark.parametrize("fallback", [True, False], ids=["loop_fallback", "no_fallback"])
def test_an_op_without_a_rule_on_a_batched_optional_raises_as_tensorflow(fallback):
    """The per-example loop cannot take such an Optional apart (it failed inside the loop
    with InvalidArgumentError "Attempting to slice scalar input"): a ValueError naming
    the op, as tf.vectorized_map's."""
    def fn(x):
        return tf.io.serialize_tensor(tf.experimental.Optional.from_value(x)._variant_tensor)  # pylint: disable=protected-access

    with pytest.raises(ValueError):
        tf.vectorized_map(fn, X, fallback_to_while_loop=fallback)
    with pytest.raises(ValueError, match="oh.vectorized_map: op SerializeTensor"):
        oh.vectorized_map(fn, X, fallback_to_while_loop=fallback, warn=False)
