"""oh.GradientTape over oh.vectorized_map whose pfor function returns a variable's handle
(a per-example tf.GradientTape of a gather: ResourceGather has no pfor converter, so the
while-loop fallback passes the handle through), against tf.GradientTape over
tf.vectorized_map: values, None pattern, dtype, dense vs tf.IndexedSlices."""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

from test_differential import _same  # values, dtypes, shapes, IndexedSlices, None


def _second_order(ours, divide):
    r = np.random.default_rng(0)
    v = tf.Variable(r.standard_normal((6, 4)).astype(np.float32))
    ys = tf.constant(r.standard_normal((2, 3, 4)).astype(np.float32))
    ids = tf.constant([[1, 2, 3], [0, 0, 5]])

    def fn(e):
        y, i = e
        with tf.GradientTape() as t:
            t.watch(y)
            g = tf.gather(v, i)
            out = tf.reduce_sum(g / (y * y + 1) if divide else g * y)
        return t.gradient(out, y)
    with (oh.GradientTape if ours else tf.GradientTape)(persistent=True) as outer:
        outer.watch(ys)
        g = (oh.vectorized_map if ours else tf.vectorized_map)(fn, (ys, ids))
    return [g] + outer.gradient(g, [ys, v])


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("divide", [True, False])
def test_tape_over_map_of_per_example_gradients_of_a_gather(divide):
    # OH_FUZZ_SEED=128 slow case 13 (Async > GradientTape > vectorized_map >
    # tf.GradientTape; also 120/1, 156/19): the handle output has no gradient, and
    # TensorFlow's backward function of the pfor call fills it with zeros of its
    # placeholder's handle-data shape, unknown there: ValueError "Cannot convert a
    # partially known TensorShape". The tape now gives zeros of the variable's shape.
    _same(_second_order(False, divide), _second_order(True, divide),
          "GradientTape > vectorized_map > tf.GradientTape over a gather")
