"""oh.GradientTape against tf.GradientTape on the same programs (autodiff
conformance): results of tapes whose scope closed, equal scalar sources, reset,
unusual dtypes, TensorFlow's messages and exception types, jacobian edge cases and a
tape re-entered inside a tf.function. Every case runs with both tapes and compares
values, shapes and dtypes (or exception types and messages)."""
import re

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

TAPES = (tf.GradientTape, oh.GradientTape)


def _flat(result):
    return tf.nest.flatten(result, expand_composites=True)


def assert_same(expected, actual):
    """Same structure, and per tensor the same dtype, shape and values (None for None)."""
    tf.nest.assert_same_structure(expected, actual, expand_composites=True)
    for e, a in zip(_flat(expected), _flat(actual)):
        if e is None or a is None:
            assert e is None and a is None, (e, a)
            continue
        e, a = tf.convert_to_tensor(e), tf.convert_to_tensor(a)
        assert e.dtype == a.dtype, (e, a)
        assert e.shape == a.shape, (e, a)
        np.testing.assert_allclose(np.asarray(e), np.asarray(a), rtol=1e-6, atol=1e-6)


def compare(program):
    """Runs `program(Tape)` with each tape; the results must agree."""
    expected, actual = (program(tape) for tape in TAPES)
    assert_same(expected, actual)
    return actual


def raised(program, tape):
    with pytest.raises(Exception) as info:
        program(tape)
    return info.value


def compare_errors(program):
    """`program(Tape)` raises with each tape: the same type, TensorFlow's message (after
    an optional prefix naming oh.GradientTape)."""
    expected, actual = (raised(program, tape) for tape in TAPES)
    assert type(actual) is type(expected), (expected, actual)
    message = str(actual)
    assert message == str(expected) or message == "oh.GradientTape: " + str(expected), (
        str(expected), message)


# -- 1. results of tapes whose scope closed are plain tensors --------------------------

def test_losses_of_two_training_steps_add():
    def program(tape_cls):
        w = tf.Variable(2.0)
        losses = []
        for _ in range(2):
            with tape_cls() as tape:
                loss = (w * 3.0 - 1.0) ** 2
            w.assign_sub(0.01 * tape.gradient(loss, w))
            losses.append(loss)
        return losses[0] + losses[1], w.read_value()
    compare(program)


def test_stack_of_outputs_of_two_tapes():
    def program(tape_cls):
        x = tf.constant([1.0, 2.0])
        outs = []
        for k in range(2):
            with tape_cls() as tape:
                tape.watch(x)
                outs.append(tf.sin(x) * float(k + 1))
        return tf.stack(outs), tf.concat(outs, 0)
    compare(program)


def test_outputs_of_two_tapes_in_a_function():
    add = tf.function(lambda a, b: a * b + a)

    def program(tape_cls):
        x = tf.constant(1.5)
        outs = []
        for k in range(2):
            with tape_cls() as tape:
                tape.watch(x)
                outs.append(x * float(k + 2))
        return add(*outs)
    compare(program)


def test_outputs_of_a_tape_and_of_a_nested_tape():
    def program(tape_cls):
        x = tf.constant(2.0)
        with tape_cls() as outer:
            outer.watch(x)
            a = x * x
            with tape_cls() as inner:
                inner.watch(x)
                b = x * 3.0
        with tape_cls() as other:
            other.watch(x)
            c = x + 1.0
        return a + b + c, outer.gradient(a, x)
    compare(program)


# The next two guard the limits of the rule above (they pass without it too): a tape's
# values are its own again when it is re-entered, and for tapes nested in it.
def test_persistent_tape_reentered_differentiates_earlier_values():
    def program(tape_cls):
        x = tf.constant(3.0)
        with tape_cls(persistent=True) as tape:
            tape.watch(x)
            y = x * x
        between = y + 1.0  # outside the scope: not recorded, as with tf.GradientTape
        with tape:
            z = y * 2.0 + between
        result = (tape.gradient(z, x), tape.gradient(y, x), tape.gradient(z, between),
                  between)
        del tape
        return result
    compare(program)


def test_nested_tapes_still_give_second_derivatives():
    def program(tape_cls):
        x = tf.constant(1.5)
        with tape_cls() as outer:
            outer.watch(x)
            with tape_cls() as inner:
                inner.watch(x)
                y = x ** 3
            dy = inner.gradient(y, x)
        return dy, outer.gradient(dy, x), dy + y
    compare(program)


def test_result_of_a_closed_tape_is_plain_for_the_next_op():
    # The op that uses a closed tape's result alone gives a plain tensor too, which
    # combines with a result of any other tape.
    def program(tape_cls):
        x = tf.constant(2.0)
        with tape_cls() as t1:
            t1.watch(x)
            y1 = x * 2.0
        doubled = y1 * 2.0
        with tape_cls() as t2:
            t2.watch(x)
            y2 = x * 5.0
        return tf.stack([doubled, y2]), oh.handler_of(doubled) is None
    expected, actual = (program(tape) for tape in TAPES)
    assert_same(expected[0], actual[0])
    assert actual[1]


