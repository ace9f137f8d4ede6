"""oh.DataFormat fuzz: random chains of ops on NCHW inputs, including ops whose meaning
depends on a hidden axis (Cumsum, ReverseV2, GatherV2, OneHot, TopKV2, a 4-D MatMul,
Einsum, LRN on the logical last axis, Softmax on an axis, StridedSlice), against plain
TensorFlow on the same logical data (values and dtypes, every intermediate), eagerly and
in a fresh tf.function. Layout-sensitive ops in the reference run as their channels-last
twins between transposes (the CPU refuses NCHW convolutions and pools)."""
import contextlib
import os
import random

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

NHWC, NCHW = [0, 2, 3, 1], [0, 3, 1, 2]


def _conv(x, rng, ref):
    c = x.shape[1]
    w = tf.constant(rng.normal(0, 0.3, (3, 3, c, 4)).astype(x.dtype.as_numpy_dtype))
    if ref:
        return tf.transpose(tf.nn.conv2d(tf.transpose(x, NHWC), w, 1, "SAME"), NCHW)
    return tf.nn.conv2d(x, w, 1, "SAME", data_format="NCHW")


def _pool(x, rng, ref):
    if ref:
        return tf.transpose(tf.nn.max_pool2d(tf.transpose(x, NHWC), 2, 1, "SAME"), NCHW)
    return tf.nn.max_pool2d(x, 2, 1, "SAME", data_format="NCHW")


def _same(fn):
    return lambda x, rng, ref: fn(x, rng)


def _axis(rng):
    return int(rng.randint(1, 4))


OPS = {
    "conv": _conv,
    "pool": _pool,
    "relu": _same(lambda x, rng: tf.nn.relu(x)),
    "scale_channels": _same(lambda x, rng: x * tf.constant(
        rng.uniform(0.5, 1.5, (1, x.shape[1], 1, 1)).astype(x.dtype.as_numpy_dtype))),
    "bias_add": _same(lambda x, rng: tf.nn.bias_add(x, tf.constant(
        rng.normal(0, 1, (x.shape[1],)).astype(x.dtype.as_numpy_dtype)), data_format="NCHW")),
    "cumsum": _same(lambda x, rng: tf.cumsum(x, axis=_axis(rng))),
    "reverse": _same(lambda x, rng: tf.reverse(x, axis=[_axis(rng)])),
    "gather": _same(lambda x, rng: (lambda a: tf.gather(
        x, [0, x.shape[a] - 1, 0], axis=a))(_axis(rng))),
    "one_hot_sum": _same(lambda x, rng: x + tf.reduce_sum(tf.one_hot(
        tf.argmax(x, axis=3), x.shape[3], dtype=x.dtype), axis=-1, keepdims=True)),
    "top_k": _same(lambda x, rng: tf.math.top_k(x, k=min(2, x.shape[3])).values),
    "matmul_4d": _same(lambda x, rng: tf.matmul(x, x, transpose_b=True) * 0.1),
    "einsum": _same(lambda x, rng: tf.einsum("nchw,c->nchw", x, tf.range(
        1, x.shape[1] + 1, dtype=x.dtype))),
    "lrn_logical_last": _same(lambda x, rng: tf.nn.local_response_normalization(
        tf.cast(x, tf.float32), depth_radius=1) if x.dtype == tf.float32 else x),
    "lrn_channels": _same(lambda x, rng: tf.transpose(tf.nn.local_response_normalization(
        tf.transpose(x, NHWC), depth_radius=2), NCHW) if x.dtype == tf.float32 else x),
    "softmax_axis": _same(lambda x, rng: tf.nn.softmax(x, axis=_axis(rng))),
    "strided_slice": _same(lambda x, rng: x[:, ::-1, :, ::2] if x.shape[3] > 1 else x),
    "mean_keepdims": _same(lambda x, rng: tf.reduce_mean(x, axis=_axis(rng), keepdims=True)
                           + x),
    "concat": _same(lambda x, rng: (lambda a: tf.concat([x, x * 2], axis=a))(_axis(rng))),
    "pad": _same(lambda x, rng: tf.pad(x, [[0, 0], [0, 1], [1, 0], [0, 0]])),
    "cast64": _same(lambda x, rng: tf.cast(x, tf.float64)),
    "cast32": _same(lambda x, rng: tf.cast(x, tf.float32)),
}
NAMES = sorted(OPS)


def _chain(seed):
    rng = np.random.RandomState(seed)
    names = ["conv"] + [NAMES[i] for i in rng.randint(0, len(NAMES), size=5)]
    return names


def _run(names, x, seed, ref):
    rng = np.random.RandomState(1000 + seed)
    outs = []
    for name in names:
        if x.shape[2] * x.shape[3] * x.shape[1] > 4000:  # keep sizes small
            x = x[:, :, :4, :4]
        x = OPS[name](x, rng, ref)
        outs.append(x)
    return outs


