"""Per-example control flow in an eagerly mapped function, and eager
control flow on per-device values: `tf.cond`, `tf.switch_case` and `tf.while_loop` whose
predicate has no single value run as a tf.function of the call
(core/functions/eager_control_flow.py), against tf.vectorized_map on the same function."""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_same_tensors

XS = tf.constant([-1.5, 2., -3., 0.5, 4.])


def cond_fn(x):
    return tf.cond(x > 0, lambda: x * x, lambda: tf.sin(x) - 1.)


def switch_fn(x):
    index = tf.cast(tf.clip_by_value(tf.round(x), 0., 2.), tf.int32)
    return tf.switch_case(index, [lambda: x * 3., lambda: tf.exp(x), lambda: x + 1.])


def while_fn(x):
    # A per-example trip count: doubles until it passes 10 in absolute value.
    _, y = tf.while_loop(lambda i, y: tf.abs(y) < 10., lambda i, y: (i + 1, y * 2.),
                         (tf.constant(0), x))
    return y


def nested_fn(x):
    def body(i, y):
        return i + 1., tf.cond(y > 1., lambda: y * 0.5, lambda: y + x)
    return tf.while_loop(lambda i, y: i < tf.abs(x) + 1., body, (0., x))[1]


def max_iterations_fn(x):
    # The condition is decided eagerly at first (y starts as a plain 1.0) and per example
    # once y depends on x: the loop goes on staged, with the iterations that are left.
    return tf.while_loop(lambda y: y < 8., lambda y: [y * (tf.abs(x) + 1.5)], [tf.constant(1.)],
                         maximum_iterations=3)[0]


FUNCTIONS = [cond_fn, switch_fn, while_fn, nested_fn, max_iterations_fn]


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_values_match_tf_vectorized_map(fn):
    want = tf.vectorized_map(fn, XS)
    assert_same_tensors(want, oh.vectorized_map(fn, XS))
    # and the same call inside a fresh tf.function
    assert_same_tensors(want, tf.function(lambda xs: oh.vectorized_map(fn, xs))(XS))


def switch_linear_fn(x):
    # Branches whose gradients need no forward values: the Case keeps its outputs.
    index = tf.cast(tf.clip_by_value(tf.round(x), 0., 2.), tf.int32)
    return tf.switch_case(index, [lambda: x * 3., lambda: -x, lambda: x + 1.])


def while_linear_fn(x):
    # A per-example trip count, a body whose gradient needs no accumulated values.
    _, y = tf.while_loop(lambda i, y: tf.abs(y) < 10., lambda i, y: (i + 1, y + y),
                         (tf.constant(0), x))
    return y


# A Case or While with a per-example branch index or condition runs once per example in
# the replay of TensorFlow's forward function. Where its gradient keeps forward values,
# the op has extra outputs: per-example Optionals (switch_fn) or While accumulators whose
# lengths are the per-example trip counts (while_fn, nested_fn). They stay one variant per
# example (rows), which the replayed function returns as a list of them, so that
# TensorFlow's function gradient can give them zeros.
GRADIENT_FUNCTIONS = [cond_fn, switch_fn, while_fn, nested_fn, switch_linear_fn,
                      while_linear_fn]


def _map_fn(fn, xs):
    return tf.map_fn(fn, xs)


def _reference(fn):
    """tf.vectorized_map, except for nested_fn: its gradient fails there (pfor's converted
    loop: "data.shape = [0] does not start with segment_ids.shape", in the DynamicStitch
    gradient of the While's gradient), so tf.map_fn's is the reference."""
    return _map_fn if fn is nested_fn else tf.vectorized_map


def _gradient_of_the_map(fn, vmap, tape_type):
    with tape_type() as tape:
        tape.watch(XS)
        loss = tf.reduce_sum(vmap(fn, XS) ** 2)
    return tape.gradient(loss, XS)


@pytest.mark.parametrize("fn", GRADIENT_FUNCTIONS, ids=lambda f: f.__name__)
def test_gradients_under_oh_gradient_tape_match_tensorflow(fn):
    want = _gradient_of_the_map(fn, _reference(fn), tf.GradientTape)
    assert_same_tensors(want, _gradient_of_the_map(fn, oh.vectorized_map, oh.GradientTape))


def test_the_gradient_of_tf_vectorized_map_fails_for_nested_fn():
    """Why tf.map_fn is nested_fn's reference (if TensorFlow fixes it, use its)."""
    with pytest.raises(tf.errors.InvalidArgumentError):
        _gradient_of_the_map(nested_fn, tf.vectorized_map, tf.GradientTape)


