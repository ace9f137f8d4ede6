"""Deferred execution must not change which side effects happen.

Eagerly, an invalid op raises where it is issued, so a variable update or a print after
it never happens. `oh.Async` keeps that (its queue stops at the error); `oh.Lazy` records
the invalid op and used to run the update at once, raising only at the value request.
Each program runs under plain TensorFlow and under each handler; the variable's value,
the error type and what was printed must be eager's.
"""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

HANDLERS = {
    "Async": oh.Async,
    "Lazy": oh.Lazy,
    "Lazy_chunks": lambda: oh.Lazy(chunk_ops=1),
    "Lazy_xla": lambda: oh.Lazy(jit_compile=True),
}


def _update_after_invalid_op(v, x):
    y = tf.reshape(x, [3])  # invalid: 4 elements into 3
    v.assign_add(tf.ones([4]))
    return y


def _update_after_invalid_chain(v, x):
    h = tf.tanh(x) * 2.0
    y = tf.reshape(h, [3]) + 1.0
    v.assign(v * 10.0)
    return y


def _scatter_after_invalid_matmul(v, x):
    y = tf.matmul(tf.reshape(x, [2, 2]), tf.ones([3, 1]))  # incompatible shapes
    v.scatter_nd_update([[0]], [7.0])
    return y


PROGRAMS = [_update_after_invalid_op, _update_after_invalid_chain, _scatter_after_invalid_matmul]


def _run(program, make):
    v = tf.Variable([1.0, 2.0, 3.0, 4.0])
    x = tf.constant([1.0, 2.0, 3.0, 4.0])
    error = None
    try:
        if make is None:
            program(v, x)
        else:
            with make():
                program(v, x)
    except tf.errors.OpError as e:
        error = type(e)
    return error, v.numpy()


@pytest.mark.parametrize("program", PROGRAMS, ids=[p.__name__ for p in PROGRAMS])
@pytest.mark.parametrize("name", sorted(HANDLERS))
def test_no_side_effect_after_an_invalid_op(program, name):
    want_error, want_value = _run(program, None)
    assert want_error is tf.errors.InvalidArgumentError
    got_error, got_value = _run(program, HANDLERS[name])
    assert got_error is want_error
    np.testing.assert_array_equal(got_value, want_value)


@pytest.mark.parametrize("name", sorted(HANDLERS))
def test_print_after_an_invalid_op_does_not_print(name, capfd):
    x = tf.constant([1.0, 2.0, 3.0, 4.0])

    def program():
        y = tf.reshape(x, [3])
        tf.print("side effect")
        return y

    with pytest.raises(tf.errors.InvalidArgumentError):
        program()
    eager_out = capfd.readouterr().err
    with pytest.raises(tf.errors.InvalidArgumentError):
        with HANDLERS[name]():
            program()
    assert capfd.readouterr().err == eager_out
    assert "side effect" not in eager_out


@pytest.mark.parametrize("name", sorted(HANDLERS))
def test_valid_program_keeps_values_and_updates(name):
    def program(v, x):
        y = tf.reshape(tf.tanh(x), [2, 2])
        v.assign_add(tf.reshape(y, [4]))
        r = v.read_value() * 2.0  # a read between updates
        v.assign(r)
        return tf.reduce_sum(y)

    v0 = tf.Variable([1.0, 2.0, 3.0, 4.0])
    want = program(v0, tf.constant([1.0, 2.0, 3.0, 4.0]))
    v1 = tf.Variable([1.0, 2.0, 3.0, 4.0])
    with HANDLERS[name]():
        got = program(v1, tf.constant([1.0, 2.0, 3.0, 4.0]))
        got = float(got)
    np.testing.assert_allclose(got, float(want), rtol=1e-5)
    np.testing.assert_allclose(v1.numpy(), v0.numpy(), rtol=1e-5)


def test_variable_reads_do_not_run_pending_ops():
    # Reading state has no side effect: the pending ops stay pending (one function at
    # the value request, not one per read).
    v = tf.Variable([1.0, 2.0])
    x = tf.constant([3.0, 4.0])
    with oh.Lazy() as lazy:
        y = tf.tanh(x) * 2.0
        r = v.read_value() + 1.0
        z = y * r
        assert lazy.flushes == 0
        value = z.numpy()
    np.testing.assert_allclose(value, (tf.tanh(x) * 2.0 * (v + 1.0)).numpy(), rtol=1e-6)
    assert lazy.flushes == 1
