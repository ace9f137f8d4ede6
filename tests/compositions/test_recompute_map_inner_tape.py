"""oh.Recompute inside oh.vectorized_map with an oh.GradientTape on each side of the map
(GradientTape > vectorized_map > GradientTape > Recompute): a per-example Jacobian-like
gradient whose result is differentiated again outside. The scope's segments were recorded
on every tape, the outer one included, whose inputs are per-example: HandlerError "a
per-example tensor cannot be copied off". The scope now
runs its ops as they are there, as with no tape inside the map (a warning)."""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh


@pytest.mark.parametrize("function", [False, True])
def test_recompute_under_a_tape_inside_a_map_under_a_tape(function):
    r = np.random.default_rng(0)
    xs = tf.constant(r.standard_normal((3, 4)).astype(np.float32))
    W = tf.Variable(r.standard_normal((4, 4)).astype(np.float32))

    def loss(e):
        return tf.reduce_sum(tf.sin(tf.linalg.matvec(W, e)) * e)
    body = tf.function(loss, autograph=False) if function else loss

    def run(ours):
        tape = oh.GradientTape if ours else tf.GradientTape

        def per_example(e):
            with tape() as t:
                t.watch(e)
                if ours:
                    with oh.Recompute():
                        y = body(e)
                else:
                    y = body(e)
            return t.gradient(y, e)
        with tape() as outer:
            outer.watch(xs)
            g = (oh.vectorized_map if ours else tf.vectorized_map)(per_example, xs)
            s = tf.reduce_sum(g ** 2)
        return [g] + outer.gradient(s, [xs, W])

    want = run(False)
    with pytest.warns(RuntimeWarning, match="vectorized_map is between"):
        got = run(True)
    for w, g in zip(want, got):
        assert type(g) is type(w)
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-5)
