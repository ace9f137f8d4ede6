"""oh.ForwardAccumulator against tf.autodiff.ForwardAccumulator."""
import gc
import logging
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.handlers.forward_accumulator import handler as fa
from conftest import assert_close, assert_same_tensors, tf_leak_checked

# Tests that also run tf.autodiff.ForwardAccumulator as the reference compute the
# reference first and leak-check only oh.ForwardAccumulator's part (`_leak_checked`).
# (The TensorShapes that both accumulators' JVP dispatch memos re-key at every call once
# an op traces relaxed shapes are not counted: conftest.forget_jvp_dispatch_memos.)


def _leak_checked(check):
    """Runs `check()` (which computes with the handlers and asserts against references
    made before) under TensorFlow's two leak checks, after one unchecked warm-up run."""
    tf_leak_checked(check, warmup=1)()

RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _fresh_rng():
    """Every test draws the same data whatever ran before it (another order, -k, one
    test alone): the module's generator starts afresh for each test."""
    global RNG  # pylint: disable=global-statement
    RNG = np.random.default_rng(0)


def _rand(*shape, positive=False):
    v = RNG.standard_normal(shape).astype(np.float32)
    return tf.constant(np.abs(v) + 0.5 if positive else v)


def _jvp(acc_type, fn, primals, tangents):
    with acc_type(primals, tangents) as acc:
        y = fn(*primals)
    return y, acc.jvp(y)


def _both(fn, primals, tangents):
    return [_jvp(acc_type, fn, primals, tangents)
            for acc_type in (tf.autodiff.ForwardAccumulator, oh.ForwardAccumulator)]


PROGRAMS = {
    # elementwise (closed-form rules)
    "elementwise": (lambda a: tf.tanh(tf.exp(a) * tf.sin(a)) / (1. + a * a)
                    + tf.nn.relu(a) * tf.sigmoid(a) - tf.cos(a) ** 2, [(3, 4)]),
    "log_sqrt_rsqrt": (lambda a: tf.math.log(a) + tf.sqrt(a) + tf.math.rsqrt(a)
                       + tf.math.reciprocal(a) + tf.nn.softplus(a) + tf.abs(a - 1.),
                       [(5, "+")]),
    # linear algebra and reductions
    "matmul_softmax": (lambda a, b: tf.nn.softmax(a @ b) + tf.nn.log_softmax(a @ b),
                       [(3, 4), (4, 5)]),
    "batch_matmul_einsum": (lambda a, b: tf.einsum("bij,bjk->bik", a, b)
                            + tf.matmul(a, b), [(2, 3, 4), (2, 4, 3)]),
    "reductions_reshapes": (lambda a: tf.reduce_sum(tf.reshape(a, [2, 6]) ** 2, 0)[:4]
                            + tf.reduce_mean(tf.transpose(a), 1)
                            + tf.concat([a[0, :2], a[1, 1:3]], 0), [(3, 4)]),
    "gather_tile_pad": (lambda a: tf.pad(tf.tile(tf.gather(a, [2, 0]), [2, 1]), [[1, 0], [0, 1]]),
                        [(3, 2)]),
    "linalg_fallback": (lambda a: tf.linalg.inv(a @ tf.transpose(a) + 3. * tf.eye(3))
                        + tf.linalg.cholesky(a @ tf.transpose(a) + 3. * tf.eye(3)), [(3, 3)]),
    "max_pow_erf_fallback": (lambda a, b: tf.maximum(a, b) ** 3 + tf.math.erf(a)
                             + tf.reduce_max(a * b, 0), [(4, 2), (4, 2)]),
    # convolution
    "conv2d_pool": (lambda a, k: tf.nn.max_pool2d(tf.nn.conv2d(a, k, 1, "SAME"), 2, 2, "VALID")
                    + tf.nn.bias_add(tf.nn.avg_pool2d(tf.nn.conv2d(a, k, 1, "SAME"), 2, 2,
                                                      "VALID"), tf.ones([3])),
                    [(1, 6, 6, 2), (3, 3, 2, 3)]),
    # control flow (eager: Python control flow and tf.cond / tf.while_loop run op by op)
    "cond_while": (lambda a: tf.while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, tf.sin(x) * x),
                                           (tf.constant(0), a))[1]
                   + tf.cond(tf.reduce_sum(a) > 0, lambda: a * 2., lambda: a * 3.), [(4,)]),
    "float64": (lambda a: tf.sin(tf.cast(a, tf.float64)) ** 2, [(3,)]),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_jvps_equal_tf_forward_accumulator(name):
    fn, shapes = PROGRAMS[name]
    primals = [_rand(*s[:-1], positive=True) if s[-1] == "+" else _rand(*s) for s in shapes]
    tangents = [_rand(*p.shape) for p in primals]
    ref_y, ref_j = _jvp(tf.autodiff.ForwardAccumulator, fn, primals, tangents)

    def check():
        y, j = _jvp(oh.ForwardAccumulator, fn, primals, tangents)
        assert_close(y, ref_y, 1e-5)
        assert_same_tensors(ref_j, j)
    _leak_checked(check)


