"""A tape around an accumulator around a vectorized_map (fuzz finding OH_FUZZ_SEED=89
slow case 39: DataFormat > GradientTape > CheckNumerics > ForwardAccumulator >
vectorized_map > PassThrough, the gradient of [t7, jvp(t7)] wrt y differed from the
reference). oh's value was right: tf.vectorized_map calls a traced function even
eagerly, and TensorFlow's tape outside an accumulator around a function call does not
differentiate the JVPs it computed (their gradient is None). The fuzz reference for such
stacks is now a loop over the examples, which TensorFlow differentiates eagerly.
"""
import contextlib

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

from test_differential import _same


def _per_example(e):
    a = tf.reshape(e, [2, 2])
    return tf.matmul(a, a, transpose_b=True)  # its JVP depends on the primal


def _data():
    r = np.random.default_rng(0)
    return [tf.constant(r.standard_normal((3, 4)).astype(np.float32)) for _ in range(2)]


def _run(Tape, Acc, vmap):
    y, v = _data()
    with Tape(persistent=True) as t:
        t.watch(y)
        with Acc([y], [v]) as acc:
            out = vmap(_per_example, y)
        j = acc.jvp(out)
    return [out, j, t.gradient([out, j], y), t.gradient(j, y)]


def _loop(f, y):  # TensorFlow eagerly, one example at a time
    return tf.stack([f(y[k]) for k in range(y.shape[0])])


_HANDLERS = {"none": contextlib.nullcontext, "DataFormat": oh.DataFormat,
             "CheckNumerics": oh.CheckNumericsHandler}


@pytest.mark.parametrize("handler", sorted(_HANDLERS))
def test_gradient_of_a_jvp_of_vectorized_map_is_tensorflows_eager_one(handler):
    want = _run(tf.GradientTape, tf.autodiff.ForwardAccumulator, _loop)
    with _HANDLERS[handler]():  # (above the tape, as in the fuzz case)
        got = _run(oh.GradientTape, oh.ForwardAccumulator, oh.vectorized_map)
    _same(want, got, "GradientTape > ForwardAccumulator > vectorized_map (%s)" % handler)


def test_tensorflows_vectorized_map_drops_the_gradient_of_the_jvp():
    # Why the fuzz reference loops: if this fails, TensorFlow differentiates the JVPs of
    # a call now, and tf.vectorized_map can be the reference again (_known_limitation).
    got = _run(tf.GradientTape, tf.autodiff.ForwardAccumulator, tf.vectorized_map)
    want = _run(tf.GradientTape, tf.autodiff.ForwardAccumulator, _loop)
    assert got[3] is None and want[3] is not None
    _same(want[:2], got[:2], "values and JVPs agree")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_fuzz_seed_89_slow_case_39():
    # The fuzz case itself (differed before the reference loop: all 8 elements of the
    # gradient wrt y, e.g. -0.135 (oh, right) vs -0.946 (tf.vectorized_map)).
    import test_fuzz_stacks as stacks  # (its tests are not collected here)
    seed, i = 90, 39
    stack = stacks.Stack(seed * 1000 + i)
    program = stacks.Program(seed * 1000 + 500 + i, (3, 8))
    assert not stacks._known_limitation(stack, program) and stack.map_loop
    stacks._run_case(stack, program, stacks.Program(seed * 1000 + 900 + i, (3, 8)))
