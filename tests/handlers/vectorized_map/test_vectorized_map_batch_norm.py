"""Fused batch norm and its gradient in oh.vectorized_map with the loop fallback off,
against tf.vectorized_map (FusedBatchNormGradV3 had no rule and pfor's
conversion of FusedBatchNormV3 failed at run time on its scalar reserve space)."""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_same_tensors

RNG = np.random.default_rng(11)
IMAGES = tf.constant(RNG.standard_normal((3, 2, 4, 4, 5)).astype(np.float32))
SCALE = tf.constant(RNG.standard_normal(5).astype(np.float32))
OFFSET = tf.constant(RNG.standard_normal(5).astype(np.float32))


def train_and_grad(x, data_format="NHWC"):
    if data_format == "NCHW":
        x = tf.transpose(x, [0, 3, 1, 2])
    y, mean, var, r1, r2, r3 = tf.raw_ops.FusedBatchNormV3(
        x=x, scale=SCALE, offset=OFFSET, mean=tf.zeros([0]), variance=tf.zeros([0]),
        is_training=True, data_format=data_format)
    dx, dscale, doffset, _, _ = tf.raw_ops.FusedBatchNormGradV3(
        y_backprop=y * y, x=x, scale=SCALE, reserve_space_1=r1, reserve_space_2=r2,
        reserve_space_3=r3, is_training=True, data_format=data_format)
    return y, mean, var, dx, dscale, doffset


def inference(x):
    return tf.raw_ops.FusedBatchNormV3(
        x=x, scale=SCALE, offset=OFFSET, mean=OFFSET, variance=tf.abs(SCALE),
        is_training=False)[0]


def per_example_scale(e):
    x, scale = e
    return tf.raw_ops.FusedBatchNormV3(
        x=x, scale=scale, offset=OFFSET, mean=tf.zeros([0]), variance=tf.zeros([0]),
        is_training=True)[0]


@pytest.mark.parametrize("fn,elems", [
    (train_and_grad, lambda: IMAGES),
    (lambda x: train_and_grad(x, "NCHW"), lambda: IMAGES),
    (inference, lambda: IMAGES),
    (per_example_scale, lambda: (IMAGES, tf.stack([SCALE, SCALE * 2., -SCALE]))),
], ids=["train_and_grad", "train_and_grad_nchw", "inference", "per_example_scale"])
def test_values_without_the_loop_fallback(fn, elems):
    want = tf.vectorized_map(fn, elems(), fallback_to_while_loop=False)
    got = oh.vectorized_map(fn, elems(), fallback_to_while_loop=False)
    assert_same_tensors(want, got, tol=1e-4)


def test_per_example_gradients_through_fused_batch_norm():
    """Per-example gradients with a tape inside the map: TensorFlow's gradient of
    FusedBatchNormV3 is FusedBatchNormGradV3 (Keras 3's BatchNormalization does not use
    the fused kernel, and its moving-statistics update inside a map is refused, see the
    guide's "State updates")."""
    kernel = tf.constant(RNG.standard_normal((5, 4)).astype(np.float32))

    def per_example(x, tape_type):
        with tape_type() as tape:
            tape.watch([kernel, SCALE, OFFSET])
            h = tf.einsum("nhwc,cd->nhwd", x, kernel)
            y, _, _ = tf.compat.v1.nn.fused_batch_norm(h, SCALE[:4], OFFSET[:4],
                                                       is_training=True)
            loss = tf.reduce_sum(tf.nn.relu(y) ** 2)
        return tape.gradient(loss, [kernel, SCALE, OFFSET])

    want = tf.vectorized_map(lambda x: per_example(x, tf.GradientTape), IMAGES,
                             fallback_to_while_loop=False)
    got = oh.vectorized_map(lambda x: per_example(x, oh.GradientTape), IMAGES,
                            fallback_to_while_loop=False)
    assert_same_tensors(want, got, tol=1e-4)
