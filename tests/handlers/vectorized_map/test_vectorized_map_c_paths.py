"""Per-op shortcuts of oh.vectorized_map:

- `handles_copy = True` (every copy op, not a predicate): the C++ per-op path runs copy
  ops through the handler's execute hook like other ops (the map's CopyOnGrad of a
  captured variable's gradient), without HandlerStack.execute's Python;
- a handler's `value_shape` answers a tensor's whole shape at its rank query: the axis
  queries that follow are answered in C (cc/boundary/handler_tensor.cc), not by a `dim` hook each.

Values, dtypes and gradient types are checked against TensorFlow (tf.vectorized_map with
tf.GradientTape), and the Python calls the shortcuts remove are counted."""
import pytest
import tensorflow as tf

import tf_ophandlers as oh
import tf_ophandlers._C as _C
from tf_ophandlers.core import copies
from tf_ophandlers.core import stack as _stack
from tf_ophandlers.handlers.vectorized_map.handler import VectorizedMap
from conftest import assert_same_tensors


class _Logs(oh.OpHandler):
    """Forwards every op; logs the op types its execute hook sees."""

    def __init__(self, takes_copies):
        super().__init__()
        self.seen = []
        if takes_copies is not None:
            self.handles_copy = takes_copies

    def execute(self, op, inputs):
        self.seen.append(op.type)
        return self.next.execute(op, inputs)


def _python_executes(fn):
    """(fn(), op types HandlerStack.execute ran in Python)."""
    types = []
    original = _stack.HandlerStack.execute

    def counting(self, op, inputs):
        types.append(op.type)
        return original(self, op, inputs)

    _stack.HandlerStack.execute = counting
    try:
        return fn(), types
    finally:
        _stack.HandlerStack.execute = original


def _copy_on_grad_under(handler):
    x = tf.constant([1.0, -2.0, 3.0])
    with oh.handler(handler):
        y = copies.copy_on_grad(x)
        return x, oh.copy_off(y)


def _copy_on_grad_logged(takes_copies):
    """(x, its CopyOnGrad copied off, op types the handler's execute saw, op types
    HandlerStack.execute ran in Python, fast-path ops counted) under a _Logs handler,
    after a warm-up run."""
    _copy_on_grad_under(_Logs(takes_copies))  # the decision made
    h = _Logs(takes_copies)
    before = _C.fast_stats()["fast_ops"]
    (x, y), in_python = _python_executes(lambda: _copy_on_grad_under(h))
    return x, y, h.seen, in_python, _C.fast_stats()["fast_ops"] - before


def test_handles_copy_sends_copy_ops_to_execute():
    # True, or a predicate asked per op: the copy op reaches execute, the same result.
    for takes_copies in (True, lambda op: op.type == "CopyOnGrad"):
        x, y, seen, _, _ = _copy_on_grad_logged(takes_copies)
        assert_same_tensors(x, y)
        assert "CopyOnGrad" in seen, seen
    # No handles_copy: the stack's copy rules, not execute.
    x, y, seen, _, _ = _copy_on_grad_logged(None)
    assert_same_tensors(x, y)
    assert "CopyOnGrad" not in seen, seen


@pytest.mark.requires_c_paths("copy ops reach the execute hook from C++")
def test_handles_copy_true_sends_copy_ops_to_execute_from_c():
    _, _, _, in_python, ran_fast = _copy_on_grad_logged(True)
    assert "CopyOnGrad" not in in_python, in_python
    assert ran_fast > 0
    # A predicate is asked per op: the copy op takes the Python path.
    _, _, _, in_python, _ = _copy_on_grad_logged(lambda op: op.type == "CopyOnGrad")
    assert "CopyOnGrad" in in_python, in_python


