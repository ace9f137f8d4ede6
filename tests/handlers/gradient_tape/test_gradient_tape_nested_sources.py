"""Higher-order gradients of nested tapes when a physical source is used more than once
under another handler. The inner tape's gradient parts for such a source come back off
the stack (CopyOnGrad) and are summed on the physical devices; an enclosing
oh.GradientTape must record that sum, or its gradient of the gradient is None (it was,
for every handler below the tapes). Compared with nested tf.GradientTapes, op by op."""
import contextlib
import itertools

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

BELOW = [None, oh.OpHandler, oh.OpLogHandler, oh.CheckNumericsHandler]
TAPES = [tf.GradientTape, oh.GradientTape]


def _program(x, uses):
    # `uses` separate uses of the physical source x, so the inner tape gets as many parts.
    terms = [tf.sin(x) * tf.exp(x), tf.cos(x * 0.5), tf.tanh(x) * x][:uses]
    return tf.reduce_sum(tf.add_n(terms) * 1.5) if len(terms) > 1 else tf.reduce_sum(
        terms[0] * 1.5)


def _run(below, tapes, uses, x):
    ctx = below() if below is not None else contextlib.nullcontext()
    with ctx:
        if len(tapes) == 2:
            with tapes[0]() as outer:
                outer.watch(x)
                with tapes[1]() as inner:
                    inner.watch(x)
                    y = _program(x, uses)
                g = inner.gradient(y, x)
            return [g, outer.gradient(g, x)]
        with tapes[0]() as t0:
            t0.watch(x)
            with tapes[1]() as t1:
                t1.watch(x)
                with tapes[2]() as t2:
                    t2.watch(x)
                    y = _program(x, uses)
                g1 = t2.gradient(y, x)
            g2 = t1.gradient(g1, x)
        return [g1, g2, t0.gradient(g2, x)]


def _value(t):
    assert t is not None
    return np.asarray(oh.copy_off(t) if oh.stack_of(t) is not None else t)


@pytest.mark.parametrize("below", BELOW, ids=lambda b: "none" if b is None else b.__name__)
@pytest.mark.parametrize("uses", [1, 2, 3])
def test_second_order_nested_tapes_match_tensorflow(below, uses):
    x = tf.constant([0.3, -1.2, 2.0])
    want = _run(None, (tf.GradientTape, tf.GradientTape), uses, x)
    for tapes in itertools.product(TAPES, repeat=2):
        got = _run(below, tapes, uses, x)
        for g, w in zip(got, want):
            assert g is not None, (tapes, below)
            np.testing.assert_allclose(_value(g), w.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("below", [oh.OpHandler, oh.OpLogHandler],
                         ids=lambda b: b.__name__)
def test_third_order_nested_tapes_match_tensorflow(below):
    x = tf.constant([0.3, -1.2, 2.0])
    want = _run(None, (tf.GradientTape,) * 3, 2, x)
    for tapes in [(oh.GradientTape,) * 3, (tf.GradientTape, oh.GradientTape, oh.GradientTape),
                  (oh.GradientTape, tf.GradientTape, oh.GradientTape)]:
        got = _run(below, tapes, 2, x)
        for g, w in zip(got, want):
            np.testing.assert_allclose(_value(g), w.numpy(), rtol=1e-5, atol=1e-6)


def test_second_order_in_a_fresh_function_under_a_handler():
    x = tf.constant([0.3, -1.2, 2.0])
    want = _run(None, (tf.GradientTape, tf.GradientTape), 2, x)

    @tf.function
    def step(x):
        with oh.GradientTape() as outer:
            outer.watch(x)
            with oh.GradientTape() as inner:
                inner.watch(x)
                y = _program(x, 2)
            g = inner.gradient(y, x)
        return g, outer.gradient(g, x)

    with oh.OpHandler():
        got = step(x)
    for g, w in zip(got, want):
        np.testing.assert_allclose(_value(g), w.numpy(), rtol=1e-5, atol=1e-6)


def _tf_over_oh(watch_w, below=None):
    x = tf.constant([0.3, -1.2, 2.0])
    ctx = below() if below is not None else contextlib.nullcontext()
    with ctx:
        with tf.GradientTape() as outer:
            outer.watch(x)
            w = x * 2.0  # derived from x outside the inner tape: only the outer tape knows
            with oh.GradientTape() as inner:
                inner.watch(x)
                if watch_w:
                    inner.watch(w)
                y = tf.reduce_sum(tf.sin(x) * w)
            g = inner.gradient(y, x)
        return outer.gradient(g, [x, w])


def _tf_over_tf():
    x = tf.constant([0.3, -1.2, 2.0])
    with tf.GradientTape() as outer:
        outer.watch(x)
        w = x * 2.0
        with tf.GradientTape() as inner:
            inner.watch(x)
            y = tf.reduce_sum(tf.sin(x) * w)
        g = inner.gradient(y, x)
    return outer.gradient(g, [x, w])


@pytest.mark.parametrize("below", [None, oh.OpHandler], ids=["none", "OpHandler"])
def test_tf_tape_over_oh_tape_warns_where_it_would_miss_a_dependence(below):
    # Known limitation (docs/guide.md, "Composing autodiff"): TensorFlow's tape knows
    # tensors by Python object; `w` reaches the oh tape as a new wrapper, so the outer
    # tf.GradientTape misses d g / d w. Not silent: a RuntimeWarning names the op.
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _tf_over_oh(watch_w=False, below=below)
    assert any(issubclass(w.category, RuntimeWarning) and "tape.watch" in str(w.message)
               and "op Mul" in str(w.message) for w in caught)
    # The workaround the warning names gives TensorFlow's values, without a warning.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _tf_over_oh(watch_w=True, below=below)
    assert not [w for w in caught if "oh.GradientTape: a tf.GradientTape" in str(w.message)]
    for g, w in zip(got, _tf_over_tf()):
        np.testing.assert_allclose(_value(g), w.numpy(), rtol=1e-5, atol=1e-6)


def test_oh_tape_over_oh_tape_needs_no_watch():
    # oh.GradientTape outside keys by handle: the same program gives TensorFlow's values.
    x = tf.constant([0.3, -1.2, 2.0])
    with oh.GradientTape() as outer:
        outer.watch(x)
        w = x * 2.0
        with oh.GradientTape() as inner:
            inner.watch(x)
            y = tf.reduce_sum(tf.sin(x) * w)
        g = inner.gradient(y, x)
    got = outer.gradient(g, [x, w])
    for g, w in zip(got, _tf_over_tf()):
        np.testing.assert_allclose(_value(g), w.numpy(), rtol=1e-5, atol=1e-6)


def test_the_lost_dependence_warning_comes_once_per_process_not_per_step():
    import warnings  # pylint: disable=import-outside-toplevel
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _tf_over_oh(watch_w=False, below=None)
    assert len([w for w in caught if "oh.GradientTape: a tf.GradientTape" in str(w.message)]) == 1
