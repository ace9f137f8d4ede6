"""oh.GradientTape keeps only what gradients read: as TensorFlow's tape
(OpGradientUnusedInputIndices / OpGradientUnusedOutputIndices), a record drops the inputs
and outputs its op's gradient function does not read, on the C and the Python recording
paths, with gradients unchanged; the tape then holds fewer bytes."""
import gc
import json
import weakref

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from recompute_helpers import run_bfc
from conftest import assert_same_tensors
from tf_ophandlers.handlers.gradient_tape.exclusions import ALL, used_indices


class PythonRecordingTape(oh.GradientTape):
    """The tape with its Python recording (the reference of cc/handlers/gradient_tape/tape_record.cc)."""

    after_execute = oh.GradientTape._after_execute_python  # pylint: disable=protected-access


def test_used_indices_follow_tensorflows_gradient_functions():
    # Values of TensorFlow's generated tables (pywrap_gradient_exclusions.cc), read from
    # the installed gradient functions.
    assert used_indices("Relu") == (frozenset(), frozenset({0}))  # reads its output only
    assert used_indices("Tanh") == (frozenset(), frozenset({0}))
    assert used_indices("Sin") == (frozenset({0}), frozenset())  # reads its input only
    assert used_indices("BiasAdd") == (frozenset(), frozenset())  # reads neither
    assert used_indices("Conv2D") == (frozenset({0, 1}), frozenset())
    assert used_indices("FusedBatchNormV3") == (frozenset({0, 1, 3, 4}),
                                                frozenset({3, 4, 5}))
    # Our own ops, op types without a gradient, and those read as a whole: kept whole.
    assert used_indices("CopyOn") == (ALL, ALL)
    assert used_indices("NoSuchOpType") == (ALL, ALL)
    assert used_indices("AddN")[0] is ALL


def _program(tape, x, w):
    tape.watch(x)
    h = tf.matmul(x, w)  # MatMul reads its inputs, not its output
    r = tf.nn.relu(h)  # Relu reads its output, not its input h
    s = tf.nn.bias_add(r, tf.ones([w.shape[1]]))  # BiasAdd reads nothing
    t = tf.tanh(s)  # reads its output: s is read by nothing
    return tf.reduce_sum(t * t), (h, s)


@pytest.mark.parametrize("cls", [oh.GradientTape, PythonRecordingTape])
def test_unread_values_are_freed_and_gradients_unchanged(cls):
    x = tf.random.stateless_normal([4, 5], seed=[1, 2])
    w = tf.random.stateless_normal([5, 3], seed=[3, 4])
    with tf.GradientTape(persistent=True) as ref:
        want, _ = _program(ref, x, w)
        ref.watch(w)
    want_grads = ref.gradient(want, [x, w])
    with cls() as tape:
        tape.watch(w)
        y, (h, s) = _program(tape, x, w)
        # The tape's values of h and s (the representations its records would keep).
        refs = [weakref.ref(tape._level_of(h)), weakref.ref(tape._level_of(s))]  # pylint: disable=protected-access
        del h, s
    gc.collect()
    assert [r() for r in refs] == [None, None], "the tape still holds unread values"
    got = tape.gradient(y, [x, w])
    assert_same_tensors(want_grads, got)


@pytest.mark.parametrize("cls", [oh.GradientTape, PythonRecordingTape])
def test_dropped_output_of_a_multi_output_op_gets_zeros(cls):
    # FusedBatchNormV3's gradient reads none of its first three outputs; the gradient of
    # batch_mean alone needs zeros of y's shape for y (kept as a spec, not the tensor).
    x = tf.random.stateless_normal([2, 3, 3, 4], seed=[5, 6])
    scale, offset = tf.ones([4]), tf.zeros([4])

    def f(tape):
        tape.watch(x)
        y, mean, var = tf.compat.v1.nn.fused_batch_norm(x, scale, offset, is_training=True)[:3]
        return tf.reduce_sum(mean * 3.0) + tf.reduce_sum(var), y

    with tf.GradientTape() as ref:
        want, _ = f(ref)
    with cls() as tape:
        got, y = f(tape)
        rec = tape._producer[tape._id_of(tape._level_of(y))]  # pylint: disable=protected-access
        assert rec.op_type == "FusedBatchNormV3" and rec.outputs[0] is None
        assert rec.ids[2][0] == (tf.float32.as_datatype_enum, (2, 3, 3, 4))
    assert_same_tensors(ref.gradient(want, x), tape.gradient(got, x))


