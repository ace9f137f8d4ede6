"""tf.gather's axis/batch_dims variants in oh.vectorized_map with the loop fallback off,
against tf.vectorized_map: per-example or shared params and indices."""
import itertools

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_same_tensors

RNG = np.random.default_rng(3)
PARAMS = tf.constant(RNG.standard_normal((4, 3, 5, 2)).astype(np.float32))
INDICES = tf.constant(RNG.integers(0, 2, (4, 3, 2)).astype(np.int32))

# (batch_dims, axis) valid for per-example params [3, 5, 2] and indices [3, 2]
_VARIANTS = [(0, 0), (0, 1), (0, 2), (0, -1), (1, 1), (1, 2), (-1, 1)]
_SIDES = {"both": (True, True), "params": (True, False), "indices": (False, True)}


def _fn(batch_dims, axis, side):
    per_params, per_indices = _SIDES[side]

    def fn(e):
        p = e[0] if per_params else PARAMS[0]
        i = e[1] if per_indices else INDICES[0]
        return tf.gather(p, i, axis=axis, batch_dims=batch_dims)
    return fn


@pytest.mark.parametrize("variant,side", list(itertools.product(_VARIANTS, _SIDES)),
                         ids=lambda v: str(v))
def test_gather_variants_without_the_loop_fallback(variant, side):
    fn = _fn(*variant, side)
    if (variant, side) == ((-1, 1), "indices"):
        # tf.vectorized_map's own conversion fails here ("Shapes must be equal rank");
        # tf.map_fn gives the per-example answer.
        want = tf.map_fn(fn, (PARAMS, INDICES), fn_output_signature=tf.float32)
    else:
        want = tf.vectorized_map(fn, (PARAMS, INDICES), fallback_to_while_loop=False)
    got = oh.vectorized_map(fn, (PARAMS, INDICES), fallback_to_while_loop=False)
    assert_same_tensors(want, got)


@pytest.mark.parametrize("variant", [(0, 1), (1, 2)], ids=str)
def test_gradient_of_shared_params_gathered_per_example(variant):
    batch_dims, axis = variant
    params = PARAMS[0]

    def run(vmap, tape_type):
        with tape_type() as tape:
            tape.watch(params)
            out = vmap(lambda i: tf.gather(params, i, axis=axis, batch_dims=batch_dims),
                       INDICES)
            loss = tf.reduce_sum(out * out)
        return tape.gradient(loss, params)

    assert_same_tensors(tf.convert_to_tensor(run(tf.vectorized_map, tf.GradientTape)),
                        tf.convert_to_tensor(run(oh.vectorized_map, oh.GradientTape)))
