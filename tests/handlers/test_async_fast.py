"""oh.Async's hook run in C for its common case (cc/handlers/async_execution/fast_async.cc): the same outputs,
representations and errors as the Python hook, which stays the reference."""
import time

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers import _C
from tf_ophandlers.core.stack import payload


class PythonHookAsync(oh.Async):
    """Async whose hook always runs in Python (C takes only Async.execute itself)."""

    def execute(self, op, inputs):
        return super().execute(op, inputs)


def _c_ops():
    return _C.async_stats()["c_ops"]


def _program(x, y):
    # Unary, binary with a fresh float constant, broadcasting, two handler inputs, and
    # dtypes the C path takes (float64) next to ones it leaves to Python (int32).
    outs = []
    h = x
    for _ in range(5):
        h = tf.tanh(h) * 1.01
    outs.append(h)
    outs.append(h + y)                                  # two handler tensors
    outs.append(h[:, :1] * tf.ones([1, 16]))            # broadcast (StridedSlice: Python)
    outs.append(tf.cast(h, tf.float64) * 2.0)           # Cast (attributes): Python; Mul: C
    outs.append(tf.range(16) * 3)                       # int32: Python
    return outs


def _fast_and_python_hook(x, y):
    """(eager's, Async's outputs and representations, ops its hook ran in C, the Python
    hook's outputs and representations) of `_program`, after a warm-up run."""
    ref = _program(x, y)
    fast, slow = oh.Async(), PythonHookAsync()
    with fast:
        _program(x, y)  # fills the signature cache (a miss runs the Python hook)
    before = _c_ops()
    with fast:
        got = _program(x, y)
        got_reprs = [payload(t)[1] for t in got]
    ran_in_c = _c_ops() - before
    with slow:
        slow_before = _c_ops()
        want = _program(x, y)
        want_reprs = [payload(t)[1] for t in want]
        assert _c_ops() == slow_before  # the subclass's hook is Python's
    return ref, got, got_reprs, ran_in_c, want, want_reprs


def test_c_path_matches_the_python_hook_and_eager():
    x = tf.random.stateless_uniform([16, 16], seed=[1, 2])
    y = tf.random.stateless_uniform([16, 16], seed=[3, 4])
    ref, got, got_reprs, _, want, want_reprs = _fast_and_python_hook(x, y)
    for g, w, r, gr, wr in zip(got, want, ref, got_reprs, want_reprs):
        assert g.dtype == w.dtype == r.dtype and g.shape == w.shape == r.shape
        np.testing.assert_array_equal(g.numpy(), r.numpy())
        np.testing.assert_array_equal(w.numpy(), r.numpy())
        # The representation (tensor, signature part, dtype) is the Python hook's.
        assert type(gr) is tuple and gr[1:] == wr[1:]


@pytest.mark.requires_c_paths("Async's hook runs in C")
def test_the_common_ops_run_in_c():
    x = tf.random.stateless_uniform([16, 16], seed=[1, 2])
    y = tf.random.stateless_uniform([16, 16], seed=[3, 4])
    ran_in_c = _fast_and_python_hook(x, y)[3]
    assert ran_in_c >= 10  # the chain's Tanh and Mul at least


def _tanh_twice(x):
    """(y, ops Async's hook ran in C for it, y's shape, dtype and device inside the
    scope) for y = tanh(x) * 2 after a warm-up run."""
    runner = oh.Async()
    with runner:
        tf.tanh(x) * 2.0
        before = _c_ops()
        y = tf.tanh(x) * 2.0
        ran_in_c = _c_ops() - before
        seen = (y.shape, y.dtype, y.device)
    return y, ran_in_c, seen


def test_outputs_have_inferred_shapes_before_the_kernels_run():
    x = tf.random.stateless_uniform([4, 8], seed=[1, 2])
    y, _, (shape, dtype, device) = _tanh_twice(x)
    assert shape == (4, 8) and dtype == tf.float32
    assert device.endswith("CPU:0")
    np.testing.assert_array_equal(y.numpy(), (tf.tanh(x) * 2.0).numpy())


@pytest.mark.requires_c_paths("Async's hook runs in C")
def test_c_path_outputs_have_inferred_shapes_before_the_kernels_run():
    _, ran_in_c, _ = _tanh_twice(tf.random.stateless_uniform([4, 8], seed=[1, 2]))
    assert ran_in_c == 2


def _after_a_queued_failure():
    """(z, ops Async's hook ran in C for z) for an op after a failed kernel was reported.
    The failed kernel poisons the queue: the next op's TFE_Execute fails, the C path
    declines, and the Python hook raises the failure and clears the queue's error."""
    x = tf.random.stateless_uniform([2, 3], seed=[1, 2])
    runner = oh.Async(sync_on_exit=False)
    with runner:
        h = tf.tanh(x) * 2.0
        h = tf.tanh(h) * 2.0  # signatures cached: these run in C
        tf.raw_ops.Reshape(tensor=h, shape=tf.constant([7]))  # fails on the queue
        time.sleep(1.0)  # the executor runs the failing kernel meanwhile
        with pytest.raises(tf.errors.InvalidArgumentError, match="reshape"):
            tf.tanh(h)  # a cached signature: the C path tried it first
        before = _c_ops()
        z = tf.tanh(x) * 2.0
        ran_in_c = _c_ops() - before
    np.testing.assert_allclose(z.numpy(), (tf.tanh(x) * 2.0).numpy())
    return z, ran_in_c


def test_op_after_a_queued_failure_reports_it_and_the_handler_keeps_working():
    _after_a_queued_failure()


@pytest.mark.requires_c_paths("Async's hook runs in C")
def test_after_a_queued_failure_the_ops_are_back_on_the_c_path():
    _, ran_in_c = _after_a_queued_failure()
    assert ran_in_c == 2