def test_records_stay_whole_under_a_tensorflow_tape():
    # A tf.GradientTape around may differentiate the gradient computation: as with
    # TensorFlow's nested tapes, the inner records then keep every tensor.
    x = tf.constant([0.3, -1.2, 2.0])
    with tf.GradientTape() as outer:
        outer.watch(x)
        with oh.GradientTape() as inner:
            inner.watch(x)
            y = tf.reduce_sum(tf.tanh(tf.sin(x)))
            (record,) = [r for r in inner._producer.values() if r.op_type == "Sin"]  # pylint: disable=protected-access
            assert record.outputs[0] is not None
        g = inner.gradient(y, x)
    with tf.GradientTape() as o2:
        o2.watch(x)
        with tf.GradientTape() as i2:
            i2.watch(x)
            y2 = tf.reduce_sum(tf.tanh(tf.sin(x)))
        g2 = i2.gradient(y2, x)
    assert_same_tensors([g2, o2.gradient(g2, x)], [g, outer.gradient(g, x)])


def test_tape_keeps_what_tensorflows_tape_keeps():
    """A Keras conv/batch-norm/relu stack, eager: the bytes the tape holds at the end of
    the forward pass (BFC allocator) are TensorFlow's (they were 1.3x before), with
    gradients equal."""
    out = run_bfc("""
        import json
        import numpy as np, tensorflow as tf, keras, tf_ophandlers as oh
        keras.utils.set_random_seed(0)
        layers = []
        for _ in range(4):
            layers += [keras.layers.Conv2D(16, 3, padding="same", use_bias=False),
                       keras.layers.BatchNormalization(), keras.layers.ReLU()]
        model = keras.Sequential(layers + [keras.layers.GlobalAveragePooling2D(),
                                           keras.layers.Dense(10)])
        x = tf.random.normal([8, 32, 32, 16])
        model(x)
        info = tf.config.experimental.get_memory_info
        res = {}
        for kind in ("oh", "tf", "oh"):
            base = info("CPU:0")["current"]
            with (tf.GradientTape() if kind == "tf" else oh.GradientTape()) as tape:
                loss = tf.reduce_sum(model(x, training=False) ** 2)
            kept = info("CPU:0")["current"] - base
            grads = tape.gradient(loss, model.trainable_variables)
            res[kind] = (kept, [g.numpy().tolist() for g in grads])
        print(json.dumps({k: v[0] for k, v in res.items()}))
        for a, b in zip(res["tf"][1], res["oh"][1]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    """)
    kept = json.loads(out.strip().splitlines()[-1])
    assert kept["oh"] <= 1.05 * kept["tf"], kept


def _parts_alive_in_producer_gradient(tape_cls):
    """A value used twice: its two gradient parts (made by the consumers' gradient
    functions) are summed before its producer's gradient function runs. Returns how
    many of the parts are still alive then, and the gradient."""
    parts = []

    @tf.custom_gradient
    def consumer(v):
        def grad(g):
            part = g * 2.0
            parts.append(weakref.ref(part))
            return part
        return tf.identity(v), grad

    alive = []

    @tf.custom_gradient
    def producer(v):
        def grad(g):
            gc.collect()
            alive.append(sum(r() is not None for r in parts))
            return g * 3.0
        return v * 3.0, grad

    x = tf.random.stateless_normal([64, 64], seed=[5, 6])
    with tape_cls() as tape:
        tape.watch(x)
        y = producer(x)
        loss = tf.reduce_sum(consumer(y)) + tf.reduce_sum(consumer(y))
    grad = tape.gradient(loss, x)
    assert len(parts) == 2, parts
    return alive, grad


def test_gradient_parts_are_freed_once_summed_as_by_tensorflows_tape():
    # TensorFlow's tape sums a value's gradient parts (AggregateGradients takes their
    # references) and frees them before the gradient function of the value's producer
    # runs; a tape holding them through that call holds twice a value's bytes more.
    want_alive, want = _parts_alive_in_producer_gradient(tf.GradientTape)
    alive, got = _parts_alive_in_producer_gradient(oh.GradientTape)
    assert want_alive == [0]
    assert alive == want_alive
    np.testing.assert_allclose(got.numpy(), want.numpy())
