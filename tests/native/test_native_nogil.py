"""The C++ handlers' no-GIL path (cc/native/native_execute.cc NativeNoGilExecute) and the
dispatcher device's placement callback (cc/boundary/device.cc DeviceShallPin), each against plain
TensorFlow."""
import collections
import threading

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers import _C


def _nogil_ops():
    return _C.fast_stats()["nogil_ops"]


def _chain(a, b):
    x = tf.add(a, b)
    x = tf.nn.relu(x * 3.0 - b)
    y = tf.matmul(x, b, transpose_b=True)
    s = tf.reduce_sum(y, axis=1)
    u = tf.unstack(y, axis=0)
    return [x, y, s, tf.cast(s, tf.int32), tf.shape(y), u[0]]


# (oh.native.PassThrough has no execute hook since ABI version 4: it forwards on the GIL
# fast path, tests/native/test_abi_v4.py; OpCounter's execute hook runs without the GIL.)
@pytest.mark.parametrize("make", [oh.native.OpCounter])
def test_c_handler_over_physical_runs_without_the_gil_and_matches_tensorflow(make):
    a = tf.random.stateless_uniform([4, 3], seed=[1, 2])
    b = tf.random.stateless_uniform([4, 3], seed=[3, 4])
    want = _chain(a, b)
    before = _nogil_ops()
    with make():
        a1, b1 = tf.identity(a), tf.identity(b)
        got = _chain(a1, b1)
        got2 = _chain(a1, b1)  # the stack is remembered now
    assert _nogil_ops() - before >= len(want)
    for g, g2, w in zip(got, got2, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6)
        np.testing.assert_allclose(g2.numpy(), w.numpy(), rtol=1e-6)


def test_counter_counts_ops_of_the_no_gil_path_exactly():
    a = tf.ones([2, 2])
    counter = oh.native.OpCounter()
    log = oh.OpLogHandler()
    before = _nogil_ops()
    with counter:
        x = tf.identity(a)
        for _ in range(20):
            x = tf.add(x, a)
    assert _nogil_ops() - before >= 19
    with log:
        y = tf.identity(a)
        for _ in range(20):
            y = tf.add(y, a)
    assert counter.counts == {"Identity": 1, "AddV2": 20}
    assert counter.counts == dict(collections.Counter(r.op_type for r in log.records))
    np.testing.assert_array_equal(x.numpy(), y.numpy())


def test_a_fresh_stack_is_not_mistaken_for_the_remembered_one():
    """Each new scope builds a new stack (maybe at a dead stack's address): the no-GIL
    path must count the op on the new handler, never the old one."""
    a = tf.ones([2])
    counters = []
    for _ in range(5):
        c = oh.native.OpCounter()
        with c:
            x = tf.identity(a)
            x = tf.add(x, a)
            x = tf.add(x, a)
        counters.append(c)
        np.testing.assert_array_equal(x.numpy(), [3.0, 3.0])
        del x
    for c in counters:
        assert c.counts == {"Identity": 1, "AddV2": 2}


def test_gradient_tape_over_c_handler_and_keras_with_a_partial_batch():
    model = tf.keras.Sequential([tf.keras.layers.Dense(5, activation="tanh"),
                                 tf.keras.layers.Dense(2)])
    x = tf.random.stateless_normal([7, 3], seed=[5, 6])
    model(x)
    with tf.GradientTape() as tape:
        want = model(x)
        want_loss = tf.reduce_sum(want * want)
    want_grads = tape.gradient(want_loss, model.trainable_variables)
    with tf.GradientTape() as tape:
        with oh.native.PassThrough():
            got = model(x)
            got_loss = tf.reduce_sum(got * got)
    got_grads = tape.gradient(got_loss, model.trainable_variables)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(), w.numpy(), rtol=1e-5)

    @tf.function(input_signature=[tf.TensorSpec([None, 3])])
    def f(v):
        return model(v)

    with oh.native.PassThrough():
        for n in (7, 2):  # a partial last batch
            np.testing.assert_allclose(f(x[:n]).numpy(), model(x[:n]).numpy(), rtol=1e-5)


def test_threads_with_c_handlers_and_python_work_at_once():
    """Several threads run ops under their own C++ handler (without the GIL for most of
    each op) while another runs Python: no deadlock, each thread's own counts."""
    a = tf.random.stateless_uniform([8, 8], seed=[7, 8])
    want = (a + a) * a
    errors, counts = [], []

    def worker():
        try:
            c = oh.native.OpCounter()
            with c:
                for _ in range(50):
                    r = tf.multiply(tf.add(a, a), a)
                    np.testing.assert_allclose(r.numpy(), want.numpy(), rtol=1e-6)
            counts.append(c.counts)
        except Exception as e:  # reported below
            errors.append(e)

    def python_work():
        total = 0
        for i in range(200000):
            total += i
        counts.append(total)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    threads.append(threading.Thread(target=python_work))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    cs = [c for c in counts if isinstance(c, dict)]
    assert cs == [{"AddV2": 50, "Mul": 50}] * 3


def test_errors_of_the_no_gil_path_name_the_handler_and_the_op():
    a = tf.ones([2, 3])
    b = tf.ones([4, 5])
    with oh.native.OpCounter():
        x = tf.identity(a)
        tf.add(x, a)  # remembered
        with pytest.raises(tf.errors.InvalidArgumentError) as e:
            tf.matmul(x, b)
    assert "OpCounter" in str(e.value) and "MatMul" in str(e.value)


def test_placement_of_ops_with_handler_inputs_follows_tensorflow_rules():
    """DeviceShallPin answers TensorFlow's default rule: an op with a handler input and no
    requested device runs on the handler; a requested physical device wins (the input is
    copied off); a physical resource input keeps the op physical."""
    a = tf.constant([1.0, 2.0])
    c = oh.native.OpCounter()
    with c:
        x = tf.identity(a)
    v = tf.Variable([10.0, 20.0])
    y = x * 2.0  # type-based: runs on the handler
    with tf.device("/CPU:0"):
        z = x * 3.0  # a requested physical device: copied off, runs physically
    v.assign_add(x)  # a physical resource input: physical
    assert c.counts == {"Identity": 1, "Mul": 1}
    np.testing.assert_array_equal(y.numpy(), [2.0, 4.0])
    np.testing.assert_array_equal(z.numpy(), [3.0, 6.0])
    np.testing.assert_array_equal(v.numpy(), [11.0, 22.0])


def test_nested_c_handlers_take_the_gil_path_and_match_tensorflow():
    """Only a C/C++ handler that is the op's first stack and sits over PHYSICAL runs
    without the GIL; two nested levels run on the fast path with the GIL."""
    a = tf.random.stateless_uniform([4, 3], seed=[9, 10])
    b = tf.random.stateless_uniform([4, 3], seed=[11, 12])
    want = _chain(a, b)
    outer, inner = oh.native.OpCounter(), oh.native.OpCounter()
    with outer:
        with inner:
            a1, b1 = tf.identity(a), tf.identity(b)
            before = _nogil_ops()
            got = _chain(a1, b1)
            assert _nogil_ops() == before
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6)
    assert outer.counts == inner.counts and sum(inner.counts.values()) >= len(want)
