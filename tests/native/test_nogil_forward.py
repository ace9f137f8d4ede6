"""The no-GIL path of a forwarding level directly over PHYSICAL (cc/native/native_nogil.cc): a
C++ pass-through (`oh.native.PassThrough`) or a Python handler that does not execute the
op runs it, and makes its output handler tensors (anchored payloads, no Python
reference) and releases them, without the GIL. Each case against plain TensorFlow."""
import gc
import threading
import weakref

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers import _C


def _forward_ops():
    return _C.fast_stats()["nogil_forward_ops"]


def _chain(a, b):
    x = tf.add(a, b)
    x = tf.nn.relu(x * 3.0 - b)
    y = tf.matmul(x, b, transpose_b=True)
    s = tf.reduce_sum(y, axis=1)
    u = tf.unstack(y, axis=0)  # several outputs
    return [x, y, s, tf.cast(s, tf.int32), tf.shape(y), u[0], u[-1]]


class MatMulOnly(oh.OpHandler):
    """Executes MatMul in Python; forwards every other op (those may skip the GIL)."""

    handles_ops = frozenset({"MatMul"})
    # It computes MatMul unchanged. (Undeclared, the stack counts as substituting and no
    # op of it takes the no-GIL path, even the forwarded ones: see the issue-42 note.)
    changes_computation = False

    def __init__(self):
        self.seen = 0

    def execute(self, op, inputs):
        self.seen += 1
        return self.next.execute(op, inputs)


def _forwarding_level(make):
    """(handler, outputs, their values inside the scope, no-GIL ops counted, eager's) of
    the chain under one forwarding level, after a warm-up run."""
    a = tf.random.stateless_uniform([4, 3], seed=[1, 2])
    b = tf.random.stateless_uniform([4, 3], seed=[3, 4])
    want = _chain(a, b)
    h = make()
    with h:
        a1, b1 = tf.identity(a), tf.identity(b)
        _chain(a1, b1)  # the stack and its op types are remembered now
        before = _forward_ops()
        got = _chain(a1, b1)
        ran = _forward_ops() - before
        inside = [g.numpy() for g in got]
    return h, got, inside, ran, want


# A Python handler's forwarding level runs without the GIL only on the C paths; a C++
# handler keeps its native path with them off.
_PYTHON_LEVEL = pytest.mark.requires_c_paths("a Python handler's level runs without the GIL")
_LEVELS = [oh.native.PassThrough, pytest.param(oh.OpHandler, marks=_PYTHON_LEVEL),
           pytest.param(MatMulOnly, marks=_PYTHON_LEVEL)]


@pytest.mark.parametrize("make", [oh.native.PassThrough, oh.OpHandler, MatMulOnly])
def test_forwarding_level_matches_tensorflow(make):
    h, got, inside, _, want = _forwarding_level(make)
    for g, v, w in zip(got, inside, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(v, w.numpy(), rtol=1e-6)
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6)  # after the scope
    if make is MatMulOnly:
        assert h.seen == 2  # its own op still reached its Python hook


@pytest.mark.parametrize("make", _LEVELS)
def test_forwarding_level_runs_without_the_gil(make):
    _, _, _, ran, want = _forwarding_level(make)
    assert ran >= len(want), ran  # ops after the first of their type


def test_resource_outputs_leave_and_variables_work_under_a_pass_through():
    with oh.native.PassThrough():
        v0 = tf.Variable([1.0, 2.0])  # warms up VarHandleOp and friends
        v = tf.Variable([1.0, 2.0])
        x = tf.identity(tf.constant([3.0, 4.0]))
        v.assign_add(x)
        v.assign_add(x)
        r = v * 2.0
    assert v.handle.device == v0.handle.device and "OPHANDLER" not in v.handle.device
    np.testing.assert_array_equal(v.numpy(), [7.0, 10.0])
    np.testing.assert_array_equal(r.numpy(), [14.0, 20.0])


def test_gradients_through_no_gil_ops_equal_tensorflow():
    x = tf.random.stateless_normal([3, 3], seed=[5, 6])

    def f(t):
        y = tf.tanh(t) * 1.5
        for _ in range(4):
            y = tf.sin(y) * 1.01 + t
        return tf.reduce_sum(y * y)

    with tf.GradientTape() as tape:
        tape.watch(x)
        want = f(x)
    want_g = tape.gradient(want, x)
    with oh.native.PassThrough():
        with tf.GradientTape() as tape:
            tape.watch(x)
            f(x)
            got = f(x)
        got_g = tape.gradient(got, x)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5)
    np.testing.assert_allclose(got_g.numpy(), want_g.numpy(), rtol=1e-5)


