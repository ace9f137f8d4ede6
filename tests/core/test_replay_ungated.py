"""Replayed functions run on devices without the output gate of automatic control
dependencies (core/functions/ungated.py), with TensorFlow's results and ordering."""
import gc

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context

import tf_ophandlers as oh
from tf_ophandlers.core.functions import call as function_calls
from tf_ophandlers.core.functions import ungated

from conftest import assert_close


def _new_entry(before):
    (key,) = [k for k in function_calls._cache if k not in before]  # pylint: disable=protected-access
    return function_calls._cache[key]  # pylint: disable=protected-access


def _gate_noops(fdef):
    return [n.name for n in fdef.node_def if n.op == "NoOp" and n.input]


def test_stateful_replay_runs_ungated_with_tensorflows_values_and_order():
    def body(v, w, x):
        old = v.read_value()            # read before the write: the old value
        v.assign_add(x)
        w.assign(v * 2.0)               # after v's update: reads the new v
        return old, v.read_value() + w.read_value()

    step, ref_step = tf.function(body), tf.function(body)
    ref_v, ref_w = tf.Variable(1.0), tf.Variable(0.0)
    v, w = tf.Variable(1.0), tf.Variable(0.0)
    log = oh.OpLogHandler()
    before = set(function_calls._cache)  # pylint: disable=protected-access
    for x in (2.0, 3.0, -1.0):
        want = ref_step(ref_v, ref_w, tf.constant(x))
        with log:
            got = step(v, w, tf.constant(x))
        assert_close(got[0], want[0])
        assert_close(got[1], want[1])
        assert_close(v, ref_v)
        assert_close(w, ref_w)
    entry = _new_entry(before)
    name = entry.compiled.ungated
    assert name is not None
    original = entry.compiled.function.function_def
    copy = context.context().get_function_def(name)
    assert _gate_noops(original) and not _gate_noops(copy)
    assert dict(copy.control_ret) == dict(original.control_ret)  # nothing can be pruned
    assert len(copy.node_def) == len(original.node_def) - len(_gate_noops(original))
    # Reads and writes of one variable keep their own ordering edges.
    assert sum(i.startswith("^") for n in copy.node_def for i in n.input) > 0


def test_ungated_copy_leaves_the_context_with_its_entry():
    v = tf.Variable([1.0, 2.0])

    @tf.function
    def f(x):
        v.assign_add(x)
        return v * 1.0

    before = set(function_calls._cache)  # pylint: disable=protected-access
    with oh.OpLogHandler():
        y = f(tf.constant([1.0, 1.0]))
    assert_close(y, [2.0, 3.0])
    entry = _new_entry(before)
    name = entry.compiled.ungated
    assert context.context().has_function(name)
    del entry
    function_calls.clear_cache()
    gc.collect()
    assert not context.context().has_function(name)


def test_functions_without_a_gate_are_left_alone():
    f = tf.function(lambda x: tf.sin(x) * 2.0).get_concrete_function(tf.TensorSpec([2]))
    assert ungated.ungated_function_def(f.function_def, "unused") is None
    assert ungated.ungated_copy(f) is None


def test_a_noop_used_otherwise_is_not_removed():
    v = tf.Variable(1.0)
    f = tf.function(lambda: v.assign_add(1.0) + 0.0).get_concrete_function()
    fdef = f.function_def
    assert ungated.ungated_function_def(fdef, "x") is not None
    edited = type(fdef)()
    edited.CopyFrom(fdef)
    gate = _gate_noops(edited)[0]
    extra = edited.node_def.add()  # another op waits for the gate: keep everything
    extra.name, extra.op = "waits", "NoOp"
    extra.input.append("^" + gate)
    assert ungated.ungated_function_def(edited, "x") is None


def test_mesh_replayed_step_is_ungated_and_equals_single_device_training():
    mesh = oh.Mesh({"batch": 2, "model": 2}, ["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    rng = np.random.default_rng(0)
    x0, y0 = rng.normal(size=[8, 4]).astype("float32"), rng.normal(size=[8, 4]).astype("float32")
    w0 = rng.normal(size=[4, 6]).astype("float32")
    u0 = rng.normal(size=[6, 4]).astype("float32")

    @tf.function
    def step(x, y, w, u):
        with tf.GradientTape() as tape:
            err = tf.matmul(tf.nn.relu(tf.matmul(x, w)), u) - y
            loss = tf.reduce_mean(err * err)
        gw, gu = tape.gradient(loss, [w, u])
        w.assign_sub(0.1 * gw)
        u.assign_sub(0.1 * gu)
        return loss

    rw, ru = tf.Variable(w0), tf.Variable(u0)
    with mesh:
        x, y = mesh.shard(x0, ("batch", None)), mesh.shard(y0, ("batch", None))
        w = tf.Variable(mesh.shard(w0, (None, "model")))
        u = tf.Variable(mesh.shard(u0, ("model", None)))
    before = set(function_calls._cache)  # pylint: disable=protected-access
    for _ in range(3):
        want = step(tf.constant(x0), tf.constant(y0), rw, ru)
        with mesh:
            got = step(x, y, w, u)
        np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    np.testing.assert_allclose(mesh.unshard(w.read_value()), rw.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mesh.unshard(u.read_value()), ru.numpy(), rtol=1e-5, atol=1e-6)
    assert mesh.layout_of(w) == (None, "model")
    assert not mesh.fallbacks
    entries = [function_calls._cache[k] for k in function_calls._cache if k not in before]  # pylint: disable=protected-access
    assert any(e.compiled.ungated for e in entries)
