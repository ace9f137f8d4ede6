"""Known limitations found by the fuzz sweeps, each reduced to a small program and
checked against TensorFlow: a strict xfail fails the suite once the limitation is gone
(then drop the mark and the CHANGELOG's "Known limitations" entry). Reproducing a fuzz
case: tests/compositions/test_fuzz_stacks.py's docstring; the cases left out of its draw:
its `_known_limitation`."""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

# A function whose backward function reads its input's dynamic shape (an unknown batch).
_DOUBLE = tf.function(lambda a: a + a, input_signature=[tf.TensorSpec([None, 4])])


def _jvp_of_gradient(accumulator, tape_class, between):
    """The accumulator's JVP of a tape's gradient of `_DOUBLE(x)`, with `between` (a
    handler or None) open between the tape and the call."""
    x = tf.constant(np.arange(8, dtype=np.float32).reshape(2, 4))
    with accumulator(x, tf.ones_like(x)) as acc:
        with tape_class() as tape:
            tape.watch(x)
            if between is None:
                y = _DOUBLE(x)
            else:
                with between:
                    y = _DOUBLE(x)
        g = tape.gradient(y, x)
        return g, acc.jvp(g)


def test_gradient_of_a_replayed_call_with_an_unknown_batch_under_an_accumulator():
    want, want_jvp = _jvp_of_gradient(tf.autodiff.ForwardAccumulator, tf.GradientTape, None)
    got, _ = _jvp_of_gradient(oh.ForwardAccumulator, oh.GradientTape, oh.OpHandler())
    np.testing.assert_array_equal(np.asarray(got), want.numpy())
    assert want_jvp is not None and not np.any(want_jvp.numpy())
    _, direct_jvp = _jvp_of_gradient(oh.ForwardAccumulator, oh.GradientTape, None)
    np.testing.assert_array_equal(np.asarray(direct_jvp), want_jvp.numpy())


@pytest.mark.xfail(strict=True, reason="open: a handler between the tape and a called "
                   "function replays it with static shapes, so the call's backward does "
                   "not read its input: the JVP of the gradient is None where TensorFlow's "
                   "is zeros (values agree)")
def test_jvp_of_the_gradient_of_a_replayed_call_is_zeros_as_tensorflows():
    _, want_jvp = _jvp_of_gradient(tf.autodiff.ForwardAccumulator, tf.GradientTape, None)
    _, got_jvp = _jvp_of_gradient(oh.ForwardAccumulator, oh.GradientTape, oh.OpHandler())
    assert got_jvp is not None, "JVP None, TensorFlow's zeros"
    np.testing.assert_array_equal(np.asarray(got_jvp), want_jvp.numpy())


def _sin_times(use_async):
    def f(e):
        if use_async:
            with oh.Async():
                return tf.sin(e) * e
        return tf.sin(e) * e
    return f


def _map_under_tf_tape(vectorized_map, fn):
    x = tf.constant(np.arange(12, dtype=np.float32).reshape(3, 4) / 10)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = vectorized_map(fn, x)
    return y, tape.gradient(y, x)


def test_async_inside_a_map_under_a_tf_tape_is_refused_naming_async():
    """Under a tf.GradientTape oh.vectorized_map traces the mapped function (as
    tf.vectorized_map does), and oh.Async refuses to be opened in a trace: the error
    names it and says where to open it (OH_FUZZ_SEED=24 slow cases 15 and 31)."""
    with pytest.raises(Exception, match=r"Async\(\) cannot be opened inside a function "
                       r"being traced"):
        _map_under_tf_tape(oh.vectorized_map, _sin_times(True))


@pytest.mark.xfail(strict=True, reason="open: oh.Async cannot be opened inside a traced "
                   "function, and oh.vectorized_map under a tf.GradientTape traces the "
                   "mapped function")
def test_async_inside_a_map_under_a_tf_tape_computes_tf_vectorized_maps_result():
    want, want_grad = _map_under_tf_tape(tf.vectorized_map, _sin_times(False))
    got, got_grad = _map_under_tf_tape(oh.vectorized_map, _sin_times(True))
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got_grad), want_grad.numpy(), rtol=1e-6)