def test_the_plan_does_not_keep_a_closed_scope_alive():
    """The plan's hold on its stack ends when the scope closes: the handler is freed once
    the tensors made without the GIL are, and those tensors work after the scope."""
    a = tf.ones([2, 2])
    h = oh.native.PassThrough()
    with h:
        x = tf.identity(a)
        for _ in range(5):
            x = tf.add(x, a)
    ref = weakref.ref(h)
    del h
    gc.collect()
    assert ref() is not None  # `x` (a handler tensor) keeps its stack and handler
    np.testing.assert_array_equal(x.numpy(), np.full([2, 2], 6.0))
    np.testing.assert_array_equal((x * 2.0).numpy(), np.full([2, 2], 12.0))
    del x
    gc.collect()
    assert ref() is None


def test_tensors_made_without_the_gil_released_on_other_threads():
    """Handler tensors made by one thread's no-GIL path, used and dropped by others (each
    in its own scope), and threads forwarding at once: values equal TensorFlow's."""
    a = tf.random.stateless_uniform([8, 8], seed=[7, 8])
    want = ((a + a) * a).numpy()
    made, errors = [], []
    with oh.native.PassThrough():
        x = tf.identity(a)
        for _ in range(3):
            made.append(tf.multiply(tf.add(x, x), x))

    def worker(i):
        try:
            with (oh.native.PassThrough() if i % 2 else oh.OpHandler()):
                y = tf.identity(a)
                for _ in range(100):
                    r = tf.multiply(tf.add(y, y), y)
                np.testing.assert_allclose(r.numpy(), want, rtol=1e-6)
            mine = made.pop() if made else None
            if mine is not None:
                np.testing.assert_allclose(mine.numpy(), want, rtol=1e-6)
            del mine
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors


def test_a_kernel_error_on_the_no_gil_path_is_tensorflow_s():
    a = tf.ones([2, 3])
    b = tf.ones([4, 5])
    with tf.device("/CPU:0"):
        with pytest.raises(tf.errors.InvalidArgumentError) as want:
            tf.matmul(a, b)
    with oh.native.PassThrough():
        x = tf.identity(a)
        tf.matmul(x, tf.ones([3, 1]))  # MatMul remembered
        before = _forward_ops()
        with pytest.raises(tf.errors.InvalidArgumentError) as got:
            tf.matmul(x, b)
        assert _forward_ops() > before
    assert want.value.message.split(" [Op:")[0] in got.value.message


def _two_levels(outer, inner, check):
    """The chain under two forwarding levels (after a warm-up run); `check(ran, want)`
    gets the no-GIL ops counted. Checks the payloads (the outer level's tensors name the
    inner stack, whose tensor is made when Python asks), the values and that the
    handlers are freed."""
    a = tf.random.stateless_uniform([4, 3], seed=[1, 2])
    b = tf.random.stateless_uniform([4, 3], seed=[3, 4])
    want = _chain(a, b)
    h_out, h_in = outer(), inner()
    with h_out, h_in:
        a1, b1 = tf.identity(a), tf.identity(b)
        _chain(a1, b1)
        before = _forward_ops()
        got = _chain(a1, b1)
        check(_forward_ops() - before, want)
        outer_stack, value = _C.payload(got[1])  # the inner level's tensor, made now
        inner_stack, physical = _C.payload(value)
        assert outer_stack.handler is h_in and inner_stack.handler is h_out
        assert _C.payload(physical) is None
        np.testing.assert_allclose(physical.numpy(), want[1].numpy(), rtol=1e-6)
        more = tf.add(got[1], got[1])  # an input whose value was made: still no GIL
    np.testing.assert_allclose(more.numpy(), 2 * want[1].numpy(), rtol=1e-6)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6)
    ref_out, ref_in = weakref.ref(h_out), weakref.ref(h_in)
    del h_out, h_in, got, value, outer_stack, inner_stack, a1, b1, more, g
    gc.collect()
    assert ref_out() is None and ref_in() is None


_PAIRS = [(oh.native.PassThrough, oh.native.PassThrough),
          (oh.OpHandler, oh.native.PassThrough),
          (oh.native.PassThrough, oh.OpHandler)]


@pytest.mark.parametrize("outer,inner", _PAIRS)
def test_two_forwarding_levels_match_tensorflow(outer, inner):
    _two_levels(outer, inner, lambda ran, want: None)


@pytest.mark.parametrize("outer,inner", [
    _PAIRS[0], pytest.param(*_PAIRS[1], marks=_PYTHON_LEVEL),
    pytest.param(*_PAIRS[2], marks=_PYTHON_LEVEL)])
def test_two_forwarding_levels_skip_the_inner_one_without_the_gil(outer, inner):
    """The outer level runs the op on PHYSICAL, skipping the inner one, without the GIL."""

    def check(ran, want):
        assert ran >= len(want), ran
    _two_levels(outer, inner, check)