@pytest.mark.parametrize("fn", [f for f in GRADIENT_FUNCTIONS if f is not nested_fn],
                         ids=lambda f: f.__name__)
def test_gradients_inside_a_fresh_function_match_tensorflow(fn):
    # Traced, oh.vectorized_map is tf.vectorized_map (pfor on the graph); nested_fn's
    # gradient then fails as tf.vectorized_map's does.
    want = tf.function(lambda: _gradient_of_the_map(fn, tf.vectorized_map, tf.GradientTape))()
    got = tf.function(lambda: _gradient_of_the_map(fn, oh.vectorized_map, oh.GradientTape))()
    assert_same_tensors(tf.convert_to_tensor(want), tf.convert_to_tensor(got))


def _per_example_gradient(fn, tape_type):
    def grad(x):
        with tape_type() as tape:
            tape.watch(x)
            y = fn(x) ** 2
        return tape.gradient(y, x)
    return grad


@pytest.mark.parametrize("fn", GRADIENT_FUNCTIONS, ids=lambda f: f.__name__)
def test_per_example_gradients_inside_the_map_match_map_fn(fn):
    """A tape inside the mapped function: TensorFlow's backward function of the staged
    call, with its Case/While gradient reading the forward's Optionals and accumulators,
    runs on the map (each example takes its own rows apart)."""
    want = tf.map_fn(_per_example_gradient(fn, tf.GradientTape), XS)
    assert_same_tensors(want, oh.vectorized_map(_per_example_gradient(fn, oh.GradientTape), XS))


def test_python_side_effects_of_eager_iterations_are_not_repeated():
    """The iterations run eagerly before the condition became per-example are not run
    again by the staged rest of the loop."""
    eager_bodies = []

    def fn(x):
        def body(y):
            if tf.executing_eagerly():
                eager_bodies.append(1)
            return [y * (tf.abs(x) + 1.5)]
        return tf.while_loop(lambda y: y < 8., body, [tf.constant(1.)])[0]

    assert_same_tensors(tf.vectorized_map(fn, XS), oh.vectorized_map(fn, XS))
    assert len(eager_bodies) == 1


def test_control_flow_outside_handlers_stays_tensorflows_eager_control_flow():
    calls = []
    x = tf.constant(2.)
    with oh.OpHandler():  # the patch is installed by the first handler scope
        pass
    y = tf.cond(x > 0, lambda: calls.append("t") or x * 2., lambda: calls.append("f") or x)
    assert calls == ["t"] and float(y) == 4.
    n = tf.while_loop(lambda i: i < 3, lambda i: calls.append("b") or [i + 1], [tf.constant(0)])
    assert calls == ["t", "b", "b", "b"] and int(n[0]) == 3


def test_cond_on_per_device_values_of_a_parallel_handler():
    """TensorFlow's ParallelDevice needs tf.function branches for this; plain lambdas
    work here, each device taking its own branch."""
    parallel = oh.ParallelHandler(["CPU:0", "CPU:1"])
    with parallel:
        x = parallel.pack([tf.constant(-2.), tf.constant(3.)])
        y = tf.cond(x > 0, lambda: x * 10., lambda: x - 1.)
    got = [float(t) for t in parallel.unpack(y)]
    assert got == [-3., 30.]


def test_errors_in_a_branch_reach_the_caller():
    def fn(x):
        return tf.cond(x > 0, lambda: tf.reshape(x, [2]), lambda: x)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)):
        oh.vectorized_map(fn, XS)


W_LOOP = tf.Variable(np.eye(2, dtype=np.float32) * 0.5 + 0.25)


def while_variable_fn(x):
    # A per-example condition from the start, maximum_iterations, a body reading a
    # captured variable: the loop's gradient accumulators take maximum_iterations (an
    # int32 TensorList maximum), and the variable is a loop variable of each example's
    # While.
    body = lambda i, y: (i + 1, tf.tanh(tf.linalg.matvec(W_LOOP, y)) + 0.3)  # noqa: E731
    return tf.while_loop(lambda i, y: tf.reduce_sum(y) < 1., body, (tf.constant(0), x),
                         maximum_iterations=3)[1]


def nested_variable_fn(x):
    # The variable read in a tf.cond inside the loop body.
    def body(i, y):
        return i + 1, tf.cond(tf.reduce_sum(y) > 0., lambda: tf.tanh(tf.linalg.matvec(W_LOOP, y)),
                              lambda: y * 0.5 + 0.4)
    return tf.while_loop(lambda i, y: tf.reduce_sum(y) < 1., body, (tf.constant(0), x),
                         maximum_iterations=3)[1]


