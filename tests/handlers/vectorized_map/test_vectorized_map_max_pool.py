"""Second order of a max pool under oh.vectorized_map (fuzz finding: vectorized_map >
OpHandler > DataFormat > tf.GradientTape > GradientTape > CheckNumerics in a function,
OH_FUZZ_SEED=64 slow case 34). The program is a called tf.function: the map replays it
and its gradient calls into graphs, where TensorFlow's MaxPoolGradGrad kernel gave zeros
(SAME, stride 1: it reuses its gradient input's buffer, the batching rule's folding
reshape, and zeros it before reading it). The reference is TensorFlow's per-example loop
run eagerly (TensorFlow's own graphs can hit the same kernel bug)."""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

_rng = np.random.default_rng(7)
_NORMAL = _rng.standard_normal((3, 2, 4, 4, 2)).astype(np.float32)
# After a relu (as the fuzzers' programs): ties at zero, the first maximum of a window.
IMAGES = {"normal": tf.constant(_NORMAL), "ties": tf.constant(np.maximum(_NORMAL, 0.0))}


def _program(strides, padding):
    def prog(img):
        pooled = tf.nn.max_pool2d(img, 2, strides, padding)
        return tf.reduce_sum(tf.exp(tf.tanh(pooled)))
    return prog


def _second_order(tape_cls, prog, squared=False):
    def per_example(img):
        with tape_cls() as outer:
            outer.watch(img)
            with tape_cls() as inner:
                inner.watch(img)
                y = prog(img)
            g = inner.gradient(y, img)
            # squared: g's seed of ones would make MaxPoolGradGrad's gradient input
            # uniform, blind to which element (or image) a window's maximum names
            target = tf.reduce_sum(g * g) if squared else g
        return outer.gradient(target, img)
    return per_example


@pytest.mark.parametrize("squared", [False, True], ids=["grad", "grad_squared"])
@pytest.mark.parametrize("called", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("tape_cls", [tf.GradientTape, oh.GradientTape],
                         ids=["tf_tape", "oh_tape"])
@pytest.mark.parametrize("strides,padding", [(1, "SAME"), (1, "VALID"), (2, "SAME")])
@pytest.mark.parametrize("images", sorted(IMAGES))
def test_second_order_of_max_pool_per_example(images, strides, padding, tape_cls, called,
                                              squared):
    prog, images = _program(strides, padding), IMAGES[images]
    want = tf.stack([_second_order(tf.GradientTape, prog, squared)(images[i])
                     for i in range(images.shape[0])])
    assert np.any(want.numpy() != 0)  # (the wrong answer was zeros)
    body = _second_order(tape_cls, tf.function(prog) if called else prog, squared)
    got = oh.vectorized_map(body, images)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [tf.float64, tf.float16, tf.bfloat16])
@pytest.mark.parametrize("padding", ["SAME", "VALID"])
def test_second_order_overlapping_windows_other_dtypes(padding, dtype):
    """3x3 windows at stride 2 on 5x5 images share rows and columns (an element can be
    the maximum of several windows), values rounded to one decimal (ties inside a
    window), in the float types MaxPoolWithArgmax and MaxPoolGradGrad both take."""
    images = tf.cast(np.round(_rng.standard_normal((3, 1, 5, 5, 2)), 1), dtype)

    def prog(img):
        return tf.reduce_sum(tf.exp(tf.tanh(tf.nn.max_pool2d(img, 3, 2, padding))))
    want = tf.stack([_second_order(tf.GradientTape, prog, True)(images[i])
                     for i in range(images.shape[0])])
    got = oh.vectorized_map(_second_order(oh.GradientTape, prog, True), images)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 1e-6 if dtype == tf.float64 else 3e-2
    np.testing.assert_allclose(tf.cast(got, tf.float64).numpy(),
                               tf.cast(want, tf.float64).numpy(), rtol=tol, atol=tol)
