"""A replayed function runs through TensorFlow's graph optimizer (grappler) like the
function it replays. It is called as one op (core/functions/call.py `CompiledCall`); that op
used to lack the attributes TensorFlow's own call path gives a function call
(`config_proto`, `executor_type`), and the runtime then instantiated it without grappler:
no Conv2D+BiasAdd or MatMul+BiasAdd fusion, no pruning, so a replayed CNN ran slower than
its twin. The optimizer settings of the context are followed as TensorFlow follows them."""
import collections

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

import tf_ophandlers as oh
from tf_ophandlers.core.functions import call as function_calls


def _post_optimization_ops(run):
    """Op counts of the graphs the runtime instantiated while `run()` ran (the functions
    it optimized and the nodes it kept), merged over all functions."""
    ctx = context.context()
    ctx.enable_run_metadata()
    try:
        out = run()
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
    counts = collections.Counter()
    for graph in metadata.function_graphs:
        counts.update(n.op for n in graph.post_optimization_graph.node)
    return out, counts


def _cnn():
    w = tf.constant(np.random.RandomState(0).randn(3, 3, 3, 4).astype(np.float32))
    b = tf.constant(np.arange(4, dtype=np.float32))
    dense = tf.constant(np.random.RandomState(1).randn(4, 5).astype(np.float32))
    c = tf.constant(np.arange(5, dtype=np.float32))

    def channels_first(x):  # NCHW, what the CPU kernels refuse without the handler
        y = tf.nn.conv2d(x, w, 1, "SAME", data_format="NCHW")
        y = tf.nn.relu(tf.nn.bias_add(y, b, data_format="NCHW"))
        return tf.nn.bias_add(tf.matmul(tf.reduce_mean(y, [2, 3]), dense), c)

    def channels_last(x):  # its twin
        y = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, w, 1, "SAME"), b))
        return tf.nn.bias_add(tf.matmul(tf.reduce_mean(y, [1, 2]), dense), c)

    return channels_first, channels_last


def _fused(counts):
    return {k: v for k, v in counts.items() if k.startswith("_Fused")}


def test_a_replayed_function_is_optimized_like_tensorflows_own_call():
    first, last = _cnn()
    x = tf.random.stateless_normal([2, 3, 8, 8], seed=[3, 4])
    xl = tf.transpose(x, [0, 2, 3, 1])
    twin, twin_ops = _post_optimization_ops(lambda: tf.function(last)(xl))

    def replayed():
        with oh.DataFormat():
            return oh.copy_off(tf.function(first)(x))

    got, ops = _post_optimization_ops(replayed)
    np.testing.assert_allclose(got.numpy(), twin.numpy(), rtol=1e-5, atol=1e-5)
    assert _fused(twin_ops), twin_ops  # TensorFlow fuses this CNN on the CPU
    assert _fused(ops) == _fused(twin_ops), (ops, twin_ops)
    assert "Conv2D" not in ops and "MatMul" not in ops, ops
    # Hits of the replay cache run the instantiated (optimized) function again: no new
    # replay, and the call op (the runtime's kernel cache key) is not rebuilt.
    f = tf.function(first)
    before = set(function_calls._cache)  # pylint: disable=protected-access
    with oh.DataFormat():
        oh.copy_off(f(x))
    new = [k for k in function_calls._cache if k not in before]  # pylint: disable=protected-access
    assert len(new) == 1
    compiled = function_calls._cache[new[0]].compiled  # pylint: disable=protected-access
    call_op = compiled.op()
    for _ in range(3):
        with oh.DataFormat():
            np.testing.assert_allclose(oh.copy_off(f(x)).numpy(), twin.numpy(), rtol=1e-5,
                                       atol=1e-5)
    assert compiled.op() is call_op
    assert [k for k in function_calls._cache if k not in before] == new  # pylint: disable=protected-access


@pytest.fixture
def meta_optimizer_off():
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": False})


def test_a_replayed_function_follows_the_contexts_optimizer_options(meta_optimizer_off):
    first, last = _cnn()
    x = tf.random.stateless_normal([2, 3, 8, 8], seed=[5, 6])
    twin, twin_ops = _post_optimization_ops(
        lambda: tf.function(last)(tf.transpose(x, [0, 2, 3, 1])))

    def replayed():
        with oh.DataFormat():
            return oh.copy_off(tf.function(first)(x))

    got, ops = _post_optimization_ops(replayed)
    np.testing.assert_allclose(got.numpy(), twin.numpy(), rtol=1e-5, atol=1e-5)
    # Grappler off: TensorFlow's function runs its Conv2D unfused, and so does the replay.
    # (In a long process the runtime may report more functions for the twin's call, so
    # only the unfused Conv2D is compared there.)
    assert twin_ops["Conv2D"] >= 1, twin_ops
    assert not _fused(ops) and ops["Conv2D"] == 1 and ops["MatMul"] == 1, ops


class _UnoptimizedDataFormat(oh.DataFormat):
    optimize_replays = False


def test_a_handler_can_opt_its_replays_out_of_the_optimizer():
    """`optimize_replays = False` (oh.Mesh): the replay is instantiated without grappler
    (its Conv2D unfused; the default handler's is fused, first test), same values."""
    first, last = _cnn()
    x = tf.random.stateless_normal([2, 3, 8, 8], seed=[7, 8])
    twin = tf.function(last)(tf.transpose(x, [0, 2, 3, 1]))
    f = tf.function(first)
    before = set(function_calls._cache)  # pylint: disable=protected-access

    def replayed():
        with _UnoptimizedDataFormat():
            return oh.copy_off(f(x))

    got, ops = _post_optimization_ops(replayed)
    np.testing.assert_allclose(got.numpy(), twin.numpy(), rtol=1e-5, atol=1e-5)
    (key,) = [k for k in function_calls._cache if k not in before]  # pylint: disable=protected-access
    assert function_calls._cache[key].compiled.optimized is False  # pylint: disable=protected-access
    assert ops["Conv2D"] >= 1, ops
