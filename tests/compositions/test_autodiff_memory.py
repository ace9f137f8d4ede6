"""The memory contract of oh.GradientTape and oh.ForwardAccumulator, checked with
TensorFlow's own leak checks (test_util.assert_no_new_tensors and
assert_no_garbage_created, applied by conftest.tf_leak_checked) on the same programs as
tf.GradientTape and tf.autodiff.ForwardAccumulator: caches keep no tensor of the program
alive after it dropped it, and neither handler leaves garbage behind."""
import dataclasses
import gc
import weakref

import pytest
import tensorflow as tf
from tensorflow.core.function.polymorphism import function_cache
from tensorflow.python.eager import context
from tensorflow.python.eager import forwardprop

import tf_ophandlers as oh
from conftest import assert_close, tf_leak_checked
from tf_ophandlers.core.cache import caches
from tf_ophandlers.handlers.forward_accumulator import handler as fa

TAPES = (tf.GradientTape, oh.GradientTape)
ACCUMULATORS = (tf.autodiff.ForwardAccumulator, oh.ForwardAccumulator)


class _TracedManyTimes(dict):
    """forwardprop._TRACE_COUNT as after a long run: every op has 32 JVP traces."""

    def get(self, key, default=None):
        return max(32, super().get(key, 0))


def _fresh_jvp_functions(monkeypatch, module, cache_name, option_names):
    """An empty cache of traced JVP functions in `module` for the test."""
    cache = function_cache.FunctionCache()
    monkeypatch.setattr(module, cache_name, cache)
    for name in option_names:
        monkeypatch.setattr(module, name,
                            dataclasses.replace(getattr(module, name), function_cache=cache))


@pytest.fixture(params=["exact shapes", "relaxed shapes"])
def jvp_tracing(request, monkeypatch):
    """Both accumulators trace an op's JVP for its exact shapes for the op's first 32
    traces in the process, then for relaxed shapes (forwardprop._TRACE_COUNT), and
    keep the traces process-wide. What a test met depended on what ran before it in its
    process (pytest-xdist runs the files in another order than one process): here each
    phase starts from empty caches of traced JVPs, as in a new process."""
    monkeypatch.setattr(forwardprop, "_TRACE_COUNT",  # pylint: disable=protected-access
                        {} if request.param == "exact shapes" else _TracedManyTimes())
    _fresh_jvp_functions(monkeypatch, forwardprop, "_jvp_function_cache",
                         ("_jvp_exact_config", "_jvp_relaxed_config"))
    _fresh_jvp_functions(monkeypatch, fa, "_jvp_function_cache", ("_jvp_exact", "_jvp_relaxed"))


def _second_order(tape_type):
    """Gradient, Hessian diagonal, and whether the tapes outlive the program's references
    without garbage collection (a reference cycle would keep them)."""
    x = tf.constant([0.5, -1.5, 2.])
    gc.disable()
    try:
        with tape_type() as outer:
            outer.watch(x)
            with tape_type() as inner:
                inner.watch(x)
                y = tf.reduce_sum(3. * x ** 3 + tf.sin(x) * 2.)
            g = inner.gradient(y, x)
        h = outer.gradient(g, x)
        values = g.numpy(), h.numpy()
        tapes = [weakref.ref(outer), weakref.ref(inner)]
        del outer, inner, g, h, y  # (a tensor of a handler's stack holds the handler)
        return values + ([t() is not None for t in tapes],)
    finally:
        gc.enable()


@tf_leak_checked
def test_second_order_with_nested_tapes_leaves_no_tensors():
    (g_tf, h_tf, alive_tf), (g_oh, h_oh, alive_oh) = [_second_order(t) for t in TAPES]
    assert_close(g_oh, g_tf, 1e-5)
    assert_close(h_oh, h_tf, 1e-5)
    assert alive_oh == alive_tf == [False, False]