@tf_leak_checked(warmup=1)
def test_closed_form_rules_do_not_trace():
    a, t = _rand(3, 4), _rand(3, 4)
    w = _rand(4, 2)
    traced = dict(fa._tf_forwardprop._TRACE_COUNT)  # pylint: disable=protected-access
    with oh.ForwardAccumulator(a, t) as acc:
        y = tf.reduce_sum(tf.nn.softmax(tf.tanh(a @ w) * 2. + 1.), 1)
    assert acc.jvp(y) is not None
    assert fa._tf_forwardprop._TRACE_COUNT == traced  # pylint: disable=protected-access


def test_fallback_traces_once_per_signature():
    a, t = _rand(7), _rand(7)
    before = fa._tf_forwardprop._TRACE_COUNT.get("Erf", 0)  # pylint: disable=protected-access
    for _ in range(3):
        with oh.ForwardAccumulator(a, t) as acc:
            y = tf.math.erf(a)
        assert_close(acc.jvp(y), 2. / np.sqrt(np.pi) * np.exp(-a.numpy() ** 2) * t.numpy(), 1e-5)
    assert fa._tf_forwardprop._TRACE_COUNT["Erf"] == before + 1  # pylint: disable=protected-access


@tf_leak_checked(warmup=1)
def test_nested_structures_variables_and_unconnected():
    v = tf.Variable(_rand(2, 3))
    a, b = _rand(3), _rand(3)
    tv, ta = _rand(2, 3), _rand(3)
    results = []
    for acc_type in (tf.autodiff.ForwardAccumulator, oh.ForwardAccumulator):
        with acc_type({"v": v, "a": [a]}, {"v": tv, "a": [ta]}) as acc:
            out = {"y": tf.linalg.matvec(v, a), "z": [b * 2.]}
        results.append((acc.jvp(out), acc.jvp(out, unconnected_gradients="zero"),
                        acc.jvp(v), acc.jvp(a)))
    (ref, ref_zero, ref_v, ref_a), (got, got_zero, got_v, got_a) = results
    assert got["z"][0] is None and ref["z"][0] is None
    assert_same_tensors(ref["y"], got["y"])
    assert_same_tensors(ref_zero, got_zero)
    assert_same_tensors([ref_v, ref_a], [got_v, got_a])