def _per_example_gradients_of_captures():
    """(tf.vectorized_map's, oh.vectorized_map's per-example gradients of captured
    variables, op types HandlerStack.execute ran in Python), after a warm-up run."""
    w = tf.Variable(tf.random.stateless_normal([3, 2], seed=[5, 1]))
    b = tf.Variable([0.5, -0.25])
    x = tf.random.stateless_normal([4, 3], seed=[5, 2])

    def per_example(tape_cls):
        def fn(e):
            with tape_cls() as t:
                y = tf.reduce_sum(tf.tanh(tf.matmul(e[None], w) + b))
            return t.gradient(y, [w, b])
        return fn

    want = tf.vectorized_map(per_example(tf.GradientTape), x)
    fn = per_example(oh.GradientTape)
    oh.vectorized_map(fn, x)
    got, in_python = _python_executes(lambda: oh.vectorized_map(fn, x))
    return want, got, in_python


def test_per_example_gradients_of_captures_match_tensorflow():
    want, got, _ = _per_example_gradients_of_captures()
    assert_same_tensors(want, got)


@pytest.mark.requires_c_paths("copy ops take no Python stack path")
def test_per_example_gradients_of_captures_take_no_python_stack_path():
    _, _, in_python = _per_example_gradients_of_captures()
    assert "CopyOnGrad" not in in_python, in_python


def _count_shape_hooks(fn):
    calls = {"num_dims": 0, "dim": 0}
    num_dims, dim = VectorizedMap.num_dims, VectorizedMap.dim

    def counting_num_dims(self, value):
        calls["num_dims"] += 1
        return num_dims(self, value)

    def counting_dim(self, value, index):
        calls["dim"] += 1
        return dim(self, value, index)

    VectorizedMap.num_dims, VectorizedMap.dim = counting_num_dims, counting_dim
    try:
        return fn(), calls
    finally:
        VectorizedMap.num_dims, VectorizedMap.dim = num_dims, dim


def _shapes_seen(x):
    seen = []

    def fn(e):
        a = e[None] * 2.0
        s = tf.reduce_sum(e, axis=-1)
        seen.append((e.shape.as_list(), a.shape.as_list(), s.shape.as_list(),
                     tf.matmul(a, e).shape.as_list()))
        return tf.matmul(a, e)
    return oh.vectorized_map(fn, x), seen


def test_whole_shapes_answer_the_axis_queries():
    x = tf.random.stateless_normal([5, 3, 3], seed=[5, 3])
    want = tf.vectorized_map(lambda e: tf.matmul(e[None] * 2.0, e), x)
    (got, seen), calls = _count_shape_hooks(lambda: _shapes_seen(x))
    assert_same_tensors(want, got)
    assert seen == [([3, 3], [1, 3, 3], [3], [1, 3, 3])], seen
    assert calls == {"num_dims": 0, "dim": 0}, calls
    # A value_shape answer that is not a valid shape: the per-axis hooks answer instead.
    value_shape = VectorizedMap.value_shape
    for bad in (lambda self, v: list(value_shape(self, v)),
                lambda self, v: tuple(-2 for _ in value_shape(self, v)),
                lambda self, v: None):
        VectorizedMap.value_shape = bad
        try:
            (ref, seen_ref), calls = _count_shape_hooks(lambda: _shapes_seen(x))
        finally:
            VectorizedMap.value_shape = value_shape
        assert_same_tensors(want, ref)
        assert seen_ref == seen, seen_ref
        assert calls["num_dims"] > 0 and calls["dim"] > 0, calls


def test_gradients_reading_attributes_get_them_when_asked():
    """The tape's backward pass makes a record's attribute tuple only when its gradient
    function reads one (gradient_tape_backward._LazyAttrsOp): MatMul's transposes and
    a reduction's keep_dims must still reach their gradients."""
    w = tf.Variable(tf.random.stateless_normal([2, 3], seed=[5, 4]))
    x = tf.random.stateless_normal([4, 3], seed=[5, 5])

    def per_example(tape_cls):
        def fn(e):
            with tape_cls() as t:
                a = tf.matmul(e[None], w, transpose_b=True)
                b = tf.matmul(w, a, transpose_a=True, transpose_b=True)  # [3, 1]
                y = tf.reduce_sum(tf.reduce_mean(a * a, axis=1, keepdims=True)) + \
                    tf.reduce_sum(b)
            return t.gradient(y, w)
        return fn

    want = tf.vectorized_map(per_example(tf.GradientTape), x)
    got = oh.vectorized_map(per_example(oh.GradientTape), x)
    assert_same_tensors(want, got)