def _hvp(accumulator_type, tape_type, primals, tangents):
    with accumulator_type(primals, tangents) as acc:
        with tape_type() as tape:
            tape.watch(primals)
            y = tf.reduce_prod(tf.tanh(primals) ** 2) + 0.5 * tf.reduce_sum(primals ** 2)
        grad = tape.gradient(y, primals)
    return acc.jvp(grad)


@tf_leak_checked(warmup=1)
def test_forward_over_reverse_hvp_repeated_keeps_no_tensors(jvp_tracing):  # pylint: disable=unused-argument
    # Python scalars (0.5, 2) convert to new constants under the handler scopes on every
    # call: listed by the dispatcher, never kept alive by it.
    primals, tangents = tf.constant([1., 2., 3.]), tf.constant([3., 4., 5.])
    want = _hvp(tf.autodiff.ForwardAccumulator, tf.GradientTape, primals, tangents)
    for _ in range(50):
        got = _hvp(oh.ForwardAccumulator, oh.GradientTape, primals, tangents)
        assert_close(got, want, 1e-5)


def _dead_tensors(accumulator_type, size=100):
    """TensorFlow's testDeadTensorsJVPCleared: what the accumulator holds goes with the
    program's last reference (reference counting alone: no garbage collection)."""
    alive = []
    gc.disable()
    try:
        x = tf.ones([size])
        x_weak = weakref.ref(x)
        tangent = tf.constant(tf.zeros([size]))
        tangent_weak = weakref.ref(tangent)
        with accumulator_type(x, tangent) as acc:
            derived = tf.constant(2.) * x
            del tangent
            assert_close(acc.jvp(x), tf.zeros([size]))
            del x
            alive += [x_weak() is not None, tangent_weak() is not None]
            derived_weak = weakref.ref(derived)
            derived_jvp = acc.jvp(derived)
            derived_jvp_weak = weakref.ref(derived_jvp)
            del derived, derived_jvp
            alive += [derived_weak() is not None, derived_jvp_weak() is not None]
        acc_weak = weakref.ref(acc)
        del acc
        alive.append(acc_weak() is not None)
    finally:
        gc.enable()
    return alive


@tf_leak_checked(warmup=1)  # (TensorFlow's accumulator traces its Mul JVP once)
def test_dead_tensors_jvp_cleared(jvp_tracing):  # pylint: disable=unused-argument
    # Two sizes: with relaxed shapes the second is served by a trace of the first's
    # relaxed shape.
    for size in (100, 10):
        assert _dead_tensors(oh.ForwardAccumulator, size) == _dead_tensors(
            tf.autodiff.ForwardAccumulator, size) == [False] * 5


def _call_new_functions(accumulator_type, count):
    x = tf.constant([1., 2.])
    for _ in range(count):
        f = tf.function(lambda v: tf.sin(v) * v)  # a new function (and trace) per call
        with accumulator_type(x, tf.ones_like(x)) as acc:
            y = f(x)
        assert_close(acc.jvp(y), tf.cos(x) * x + tf.sin(x), 1e-5)


def _registered_functions():
    gc.collect()
    return len(context.context().list_function_names())


def test_functions_of_dropped_tf_functions_are_released():
    # A tf.function per JVP: TensorFlow releases each with the program's last reference.
    # The accumulator replays each call (a replayed function, registered in the context,
    # and the body it interprets): released with it, not kept until evicted.
    for accumulator_type in ACCUMULATORS:
        _call_new_functions(accumulator_type, 2)  # (TensorFlow traces its JVPs once)
        before = _registered_functions(), _cached("functions.replays", "functions.bodies")
        tf_leak_checked(lambda: _call_new_functions(accumulator_type, 10))()  # pylint: disable=cell-var-from-loop
        after = _registered_functions(), _cached("functions.replays", "functions.bodies")
        assert after == before, accumulator_type


def _cached(*names):
    sizes = caches()
    return [sizes.get(name, (0,))[0] for name in names]