# -- 2. equal scalar constants are distinct sources ------------------------------------

def test_equal_scalar_constants_are_distinct_sources():
    def program(tape_cls):
        x1 = tf.constant(3.0)
        x2 = tf.constant(3.0)
        with tape_cls(persistent=True) as tape:
            tape.watch(x1)
            tape.watch(x2)
            y = x1 + x2
        return tape.gradient(y, x1), tape.gradient(y, [x1, x2])
    compare(program)


def test_equal_scalars_powers():
    def program(tape_cls):
        a = tf.constant(2.0)
        b = tf.constant(2.0)
        with tape_cls() as tape:
            tape.watch([a, b])
            y = a ** 3 + b ** 2
        return tape.gradient(y, [a, b])
    compare(program)


def test_only_the_watched_one_of_equal_scalars_is_a_source():
    def program(tape_cls):
        a = tf.constant(2.0)
        b = tf.constant(2.0)
        with tape_cls(persistent=True) as tape:
            tape.watch(a)
            y = a * b
        return tape.gradient(y, a), tape.gradient(y, b), a, b
    compare(program)


def test_equal_scalars_float64_and_variables():
    def program(tape_cls):
        a = tf.constant(0.5, tf.float64)
        b = tf.constant(0.5, tf.float64)
        v1 = tf.Variable(2.0)
        v2 = tf.Variable(2.0)
        n = tf.constant(2)
        with tape_cls() as tape:
            tape.watch([a, b])
            y = tf.cast(a * tf.sin(b), tf.float32) * v1 + v2 * tf.cast(n, tf.float32)
        return tape.gradient(y, [a, b, v1, v2, n])
    compare(program)


def test_equal_scalars_watched_by_nested_tapes():
    def program(tape_cls):
        a = tf.constant(1.5)
        b = tf.constant(1.5)
        with tape_cls() as outer:
            outer.watch(a)
            with tape_cls() as inner:
                inner.watch([a, b])
                y = a * a * b
            g = inner.gradient(y, [a, b])
        return g, outer.gradient(g[0], a)
    compare(program)


def test_equal_scalars_created_in_the_scope_or_under_a_device():
    # TensorFlow's cache is keyed by the device scope a constant is created under too.
    def program(tape_cls):
        with tape_cls(persistent=True) as tape:
            a = tf.constant(2.0)
            b = tf.constant(2.0)
            tape.watch([a, b])
            y = a ** 3 + b ** 2
        with tf.device("/cpu:0"):
            d = tf.constant(5.0)
            e = tf.constant(5.0)
        with tape_cls() as other:
            other.watch(d)
            w = d * e
        return tape.gradient(y, [a, b]), other.gradient(w, d)
    compare(program)


# -- 5. reset ---------------------------------------------------------------------------

def test_reset_forgets_variables_read_before():
    def program(tape_cls):
        v = tf.Variable(1.0)
        w = tf.Variable(2.0)
        with tape_cls() as tape:
            y = v * 3.0
            tape.reset()
            z = w * 2.0
        names = [x.name for x in tape.watched_variables()]
        return names, tape.gradient([y, z], [v, w])
    expected, actual = (program(tape) for tape in TAPES)
    assert actual[0] == expected[0]
    assert_same(expected[1], actual[1])


# -- 6. unusual dtypes ------------------------------------------------------------------

def test_gradient_of_a_watched_string_tensor_is_none():
    def program(tape_cls):
        s = tf.constant(["a", "b"])
        with tape_cls() as tape:
            tape.watch(s)
        return tape.gradient(s, s)
    assert compare(program) is None


# -- 8. messages and exception types ----------------------------------------------------

def test_second_gradient_of_a_non_persistent_tape_message():
    def program(tape_cls):
        x = tf.constant(1.0)
        with tape_cls() as tape:
            tape.watch(x)
            y = x * x
        tape.gradient(y, x)
        tape.gradient(y, x)
    compare_errors(program)


def test_unknown_unconnected_gradients_message():
    def program(tape_cls):
        x = tf.constant(1.0)
        with tape_cls() as tape:
            tape.watch(x)
            y = x * x
        tape.gradient(y, x, unconnected_gradients="nonsense")
    compare_errors(program)


def test_batch_jacobian_first_dimension_message():
    def program(tape_cls):
        x = tf.ones([2, 3])
        with tape_cls() as tape:
            tape.watch(x)
            y = tf.ones([3, 3]) * tf.reduce_sum(x)
        tape.batch_jacobian(y, x)
    compare_errors(program)


@pytest.mark.parametrize("returned", [1, 3])
def test_backward_function_with_a_wrong_number_of_gradients(returned):
    from tensorflow.python.eager import record  # pylint: disable=import-outside-toplevel

    def program(tape_cls):
        a, b = tf.constant([2.0]), tf.constant([3.0])
        with tape_cls() as tape:
            tape.watch([a, b])
            z = tf.identity(a * b)
            record.record_operation("TwoInputs", [z], [a, b], lambda dz: [dz] * returned)
        tape.gradient(z, [a, b])
    compare_errors(program)


# -- 4. jacobian edge cases -------------------------------------------------------------

