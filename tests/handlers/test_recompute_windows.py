"""The windows an eager oh.Recompute scope opens around the tape scopes of a function
traced inside it (recompute_graph._tape_enter, the Keras fit rule): only for the
program's step, never for a function oh.vectorized_map traces for its own use; a
gradient taken inside a window (an HVP's inner tape, TensorFlow's forward accumulator)
makes the window's records first; a tape opened inside a window gets exactly the records
TensorFlow's tapes would. Compared with the same fresh tf.function without Recompute."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

from test_differential import _same  # values, dtypes, shapes, IndexedSlices, None

_QUIET = pytest.mark.filterwarnings("ignore::RuntimeWarning")


class _Setup:
    def __init__(self, seed=3, batch=4):
        r = np.random.default_rng(seed)
        keras.utils.set_random_seed(seed)
        self.x = tf.constant(r.standard_normal((batch, 3)).astype(np.float32))
        self.w = tf.Variable(r.standard_normal((3, 3)).astype(np.float32) * 0.5)
        self.model = keras.Sequential([keras.layers.Input((3,)),
                                       keras.layers.Dense(2, activation="tanh")])

    def variables(self):
        return [self.w] + list(self.model.trainable_variables)

    def loss(self, x):
        h = tf.tanh(tf.tanh(x @ self.w) @ self.w)
        return tf.reduce_sum(self.model(h) ** 2)


def _both(make_step, setup):
    """The step's results without Recompute and traced inside an eager oh.Recompute
    scope (fresh tf.functions, unknown batch dimension)."""
    spec = [tf.TensorSpec([None, 3], tf.float32)]
    ref = tf.function(make_step(setup), input_signature=spec)(setup.x)
    rc = oh.Recompute()
    with rc:
        got = tf.function(make_step(setup), input_signature=spec)(setup.x)
    return ref, got, rc


@_QUIET
@pytest.mark.parametrize("acc_type", [tf.autodiff.ForwardAccumulator,
                                      oh.ForwardAccumulator], ids=["tf", "oh"])
def test_hvp_inside_the_tape_of_a_step_traced_in_an_eager_scope(acc_type):
    # Was HandlerError ("tape.gradient called inside an oh.Recompute scope of a traced
    # function"): the step's tape got a window and the HVP's gradients (the inner tape's,
    # TensorFlow's JVP helper's) ran inside it.
    def make_step(s):
        def step(x):
            with tf.GradientTape() as outer:
                outer.watch(x)
                with acc_type(s.w, tf.ones_like(s.w)) as acc:
                    with tf.GradientTape() as inner:
                        loss = s.loss(x)
                    g = inner.gradient(loss, s.w)
                hvp = acc.jvp(g)
                total = loss + tf.reduce_sum(hvp * hvp)
            return [loss, g, hvp] + outer.gradient(total, [x] + s.variables())
        return step
    ref, got, _ = _both(make_step, _Setup())
    _same(ref, got, "HVP inside the tape of a step traced in an eager Recompute scope")


@_QUIET
def test_a_tape_opened_inside_a_window_gets_the_records_tensorflow_gives_it():
    # Was HandlerError (the inner tape's gradient runs inside the outer tape's window);
    # with the window's records made only at its exit, the inner tape would have none,
    # and with all of them, the ops before it opened too (h0 -> x below: TensorFlow's
    # inner tape does not see them, so d z / d x is None there).
    def make_step(s):
        def step(x):
            with tf.GradientTape() as outer:
                outer.watch(x)
                h0 = tf.tanh(x @ s.w)
                with tf.GradientTape(persistent=True) as inner:
                    inner.watch(x)
                    inner.watch(h0)
                    z = s.loss(h0) + tf.reduce_sum(tf.tanh(h0 @ s.w))
                gz = inner.gradient(z, [x, h0, s.w])
                total = z + tf.reduce_sum(gz[1] ** 2)
            return [z] + gz + outer.gradient(total, [x] + s.variables())
        return step
    ref, got, _ = _both(make_step, _Setup(5))
    assert ref[1] is None  # TensorFlow's answer this checks: h0 came before `inner`
    _same(ref, got, "a tape opened inside a step's window")


@_QUIET
def test_the_step_window_still_recomputes():
    # The rule still applies to the step: segments are recorded (graph_stats) and the
    # gradients are TensorFlow's.
    def make_step(s):
        def step(x):
            with tf.GradientTape() as tape:
                loss = s.loss(x)
            return [loss] + tape.gradient(loss, s.variables())
        return step
    ref, got, rc = _both(make_step, _Setup(7))
    _same(ref, got, "a step traced in an eager Recompute scope")
    assert rc.graph_stats is not None and rc.graph_stats["segments"] > 0


@_QUIET
def test_functions_vectorized_map_traces_get_no_windows():
    # oh.vectorized_map under a tf.GradientTape runs tf.vectorized_map, whose pfor
    # function is traced inside the eager scope: it is not the program's step, its tapes
    # get no window (before: windows, and graph_stats from them).
    s = _Setup(9)

    def per_example(e):
        with tf.GradientTape() as t:
            t.watch(e)
            y = s.loss(e[None])
        return tf.concat([t.gradient(y, e), [y]], 0)

    def run(vmap):
        with tf.GradientTape() as tape:
            out = vmap(per_example, s.x)
            loss = tf.reduce_sum(out ** 2)
        return [out] + tape.gradient(loss, s.variables())

    ref = run(tf.vectorized_map)
    rc = oh.Recompute()
    with rc:
        got = run(oh.vectorized_map)
    _same(ref, got, "Recompute > tf.GradientTape > oh.vectorized_map")
    assert rc.graph_stats is None