def _compare(got, want, names):
    for k, (g, w) in enumerate(zip(got, want)):
        where = "after %s (chain %s)" % (names[k], names)
        assert g.dtype == w.dtype, where
        assert g.shape == w.shape, where
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=2e-4, atol=2e-4, err_msg=where)


@pytest.mark.parametrize("seed", range(24))
def test_random_chain_eager(seed):
    names = _chain(seed)
    x = tf.random.stateless_normal([2, 3, 6, 5], seed=[seed, 1])
    want = _run(names, x, seed, ref=True)
    with oh.DataFormat() as df:
        got = _run(names, x, seed, ref=False)
    _compare(got, want, names)
    assert df.converted_ranks == {4}  # the chain starts with an NCHW conv


@pytest.mark.parametrize("seed", range(24, 30))
def test_random_chain_in_a_function(seed):
    names = _chain(seed)
    x = tf.random.stateless_normal([2, 3, 6, 5], seed=[seed, 1])
    want = _run(names, x, seed, ref=True)
    f = tf.function(lambda a: _run(names, a, seed, ref=False))
    with oh.DataFormat():
        got = f(x)
    _compare(got, want, names)


def test_lrn_is_computed_on_the_logical_last_axis():
    """LRN has no data_format: its depth is the last axis of the tensor it is given. On
    an NCHW tensor kept channels-last, the handler must give TensorFlow's answer on the
    logical tensor (normalizing along W), not along the physical last axis (C)."""
    x = tf.random.stateless_normal([2, 3, 6, 5], seed=[9, 9])
    w = tf.random.stateless_normal([1, 1, 3, 7], seed=[8, 8])
    ref_h = tf.transpose(tf.nn.conv2d(tf.transpose(x, NHWC), w, 1, "SAME"), NCHW)
    with oh.DataFormat() as df:
        h = tf.nn.conv2d(x, w, 1, "SAME", data_format="NCHW")
        y = tf.nn.local_response_normalization(h, depth_radius=2)
        y_channels = tf.transpose(tf.nn.local_response_normalization(
            tf.transpose(h, NHWC), depth_radius=2), NCHW)
    np.testing.assert_allclose(
        y.numpy(), tf.nn.local_response_normalization(ref_h, depth_radius=2).numpy(),
        rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y_channels.numpy(), tf.transpose(
        tf.nn.local_response_normalization(tf.transpose(ref_h, NHWC), depth_radius=2),
        NCHW).numpy(), rtol=1e-5, atol=1e-5)
    assert df.fallbacks["LRN"] == 1  # the logical-axis one transposes back; not the other


# -- gradients: random NCHW chains under a tape ---------------------------------------
# oh.DataFormat inside or around oh.GradientTape (or inside tf.GradientTape), eager or
# the chain in a fresh tf.function, against tf.GradientTape on the reference chain:
# gradients of every intermediate w.r.t. the input and a per-channel scale variable.
GRAD_SEEDS = range(100, 100 + int(os.environ.get("OH_DATA_FORMAT_GRAD_SEEDS", "8")))


def _gradients(names, x, scale, seed, ref, nesting, in_function):
    chain = lambda a: _run(names, a * scale, seed, ref)  # noqa: E731
    if in_function:
        chain = tf.function(chain)
    Tape = tf.GradientTape if ref or nesting == "tf_tape_outside" else oh.GradientTape
    df = contextlib.nullcontext() if ref else oh.DataFormat()
    inner = contextlib.nullcontext() if nesting == "tape_inside" else df
    outer = df if nesting == "tape_inside" else contextlib.nullcontext()
    with outer:
        with Tape() as t:
            t.watch(x)
            with inner:
                outs = chain(x)
        grads = t.gradient(outs, [x, scale])
    return outs, grads


@pytest.mark.parametrize("seed", GRAD_SEEDS)
def test_random_chain_gradients_match_tensorflow(seed):
    rng = random.Random(seed)
    names = _chain(seed)
    nesting = rng.choice(["tape_inside", "tape_outside", "tf_tape_outside"])
    in_function = rng.random() < 0.4
    x = tf.random.stateless_normal([2, 3, 6, 5], seed=[seed, 2])
    scale = tf.Variable(tf.random.stateless_uniform([1, 3, 1, 1], [seed, 3], 0.5, 1.5))
    want_outs, want = _gradients(names, x, scale, seed, True, nesting, in_function)
    got_outs, got = _gradients(names, x, scale, seed, False, nesting, in_function)
    _compare(got_outs, want_outs, names)
    what = "gradients, %s, %s" % (nesting, "tf.function" if in_function else "eager")
    _compare(got, want, names + [what])