@pytest.mark.parametrize("use_pfor", [True, False])
def test_batch_jacobian_of_an_unconnected_output_is_zeros(use_pfor):
    constant = tf.function(lambda x: tf.zeros([2, 3]) + 1.0)

    def program(tape_cls):
        x = tf.ones([2, 3], tf.float64)
        with tape_cls(persistent=True) as tape:
            tape.watch(x)
            y = constant(x)
        return tape.batch_jacobian(y, x, experimental_use_pfor=use_pfor)
    compare(program)


@pytest.mark.parametrize("use_pfor", [True, False])
def test_batch_jacobian_of_a_target_without_elements(use_pfor):
    def program(tape_cls):
        x = tf.zeros([1, 0])
        with tape_cls(persistent=True) as tape:
            tape.watch(x)
            y = x ** 2
        return tape.batch_jacobian(y, x, experimental_use_pfor=use_pfor)
    compare(program)


def test_jacobian_of_an_empty_target_with_respect_to_a_variable():
    def program(tape_cls):
        v = tf.Variable(1.0)
        with tape_cls(persistent=True) as tape:
            y = tf.zeros([0, 7]) * v
        return (tape.jacobian(y, v), tape.jacobian(y, v, experimental_use_pfor=False))
    compare(program)


# -- 3. a tape created eagerly, re-entered in a function being traced -----------------

_BIAS = tf.constant([0.5, -1.0, 2.0])
_OPS = {
    "avg_pool": lambda x: tf.nn.avg_pool2d(x[None], 2, 2, "VALID"),
    "max_pool": lambda x: tf.nn.max_pool2d(x[None], 2, 1, "SAME"),
    "fused_batch_norm": lambda x: tf.compat.v1.nn.fused_batch_norm(
        x[None], tf.ones([3]), tf.zeros([3]), is_training=True)[0],
    "softmax_cross_entropy": lambda x: tf.nn.softmax_cross_entropy_with_logits(
        tf.nn.softmax(tf.reshape(x, [-1, 3]) * 0.0 + _BIAS), tf.reshape(x, [-1, 3])),
    "bias_add": lambda x: tf.nn.bias_add(x, _BIAS),
    "strided_slice": lambda x: x[1:3, ::2],
    "unary": lambda x: tf.tanh(x) * tf.exp(-x),
}


@pytest.mark.parametrize("name", sorted(_OPS))
def test_tape_created_eagerly_reentered_in_a_function(name):
    op = _OPS[name]

    def program(tape_cls):
        x = tf.random.stateless_uniform([2, 4, 4, 3], seed=[1, 2])
        with tape_cls(persistent=True) as tape:
            tape.watch(x)

        @tf.function
        def step(i):
            with tape:
                x1 = tf.gather(x, i)
                out = op(x1)
                loss = tf.reduce_sum(out * out)
            return out, tape.gradient(loss, x1), tape.gradient(loss, x)
        return step(tf.constant(1))
    compare(program)


def test_tape_created_eagerly_reentered_in_a_pfor_loop():
    def program(tape_cls):
        x = tf.random.stateless_uniform([3, 4, 4, 3], seed=[3, 4])
        with tape_cls(persistent=True) as tape:
            tape.watch(x)

        def loop_fn(i):
            with tape:
                x1 = tf.gather(x, i)
                loss = tf.reduce_sum(tf.nn.avg_pool2d(x1[None], 2, 2, "VALID") ** 2)
            return tape.gradient(loss, x1)
        return tf.vectorized_map(loop_fn, tf.range(3))
    compare(program)


def test_reentering_an_active_tape_in_a_function_raises():
    def program(tape_cls):
        x = tf.constant([1.0, 2.0])
        with tape_cls(persistent=True) as tape:
            tape.watch(x)

            @tf.function
            def step(x):
                with tape:
                    return x * 2.0
            step(x)
    expected, actual = (raised(program, tape) for tape in TAPES)
    assert type(actual) is type(expected), (expected, actual)
    # (tf.function adds the traceback of the user's code: compare the error's own line)
    want = str(expected).strip().splitlines()[-1].split("ValueError: ", 1)[1]
    assert str(actual).strip().endswith("oh.GradientTape: " + want), str(actual)


def test_equal_scalars_under_an_accumulator_and_a_tape_match_tensorflow():
    """An accumulator's primal keyed by TensorFlow's shared scalar handle must not move
    to its twin when a tape inside watches the primal (or with no tape at all)."""
    def run(accumulator, tape_type):
        x, y = tf.constant(3.0), tf.constant(3.0)
        with accumulator(x, tf.constant(1.0)) as acc:
            with tape_type() as tape:
                tape.watch(x)
                z, w = x * x, y * y
            v = y * 2.
        return [acc.jvp(z), acc.jvp(w), acc.jvp(v), tape.gradient(z, x)]

    want = run(tf.autodiff.ForwardAccumulator, tf.GradientTape)
    got = run(oh.ForwardAccumulator, oh.GradientTape)
    assert [None if t is None else float(t) for t in got] == \
        [None if t is None else float(t) for t in want]