def test_keras_layers_jvp_with_respect_to_weights_and_inputs():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((6, 6, 2)), keras.layers.Conv2D(3, 3, activation="relu"),
        keras.layers.LayerNormalization(), keras.layers.Flatten(),
        keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2, activation="softmax")])
    x = _rand(2, 6, 6, 2)
    # tf.autodiff.ForwardAccumulator needs the tf.Variables under Keras 3's variables;
    # oh.ForwardAccumulator also takes the Keras variables themselves.
    weights = [w.value for w in model.trainable_variables]
    tangents = [_rand(*w.shape) for w in weights]
    (_, ref), (_, got) = _both(lambda *w: model(x), weights, tangents)
    assert_same_tensors(ref, got)
    with oh.ForwardAccumulator(model.trainable_variables, tangents) as acc:
        y = model(x)
    assert_same_tensors(ref, acc.jvp(y))
    (_, ref), (_, got) = _both(lambda xx: model(xx), [x], [_rand(*x.shape)])
    assert_same_tensors(ref, got)


def _f(a):
    return tf.reduce_sum(tf.sin(a) * a ** 2 + tf.tanh(a) * a[0])


def test_forward_over_reverse_hessian_vector_product():
    x, vec = _rand(4), _rand(4)

    def hvp(acc_type, tape_type):
        with acc_type(x, vec) as acc:
            with tape_type() as tape:
                tape.watch(x)
                y = _f(x)
            g = tape.gradient(y, x)
        return acc.jvp(g)
    want = hvp(tf.autodiff.ForwardAccumulator, tf.GradientTape)
    _leak_checked(lambda: assert_same_tensors(
        want, hvp(oh.ForwardAccumulator, oh.GradientTape)))


def test_reverse_over_forward():
    x, vec = _rand(4), _rand(4)

    def grad_of_jvp(acc_type, tape_type):
        with tape_type() as tape:
            tape.watch(x)
            with acc_type(x, vec) as acc:
                y = _f(x)
            jvp = acc.jvp(y)
        return tape.gradient(jvp, x)
    want = grad_of_jvp(tf.autodiff.ForwardAccumulator, tf.GradientTape)
    _leak_checked(lambda: assert_same_tensors(
        want, grad_of_jvp(oh.ForwardAccumulator, oh.GradientTape)))


