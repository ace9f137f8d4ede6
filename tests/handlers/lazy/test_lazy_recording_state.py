"""oh.Lazy over a tape keeps the recording state each op was recorded in: an op deferred
while the tape records is recorded, one deferred while the tape is paused
(`stop_recording`) or TensorFlow's recording is stopped is not, whenever its value is
requested. Compared with tf.GradientTape without Lazy (values and None)."""
import pytest
import tensorflow as tf

import tf_ophandlers as oh

from conftest import assert_same_tensors


def _program(tape, x, w, where):
    y = x * x
    with tape.stop_recording():
        z = y * 3.0 + tf.sin(x)
        if where == "inside":
            float(tf.reduce_sum(z))  # a value request while paused
    if where == "after":
        float(tf.reduce_sum(z))
    v = tf.tanh(z * w) + y
    return tf.reduce_sum(v), z


@pytest.mark.parametrize("where", ["exit", "inside", "after"])
@pytest.mark.parametrize("jit", [False, True])
def test_stop_recording_of_a_tape_below(where, jit):
    x = tf.random.stateless_normal([3, 4], seed=[1, 2])
    w = tf.random.stateless_normal([3, 4], seed=[3, 4])
    results = []
    for ours in (False, True):
        Tape = oh.GradientTape if ours else tf.GradientTape
        with Tape(persistent=True) as tape:
            tape.watch([x, w])
            if ours:
                with oh.Lazy(jit_compile=jit):
                    loss, z = _program(tape, x, w, where)
            else:
                loss, z = _program(tape, x, w, where)
        results.append([loss, z] + tape.gradient(loss, [x, w]) + tape.gradient(z, [x, w]))
    want, got = results
    assert got[4] is None and got[5] is None  # z was computed while paused
    for a, b in zip(want[:4], got[:4]):
        assert_same_tensors(a, b, tol=1e-5)


def test_ops_deferred_before_a_pause_are_recorded():
    x = tf.constant([1.0, 2.0])
    with oh.GradientTape() as tape:
        tape.watch(x)
        with oh.Lazy() as lazy:
            y = x * x            # deferred while recording
            with tape.stop_recording():
                pass             # the pause runs it first: recorded
            loss = tf.reduce_sum(y)
    assert lazy.flushes >= 1
    assert_same_tensors(tape.gradient(loss, x), 2.0 * x)