@pytest.mark.parametrize("as_function", [False, True], ids=["eager_fn", "tf_function_fn"])
@pytest.mark.parametrize("fn", [while_variable_fn, nested_variable_fn],
                         ids=lambda f: f.__name__)
def test_gradients_of_a_loop_reading_a_variable_match_tensorflow(fn, as_function):
    """Reference: tf.vectorized_map, or tf.map_fn for the nested cond (the gradient of
    pfor's converted nested control flow fails, see nested_fn)."""
    xs = tf.constant([[-1., 0.5], [2., 1.], [-0.2, -0.3]])
    mapped = tf.function(fn) if as_function else fn

    def run(vmap, tape_type, f):
        with tape_type() as tape:
            tape.watch(xs)
            loss = tf.reduce_sum(vmap(f, xs) ** 2)
        return tape.gradient(loss, [xs, W_LOOP])

    reference = _map_fn if fn is nested_variable_fn else tf.vectorized_map
    assert_same_tensors(run(reference, tf.GradientTape, fn),
                        run(oh.vectorized_map, oh.GradientTape, mapped))


M_LOOP = tf.constant([[0.3, -0.2], [-0.4, 0.1], [0.2, 0.5]])


def loop_in_cond_fn(x, m):
    # A per-example tf.while_loop (per-example trip count) in one branch of a per-example
    # tf.cond: under a tape the If's intermediates differ in kind between the branches
    # (the loop's accumulators, the other branch's values, each in an Optional), which
    # the replay selects between per example.
    def loop():
        n = tf.cast(tf.clip_by_value(tf.floor(tf.abs(tf.reduce_sum(x))), 0., 3.), tf.int32)
        return tf.while_loop(lambda i, y: i < n, lambda i, y: (i + 1, tf.tanh(tf.sin(y))),
                             (tf.constant(0), x))[1]

    def other():
        a = x + m
        return tf.stop_gradient(a) * a
    return tf.cond(tf.reduce_sum(x) > 0.5, loop, other)


def three_levels_variable_fn(x, m):
    # The variable read three control-flow levels deep: a cond in a loop in a per-example
    # cond.
    def inner(y):
        return tf.cond(tf.reduce_sum(y) > 0., lambda: tf.tanh(tf.linalg.matvec(W_LOOP, y)),
                       lambda: tf.sin(y) + m)

    def loop():
        n = tf.cast(tf.clip_by_value(tf.floor(tf.abs(tf.reduce_sum(x))), 0., 3.), tf.int32)
        return tf.while_loop(lambda i, y: i < n, lambda i, y: (i + 1, tf.tanh(inner(y))),
                             (tf.constant(0), x))[1]
    return tf.cond(tf.reduce_sum(x) > 0.5, loop, lambda: tf.cos(x) * m)


@pytest.mark.parametrize("as_function", [False, True], ids=["eager_fn", "tf_function_fn"])
@pytest.mark.parametrize("fn", [loop_in_cond_fn, three_levels_variable_fn],
                         ids=lambda f: f.__name__)
def test_loops_in_per_example_conds_under_oh_gradient_tape_match_map_fn(fn, as_function):
    """Values and gradients (elements and the variable) against tf.map_fn under
    tf.GradientTape (tf.vectorized_map's gradient of pfor's converted nested control flow
    fails, see nested_fn). The examples take both branches, with 0 to 3 iterations."""
    xs = tf.constant([[0.9, 0.4], [-0.5, 0.1], [1.2, 1.3]])
    mapped = tf.function(fn) if as_function else fn

    def run(vmap, tape_type, f):
        with tape_type() as tape:
            tape.watch([xs, M_LOOP])
            ys = vmap(lambda a: f(a[0], a[1]), (xs, M_LOOP))
            loss = tf.reduce_sum(ys ** 2)
        return ys, tape.gradient(loss, [xs, M_LOOP, W_LOOP])

    def map_fn(f, elems):
        return tf.map_fn(f, elems, fn_output_signature=tf.float32)

    want_ys, want_grads = run(map_fn, tf.GradientTape, fn)
    got_ys, got_grads = run(oh.vectorized_map, oh.GradientTape, mapped)
    assert_same_tensors(want_ys, got_ys)
    for want, got in zip(want_grads, got_grads):
        if want is None:  # (a source only the branches no example takes read: zeros)
            assert got is None or not np.any(tf.convert_to_tensor(got).numpy())
        else:
            assert_same_tensors(want, got)
