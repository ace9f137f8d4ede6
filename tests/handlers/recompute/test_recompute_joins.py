"""oh.Recompute's sqrt policy on a residual network: segments end at joins (a residual
add), where one value is live, instead of inside a block, where the block's input (the
shortcut) is live besides the value the segment ends on. Checked through `rc.stats`
(bytes the tapes keep, segments), which do not depend on the allocator, and gradients
against tf.GradientTape's."""

import numpy as np
import tensorflow as tf

import tf_ophandlers as oh
import recompute_helpers

BATCH, SIZE, CH, BLOCKS = 4, 16, 16, 10


def _residual_cnn(rng):
    """`(f, variables, value_bytes)`: a stem convolution and BLOCKS residual blocks
    `h = relu(h + conv(relu(conv(h))))` of CH channels on SIZE x SIZE inputs; f(x) is
    the mean square of the output. Every activation has value_bytes."""
    def w(cin):
        return tf.Variable(rng.standard_normal((3, 3, cin, CH)).astype(np.float32)
                           / (3 * cin ** 0.5))
    stem = w(3)
    blocks = [(w(CH), w(CH)) for _ in range(BLOCKS)]

    def conv(h, k):
        return tf.nn.conv2d(h, k, 1, "SAME")

    def f(x):
        h = tf.nn.relu(conv(x, stem))
        for w1, w2 in blocks:
            h = tf.nn.relu(h + conv(tf.nn.relu(conv(h, w1)), w2))
        return tf.reduce_mean(h * h)
    return f, [stem] + [v for b in blocks for v in b], BATCH * SIZE * SIZE * CH * 4


def test_segments_of_a_residual_network_end_at_joins():
    """Each segment keeps one activation (the value after a residual add) for the
    backward pass: the tapes keep at most segments x value_bytes (before, segments
    ended inside blocks and kept the shortcut besides: about 1.5x more per segment).
    Gradients equal tf.GradientTape's, from the second step on (the planned one)."""
    rng = np.random.default_rng(0)
    f, variables, value_bytes = _residual_cnn(rng)
    x = tf.constant(rng.standard_normal((BATCH, SIZE, SIZE, 3)).astype(np.float32))
    with tf.GradientTape() as ref:
        want = f(x)
    expected = ref.gradient(want, variables)
    rc = oh.Recompute()
    for _ in range(2):  # the second step plans with the first one's size
        with oh.GradientTape() as tape:
            with rc:
                loss = f(x)
        got = tape.gradient(loss, variables)
        recompute_helpers.assert_grads(expected, got)
        np.testing.assert_allclose(loss.numpy(), want.numpy(), rtol=1e-6)
    stats = rc.stats
    assert stats["segments"] >= 3, stats  # (checkpointed at all)
    # One activation per segment, plus the loss's scalars.
    assert stats["kept"] <= stats["segments"] * value_bytes + 1024, (
        stats["kept"], stats["segments"], value_bytes)
    # Every op still recomputed once in the backward pass: nothing kept besides.
    assert stats["recomputed"]["Conv2D"] == 2 * BLOCKS + 1, stats["recomputed"]
