"""Copy-on and shape shortcuts of oh.GradientTape inside oh.vectorized_map:
a physical input the tape does not track goes from the tape's C record path to the map's
hook as it is (cc/handlers/gradient_tape/tape_record.h TapeCopiesThrough), which makes it unbatched with its
`physical_copy_on` (no copy_on frame), and the tape's static-shape gradients read the
map's per-example shapes from the representation (`value_shape`), not through the
num_dims/dim hooks. Values, dtypes and gradient types are checked against
tf.vectorized_map with tf.GradientTape, and the hook calls are counted."""
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.core import stack as _stack
from tf_ophandlers.handlers.vectorized_map.handler import VectorizedMap
from conftest import assert_same_tensors


def _per_example(tape_cls, c, extra):
    def fn(e):
        with tape_cls() as t:
            t.watch(e)
            t.watch(extra)  # a tracked physical capture: still copied on by the tape
            h = tf.reshape(e[None] * c, [1, 3]) + tf.constant([[0.5, -0.5, 1.0]])
            y = tf.reduce_sum(tf.sin(h[:, 1:]) * extra) + tf.reduce_sum(h * h)
        return t.gradient(y, [e, extra])
    return fn


def _count_copies(fn):
    """(fn(), {handler class name: HandlerStack._copy_on_value calls})."""
    counts = {}
    original = _stack.HandlerStack._copy_on_value  # pylint: disable=protected-access

    def counting(self, tensor):
        name = type(self.handler).__name__
        counts[name] = counts.get(name, 0) + 1
        return original(self, tensor)

    _stack.HandlerStack._copy_on_value = counting  # pylint: disable=protected-access
    try:
        return fn(), counts
    finally:
        _stack.HandlerStack._copy_on_value = original  # pylint: disable=protected-access


def _untracked_inputs():
    """(tf.vectorized_map's, oh.vectorized_map's per-example gradients with untracked
    physical inputs, HandlerStack._copy_on_value calls), after a warm-up run."""
    x = tf.random.stateless_normal([5, 3], seed=[7, 1])
    c = tf.constant([2.0, -1.0, 0.25])
    extra = tf.constant(1.5)
    want = tf.vectorized_map(_per_example(tf.GradientTape, c, extra), x)
    fn = _per_example(oh.GradientTape, c, extra)
    oh.vectorized_map(fn, x)  # decisions and plans made
    got, copies = _count_copies(lambda: oh.vectorized_map(fn, x))
    return want, got, copies


def test_untracked_physical_inputs_give_tensorflows_gradients():
    want, got, _ = _untracked_inputs()
    assert_same_tensors(want, got)


@pytest.mark.requires_c_paths("the C++ path passes untracked inputs through the tape")
def test_untracked_physical_inputs_skip_the_copy_hooks():
    """The C++ record path hands them to the map's hook as they are
    (`tape_copies_through`); the Python path calls the tape's copy_on, which passes them
    on and records nothing: the same gradients, more hook calls."""
    _, _, copies = _untracked_inputs()
    # `extra` is watched: its copy-on runs through the tape (which records it, so its
    # per-example gradient is right) and the map's copy_on below it; the backward pass
    # copies its seed onto the map. `c`, the reshape's shape, the slice's bounds and the
    # added constant are not tracked: they reach the map's hook as they are.
    assert copies == {"GradientTape": 1, "VectorizedMap": 2}, copies


def test_the_shortcuts_off_give_the_same_tensors():
    x = tf.random.stateless_normal([4, 3], seed=[7, 2])
    c = tf.constant([1.0, 3.0, -2.0])
    extra = tf.constant(-0.5)
    fn = _per_example(oh.GradientTape, c, extra)
    got = oh.vectorized_map(fn, x)
    saved = VectorizedMap.tape_copies_through, VectorizedMap.__dict__["physical_copy_on"]
    VectorizedMap.tape_copies_through, VectorizedMap.physical_copy_on = False, None
    try:
        ref, copies = _count_copies(lambda: oh.vectorized_map(fn, x))
    finally:
        VectorizedMap.tape_copies_through, VectorizedMap.physical_copy_on = saved
    assert copies.get("GradientTape", 0) > 1 and copies.get("VectorizedMap", 0) > 0, copies
    assert_same_tensors(ref, got)


def _count_dim_hooks(fn):
    calls = [0]
    num_dims, dim = VectorizedMap.num_dims, VectorizedMap.dim

    def counting_num_dims(self, value):
        calls[0] += 1
        return num_dims(self, value)

    def counting_dim(self, value, index):
        calls[0] += 1
        return dim(self, value, index)

    VectorizedMap.num_dims, VectorizedMap.dim = counting_num_dims, counting_dim
    try:
        return fn(), calls[0]
    finally:
        VectorizedMap.num_dims, VectorizedMap.dim = num_dims, dim


def test_static_shape_gradients_read_the_per_example_shapes():
    x = tf.random.stateless_normal([6, 2, 3], seed=[7, 3])
    b = tf.constant([0.1, 0.2, 0.3])

    def per_example(tape_cls):
        def fn(e):
            with tape_cls() as t:
                t.watch(e)
                t.watch(b)
                y = tf.reduce_sum(tf.tanh(e + b) * (e - b) * b)
            return t.gradient(y, [e, b])
        return fn

    want = tf.vectorized_map(per_example(tf.GradientTape), x)
    fn = per_example(oh.GradientTape)
    oh.vectorized_map(fn, x)
    got, with_shapes = _count_dim_hooks(lambda: oh.vectorized_map(fn, x))
    assert_same_tensors(want, got)
    value_shape = VectorizedMap.value_shape
    del VectorizedMap.value_shape
    try:
        ref, without = _count_dim_hooks(lambda: oh.vectorized_map(fn, x))
    finally:
        VectorizedMap.value_shape = value_shape
    assert_same_tensors(want, ref)
    # The Add/Sub/Mul gradients read 3 shapes each (x, y, the gradient): 2-3 hook
    # calls per rank-1/2 shape when asked through TensorFlow.
    assert with_shapes + 12 <= without, (with_shapes, without)