def _small_keras_hvp_inputs(seed):
    """A small seeded Keras MLP, a batch, its weights' values and tangents for them."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(1)])
    x = _rand(5, 3)
    weights = [w.value for w in model.trainable_variables]
    return model, x, weights, [_rand(*w.shape) for w in weights]


def test_mixed_with_tensorflow_tape_and_keras_hvp():
    model, x, weights, vecs = _small_keras_hvp_inputs(seed=1)
    results = []
    for acc_type, tape_type in ((tf.autodiff.ForwardAccumulator, tf.GradientTape),
                                (oh.ForwardAccumulator, oh.GradientTape),
                                (oh.ForwardAccumulator, tf.GradientTape)):
        with acc_type(weights, vecs) as acc:
            with tape_type() as tape:
                loss = tf.reduce_mean(model(x) ** 2)
            grads = tape.gradient(loss, weights)
        results.append(acc.jvp(grads))
    assert_same_tensors(results[0], results[1])
    assert_same_tensors(results[0], results[2])


def test_nested_accumulators_give_second_directional_derivative():
    x, vec = _rand(3), _rand(3)

    def second(acc_type):
        with acc_type(x, vec) as outer:
            with acc_type(x, vec) as inner:
                y = _f(x)
            first = inner.jvp(y)
        return first, outer.jvp(first)
    want = second(tf.autodiff.ForwardAccumulator)
    _leak_checked(lambda: assert_same_tensors(want, second(oh.ForwardAccumulator)))


@tf_leak_checked(warmup=1)
def test_composes_with_other_handlers():
    x, t = _rand(3), _rand(3)
    log = oh.OpLogHandler()
    with log:
        with oh.ForwardAccumulator(x, t) as acc:
            y = tf.exp(x)
    assert_close(acc.jvp(y), np.exp(x.numpy()) * t.numpy(), 1e-5)
    assert log.op_types_seen().count("Exp") == 1 and "Mul" in log.op_types_seen()
    with oh.CheckNumericsHandler():
        with oh.ForwardAccumulator(x, t) as acc:
            y = tf.sin(x)
    assert_close(acc.jvp(y), np.cos(x.numpy()) * t.numpy(), 1e-5)


@tf_leak_checked(warmup=1)
def test_errors():
    a = _rand(2)
    with pytest.raises(ValueError, match="multiple"):
        oh.ForwardAccumulator([a, a], [a, a])
    with pytest.raises(ValueError, match="shape"):
        oh.ForwardAccumulator(a, tf.ones([3]))
    acc = oh.ForwardAccumulator(a, a)
    with acc:
        with pytest.raises(ValueError, match="already recording"):
            acc.__enter__()
    with pytest.raises(LookupError, match="op Lu"):
        m = _rand(2, 2)
        with oh.ForwardAccumulator(m, m):
            tf.linalg.lu(m)


def test_integer_primal_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="tf_ophandlers"):
        oh.ForwardAccumulator(tf.constant([1, 2]), tf.constant([1, 1]))
    assert "must be floating" in caplog.text


def test_ops_outside_the_scope_carry_no_tangent_and_tensors_print_like_tf():
    x, t = _rand(2), _rand(2)
    with oh.ForwardAccumulator(x, t) as acc:
        y = x * 3.
    z = y + 1.  # outside: TensorFlow's accumulator would not see it either
    assert acc.jvp(z) is None
    assert_close(acc.jvp(y), 3. * t.numpy())
    assert repr(y.numpy()) in repr(y) or "3" in repr(y)
    assert y.device == x.device


def test_variable_created_inside_does_not_keep_the_accumulator_alive():
    x, t = _rand(2), _rand(2)
    acc = oh.ForwardAccumulator(x, t)
    with acc:
        v = tf.Variable(x * 2.)
    ref = weakref.ref(acc)
    del acc
    gc.collect()
    assert ref() is None
    assert_close(v, 2. * x.numpy())


# -- regressions found in review ---------------------------------------------------------------

def test_list_input_and_string_ops():
    x = _rand(2)
    ones = tf.ones_like(x)

    def fn(a):
        return tf.add_n([a, a * 2.]) + tf.concat([a, a], 0)[:2] + tf.stack([a, a])[0]
    _, ref = _jvp(tf.autodiff.ForwardAccumulator, fn, [x], [ones])

    def check():
        assert_same_tensors(ref, _jvp(oh.ForwardAccumulator, fn, [x], [ones])[1])
        with oh.ForwardAccumulator(x, ones):
            tf.print(x, output_stream="file:///dev/null")  # a string op: no tangent, no error
    _leak_checked(check)


@tf_leak_checked(warmup=1)
def test_a_freed_primal_does_not_give_its_tangent_to_new_tensors():
    acc = oh.ForwardAccumulator(tf.constant([1., 2.]) * 3., tf.constant([100., 100.]))
    with acc:
        for _ in range(20):
            y = tf.constant([0., 1.]) * 2. + 1.
            assert acc.jvp(y) is None


@tf_leak_checked(warmup=1)
def test_complex_closed_forms_match_tensorflow():
    c = tf.constant([1 + 2j, -0.5 + 1j], tf.complex64)
    t = tf.constant([0.3 - 1j, 1 + 1j], tf.complex64)
    (_, ref), (_, got) = _both(lambda a: tf.sqrt(a) + tf.math.rsqrt(a) + tf.math.reciprocal(a)
                               + tf.tanh(a), [c], [t])
    assert_same_tensors(ref, got)


def test_diag_part_padding_has_no_tangent():
    x = _rand(2, 3)
    (_, ref), (_, got) = _both(lambda a: tf.linalg.diag_part(a, k=(-1, 1), padding_value=5.),
                               [x], [tf.ones([2, 3])])
    assert_same_tensors(ref, got)


# -- tf.function calls (replayed through the accumulator, core/functions) -----------------------

@tf.function
def _controlled(a, b):
    c = tf.cond(b > 0, lambda: a * a, lambda: tf.sin(a))
    return tf.while_loop(lambda i, s: i < 3, lambda i, s: (i + 1, s * c + b), [0, c])[1]


@pytest.mark.parametrize("sign", [1.0, -1.0])
@tf_leak_checked(warmup=1)
def test_jvp_through_tf_function_with_control_flow_matches_tensorflow(sign):
    a, b = tf.constant(1.5), tf.constant(2.0 * sign)
    with tf.autodiff.ForwardAccumulator(a, tf.constant(1.0)) as ref:
        expected = _controlled(a, b)
    with oh.ForwardAccumulator(a, tf.constant(1.0)) as acc:
        y = _controlled(a, b)
    assert_close(y, expected)
    assert_close(acc.jvp(y), ref.jvp(expected))


def test_jvp_through_keras_model_in_tf_function_matches_tensorflow():
    import keras
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="tanh"),
                              keras.layers.Dense(2)])
    call = tf.function(lambda x: model(x))
    x = _rand(3, 5)
    tangent = _rand(3, 5)
    with tf.autodiff.ForwardAccumulator(x, tangent) as ref:
        expected = call(x)
    with oh.ForwardAccumulator(x, tangent) as acc:
        y = call(x)
    assert_close(y, expected)
    assert_close(acc.jvp(y), ref.jvp(expected))


@tf_leak_checked(warmup=1)
def test_forward_over_reverse_hvp_through_tf_function():
    f = tf.function(lambda a: tf.reduce_sum(a * a * a))
    x = _rand(3)
    v = _rand(3)
    with tf.autodiff.ForwardAccumulator(x, v) as ref:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = f(x)
        expected = ref.jvp(tape.gradient(y, x))
    with oh.ForwardAccumulator(x, v) as acc:
        with oh.GradientTape() as tape:
            tape.watch(x)
            y = f(x)
        hvp = acc.jvp(tape.gradient(y, x))
    assert_close(hvp, 6.0 * x.numpy() * v.numpy())
    assert_close(hvp, expected)


@tf_leak_checked(warmup=1)
def test_cond_branch_without_tangent_gets_zeros():
    @tf.function
    def f(a, b):
        return tf.cond(b > 0, lambda: a * 3.0, lambda: b)  # only one branch uses a

    a = tf.constant(2.0)
    for b in (1.0, -1.0):
        with tf.autodiff.ForwardAccumulator(a, tf.constant(1.0)) as ref:
            expected = f(a, tf.constant(b))
        with oh.ForwardAccumulator(a, tf.constant(1.0)) as acc:
            y = f(a, tf.constant(b))
        assert_close(y, expected)
        assert_close(acc.jvp(y, unconnected_gradients="zero"),
                     ref.jvp(expected, unconnected_gradients="zero"))


def test_tensor_arrays_in_functions_and_loops_carry_tangents():
    @tf.function
    def single(x):
        return tf.TensorArray(tf.float32, size=1).write(0, x * 2.0).stack()

    @tf.function
    def looped(x):
        ta = tf.TensorArray(tf.float32, size=3)
        ta = tf.while_loop(lambda i, ta: i < 3,
                           lambda i, ta: (i + 1, ta.write(i, x * tf.cast(i, tf.float32))),
                           [0, ta])[1]
        return ta.stack()

    x = tf.constant([1.0, 2.0])
    for fn in (single, looped):
        with tf.autodiff.ForwardAccumulator(x, tf.constant([1.0, 0.0])) as ref:
            expected = fn(x)
        with oh.ForwardAccumulator(x, tf.constant([1.0, 0.0])) as acc:
            y = fn(x)
        assert_close(acc.jvp(y), ref.jvp(expected))


# -- JVPs do not depend on what ran before ---------------------------------
# Ops without a closed-form rule use TensorFlow's JVP construction, a function traced once
# per op signature and cached (it was TensorFlow's cache, shared with
# tf.autodiff.ForwardAccumulator). A trace made while a tf.function was being replayed
# through the accumulator recorded nothing (the replay stops the thread's tapes), so the
# JVP was zero there and in every later eager use of the op signature.

def _gelu_dense():
    keras.utils.set_random_seed(11)
    layer = keras.layers.Dense(8, activation="gelu")
    layer.build((None, 5))
    return layer, [(3, 5)]


ORDER_PROGRAMS = {
    "erf": lambda: (lambda a: a + tf.math.erf(a), [(3,)]),
    "max_pool": lambda: (lambda a: tf.nn.max_pool2d(a, 2, 2, "VALID"), [(1, 4, 4, 2)]),
    "avg_pool": lambda: (lambda a: tf.nn.avg_pool2d(a, 2, 2, "VALID") * a[:, :2, :2, :],
                         [(1, 4, 4, 2)]),
    "top_k": lambda: (lambda a: tf.math.top_k(a, 2).values * 2., [(3, 5)]),
    "reduce_max": lambda: (lambda a: tf.reduce_max(a, 1) + 1., [(4, 3)]),
    "keras_gelu_dense": _gelu_dense,
}


class _Caches:
    """The caches of traced JVP functions: TensorFlow's and the accumulator's own."""

    def __init__(self):
        self.caches = [fa._tf_forwardprop._jvp_function_cache]  # pylint: disable=protected-access
        if hasattr(fa, "_jvp_function_cache"):
            self.caches.append(fa._jvp_function_cache)  # pylint: disable=protected-access

    def clear(self):
        for cache in self.caches:
            cache.clear()


@pytest.fixture
def fresh_jvp_cache():
    """The JVP function caches emptied, as in a new process (and after the test, so that
    nothing a failing test traced reaches other tests)."""
    caches = _Caches()
    caches.clear()
    yield caches
    caches.clear()


@pytest.mark.parametrize("name", sorted(ORDER_PROGRAMS))
def test_jvps_do_not_depend_on_what_ran_before(name, fresh_jvp_cache):
    fn, shapes = ORDER_PROGRAMS[name]()
    primals = [_rand(*s) for s in shapes]
    tangents = [_rand(*s) for s in shapes]
    with tf.autodiff.ForwardAccumulator(primals, tangents) as ref:
        expected = fn(*primals)
    expected_jvp = ref.jvp(expected)
    with tf.autodiff.ForwardAccumulator(primals, tangents) as ref:
        expected_fn = tf.function(fn)(*primals)
    assert_close(ref.jvp(expected_fn), expected_jvp, 1e-5)
    fresh_jvp_cache.clear()  # nothing traced yet: the oh accumulator's function runs first
    for run in ("function", "eager", "function"):
        call = tf.function(fn) if run == "function" else fn  # a fresh function each time
        with oh.ForwardAccumulator(primals, tangents) as acc:
            y = call(*primals)
        assert_close(y, expected, 1e-5)
        assert_same_tensors(expected_jvp, acc.jvp(y))
    # TensorFlow's own accumulator, sharing TensorFlow's cache, is still right.
    with tf.autodiff.ForwardAccumulator(primals, tangents) as ref:
        again = fn(*primals)
    assert_same_tensors(expected_jvp, ref.jvp(again))


def test_a_possibly_lost_dependence_warns_once_per_process_not_per_step():
    """The accumulator sees the dispatcher's new wrapper of an input, not the user's
    object, so it cannot ask whether a tf.GradientTape tracks it (a constant batch warns
    too); a training loop gets the warning once, not once per step and tensor."""
    import warnings  # pylint: disable=import-outside-toplevel
    model, x, weights, vecs = _small_keras_hvp_inputs(seed=2)

    def hvp(acc_type):
        with acc_type(weights, vecs) as acc:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(x) ** 2)
            grads = tape.gradient(loss, weights)
        return acc.jvp(grads)
    want = hvp(tf.autodiff.ForwardAccumulator)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert_same_tensors(want, hvp(oh.ForwardAccumulator))
    assert len([w for w in caught if "oh.ForwardAccumulator: a tf.GradientTape is "
                "recording" in str(w.message)]) == 1
