"""Two accumulators and oh.vectorized_map (fuzz finding OH_FUZZ_SEED=100 slow case 4:
vectorized_map > ForwardAccumulator > OpCounter > ForwardAccumulator, eager). The outer
accumulator's JVP of the inner's JVP of a reshape was None where tf.vectorized_map's is
zeros. Accumulators opened inside tf.vectorized_map's traced function compute each JVP
as a call, as eagerly: an outer accumulator gives every output of the call a tangent.
oh.ForwardAccumulator took the in-function pattern (ops on the tangents only: None)
whenever a map was open; now only for a map above it (the ops came through the map).
"""
import contextlib

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

from test_differential import _same

# ops whose JVP does not read the primal: None or zeros below is the pattern's choice
_OPS = {
    "reshape": lambda e: tf.reshape(e, [-1, 2, 2]),
    "transpose": tf.transpose,
    "sum": lambda e: tf.reduce_sum(e, 0),
    "neg": tf.negative,
    "add_constant": lambda e: e + tf.constant([1.0, 2.0, 3.0, 4.0]),
    "concat_split": lambda e: tf.split(tf.concat([e, e * 0.0 + 1.0], -1), [3, 5], -1)[0],
    "gather": lambda e: tf.gather(e, [1, 3], axis=-1),
    "sin": tf.sin,  # (its JVP reads the primal: a value, both ways)
}


def _data():
    r = np.random.default_rng(0)
    return [tf.constant(r.standard_normal((3, 2, 4)).astype(np.float32)) for _ in range(3)]


def _none_as_empty(t):  # a map's outputs are tensors: None -> an empty one (both sides)
    return tf.zeros([0]) if t is None else t


def _map_over_accumulators(op, ours, between):
    """vectorized_map > ForwardAccumulator > (between) > ForwardAccumulator > op."""
    Acc = oh.ForwardAccumulator if ours else tf.autodiff.ForwardAccumulator

    def per_example(args):
        e, t1, t2 = args
        with Acc([e], [t1]) as outer:
            with between() if ours else contextlib.nullcontext():
                with Acc([e], [t2]) as inner:
                    y = op(e)
            j = inner.jvp(y)
        return [y, j, _none_as_empty(outer.jvp(y)), _none_as_empty(outer.jvp(j))]
    vmap = oh.vectorized_map if ours else tf.vectorized_map
    return vmap(per_example, tuple(_data()))


def _accumulator_over_map(op, ours):
    """ForwardAccumulator > vectorized_map > ForwardAccumulator > op."""
    Acc = oh.ForwardAccumulator if ours else tf.autodiff.ForwardAccumulator
    vmap = oh.vectorized_map if ours else tf.vectorized_map
    x, t1, t2 = _data()
    with Acc([x], [t1]) as outer:
        def per_example(args):
            e, t = args
            with Acc([e], [t]) as inner:
                y = op(e)
            return [y, _none_as_empty(inner.jvp(y))]
        y, j = vmap(per_example, (x, t2))
    return [y, j, outer.jvp(y), outer.jvp(j)]


@pytest.mark.parametrize("between", ["none", "OpCounter"])
@pytest.mark.parametrize("op", sorted(_OPS))
def test_nested_accumulators_inside_vectorized_map(op, between):
    make = {"none": contextlib.nullcontext, "OpCounter": oh.native.OpCounter}[between]
    _same(_map_over_accumulators(_OPS[op], False, make),
          _map_over_accumulators(_OPS[op], True, make),
          "vectorized_map > ForwardAccumulator > %s > ForwardAccumulator > %s" % (between, op))


@pytest.mark.parametrize("op", sorted(_OPS))
def test_accumulator_around_vectorized_map_around_an_accumulator(op):
    _same(_accumulator_over_map(_OPS[op], False), _accumulator_over_map(_OPS[op], True),
          "ForwardAccumulator > vectorized_map > ForwardAccumulator > %s" % op)


def test_nested_accumulators_over_a_called_function_in_vectorized_map():
    # Found with the op table above, a tf.function per example: an op without a JVP
    # rule of its own (TensorFlow's construction, traced as a call while the function is
    # replayed) raised AssertionError from TensorFlow's _override_gradient_function: the
    # map's pfor conversion of a JVP op called a tf.function while the call's gradient
    # override was active (core/functions/symbolic.py lifts it). Compared: the values
    # and first-order JVPs. (The outer JVP of the inner JVP is None here where
    # tf.vectorized_map's is zeros: open, CHANGELOG.md's known limitations.)
    f = tf.function(lambda e: tf.reduce_max(e, 1), autograph=False)
    results = []
    for ours in (False, True):
        Acc = oh.ForwardAccumulator if ours else tf.autodiff.ForwardAccumulator

        def per_example(args):
            e, t1, t2 = args
            with Acc([e], [t1]) as outer:
                with Acc([e], [t2]) as inner:
                    y = f(e)
                j = inner.jvp(y)
            return [y, j, outer.jvp(y)]
        vmap = oh.vectorized_map if ours else tf.vectorized_map
        results.append(vmap(per_example, tuple(_data())))
    _same(results[0], results[1], "vectorized_map > ForwardAccumulator > ForwardAccumulator "
          "> a tf.function (reduce_max)")
