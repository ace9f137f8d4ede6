"""Conv2DBackpropInput (tf.nn.conv2d_transpose, and the input gradient of a convolution)
in oh.vectorized_map with the loop fallback off, against tf.vectorized_map (a
convolution's gradient inside the mapped function takes `input_sizes` from
ShapeN, which the pfor fallback returned batched, and pfor's converter needs it loop
invariant)."""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_same_tensors

RNG = np.random.default_rng(40)
IMAGES = tf.constant(RNG.standard_normal((3, 5, 5, 2)).astype(np.float32))
UP = tf.constant(RNG.standard_normal((3, 3, 4, 2)).astype(np.float32))  # transpose conv
KERNEL = tf.constant(RNG.standard_normal((3, 3, 2, 4)).astype(np.float32))


def transpose_conv(x):
    return tf.nn.conv2d_transpose(x[None], UP, output_shape=[1, 10, 10, 4], strides=2,
                                  padding="SAME")[0]


def conv_input_gradient(x, tape_type):
    with tape_type() as tape:
        tape.watch([x, KERNEL])
        y = tf.nn.conv2d(x[None], KERNEL, strides=1, padding="VALID")
        loss = tf.reduce_sum(tf.sin(y))
    return tape.gradient(loss, [x, KERNEL])


def transpose_conv_gradient(x, tape_type):
    with tape_type() as tape:
        tape.watch([x, UP])
        loss = tf.reduce_sum(transpose_conv(x) ** 2)
    return tape.gradient(loss, [x, UP])


def test_conv2d_transpose_without_the_loop_fallback():
    want = tf.vectorized_map(transpose_conv, IMAGES, fallback_to_while_loop=False)
    got = oh.vectorized_map(transpose_conv, IMAGES, fallback_to_while_loop=False)
    assert_same_tensors(want, got, tol=1e-4)


@pytest.mark.parametrize("traced", [False, True], ids=["eager_fn", "tf_function_fn"])
@pytest.mark.parametrize("fn", [conv_input_gradient, transpose_conv_gradient],
                         ids=["conv_input_gradient", "transpose_conv_gradient"])
def test_per_example_gradients_inside_the_map(fn, traced):
    """A tape inside the mapped function: tf.GradientTape under tf.vectorized_map against
    oh.GradientTape under oh.vectorized_map (and, traced, the tf.function replayed)."""
    want = tf.vectorized_map(lambda x: fn(x, tf.GradientTape), IMAGES,
                             fallback_to_while_loop=False)
    mapped = lambda x: fn(x, oh.GradientTape)  # pylint: disable=unnecessary-lambda-assignment
    if traced:
        mapped = tf.function(lambda x: fn(x, tf.GradientTape))
    got = oh.vectorized_map(mapped, IMAGES, fallback_to_while_loop=False)
    assert_same_tensors(want, got, tol=1e-4)


def test_gradient_through_the_map():
    """A tape outside: the gradient of the batched Conv2DBackpropInput (Conv2D and
    Conv2DBackpropFilter of the folded batch)."""
    def grads(vectorized_map, tape_type):
        with tape_type() as tape:
            tape.watch([IMAGES, UP])
            y = vectorized_map(transpose_conv, IMAGES, fallback_to_while_loop=False)
            loss = tf.reduce_sum(tf.sin(y))
        return y, tape.gradient(loss, [IMAGES, UP])

    assert_same_tensors(grads(tf.vectorized_map, tf.GradientTape),
                        grads(oh.vectorized_map, oh.GradientTape), tol=1e-4)


def test_inside_a_fresh_function():
    @tf.function
    def step(x):
        return oh.vectorized_map(lambda e: conv_input_gradient(e, tf.GradientTape), x,
                                 fallback_to_while_loop=False)
    want = tf.vectorized_map(lambda e: conv_input_gradient(e, tf.GradientTape), IMAGES,
                             fallback_to_while_loop=False)
    assert_same_tensors(want, step(IMAGES), tol=1e-4)


def test_per_example_filter_is_refused_as_tensorflow():
    """pfor's converter needs the filter loop invariant (ValueError with the fallback
    off); so does the rule."""
    def fn(elems):
        x, up = elems
        return tf.nn.conv2d_transpose(x[None], up, output_shape=[1, 10, 10, 4], strides=2,
                                      padding="SAME")[0]
    elems = (IMAGES, tf.stack([UP, 2. * UP, -UP]))
    with pytest.raises(ValueError):
        tf.vectorized_map(fn, elems, fallback_to_while_loop=False)
    with pytest.raises(ValueError, match="Conv2DBackpropInput"):
        oh.vectorized_map(fn, elems, fallback_to_while_loop=False, warn=False)
    # With the fallback on both run it once per example.
    assert_same_tensors(tf.vectorized_map(fn, elems), oh.vectorized_map(fn, elems, warn=False),
                        tol=1e-4)
