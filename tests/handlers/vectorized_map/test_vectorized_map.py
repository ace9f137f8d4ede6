"""oh.vectorized_map against tf.vectorized_map and a Python loop."""
import gc
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.handlers.vectorized_map import handler as vm
from conftest import assert_close

RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _fresh_rng():
    """Every test draws the same data whatever ran before it (another order, -k, one
    test alone): the module's generator starts afresh for each test."""
    global RNG  # pylint: disable=global-statement
    RNG = np.random.default_rng(0)


def _rand(*shape):
    return tf.constant(RNG.standard_normal(shape).astype(np.float32))


W = _rand(4, 3)

FUNCTIONS = {
    # direct rules
    "elementwise": (lambda e: tf.tanh(e) * tf.exp(-e) + tf.maximum(e, 0.1) / (1. + e * e),
                    [(5, 4)]),
    "broadcast_with_capture": (lambda e: e[:, None] * W[None] + tf.reduce_mean(W, 0), [(6, 4)]),
    "matmul_softmax": (lambda e: tf.nn.softmax(tf.matmul(e[None], W))[0], [(5, 4)]),
    "reductions": (lambda e: tf.reduce_sum(e, 0) + tf.reduce_max(e, -1)[:1] * tf.reduce_mean(e),
                   [(3, 2, 4)]),
    "reshape_transpose_concat": (lambda e: tf.concat(
        [tf.reshape(tf.transpose(e), [-1]), tf.squeeze(tf.expand_dims(e[0], 0))], 0), [(4, 2, 3)]),
    "stack_gather": (lambda e: tf.stack([tf.gather(e, [2, 0]), tf.gather(W[:, 0], [1, 1])], 1),
                     [(5, 3)]),
    "shape_queries": (lambda e: tf.cast(tf.shape(e)[0] + tf.rank(e), tf.float32) * e,
                      [(3, 5)]),
    "l2_loss_global_norm": (lambda e: tf.nn.l2_loss(e) + tf.linalg.global_norm([e, e[0]]),
                            [(4, 3, 2)]),
    # pfor conversions of one-op graphs
    "pfor_cumsum_conv": (lambda e: tf.nn.conv2d(e[None, :, :, None], tf.ones([2, 2, 1, 2]), 1,
                                                "VALID")[0] + tf.cumsum(e, 0)[:-1, :-1, None],
                         [(3, 4, 4)]),
    "pfor_linalg": (lambda e: tf.linalg.inv(tf.matmul(e, e, transpose_b=True) + 3. * tf.eye(3)),
                    [(4, 3, 3)]),
    # nested elems and outputs, two inputs
    "nested": (lambda args: {"sum": args[0] + args[1]["b"], "prod": [args[0] * 2.]},
               "nested"),
}


def _elems(spec):
    if spec == "nested":
        return (_rand(4, 3), {"b": _rand(4, 3)})
    return _rand(*spec[0])


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_matches_tf_vectorized_map_and_a_loop(name):
    fn, spec = FUNCTIONS[name]
    elems = _elems(spec)
    got = oh.vectorized_map(fn, elems)
    ref = tf.vectorized_map(fn, elems)
    flat_elems = tf.nest.flatten(elems)
    loop = [fn(tf.nest.pack_sequence_as(elems, [e[i] for e in flat_elems]))
            for i in range(int(flat_elems[0].shape[0]))]
    for g, r, *rows in zip(tf.nest.flatten(got), tf.nest.flatten(ref),
                           *[tf.nest.flatten(x) for x in loop]):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert_close(g, r, 1e-5)
        assert_close(g, tf.stack(rows), 1e-5)
    tf.nest.assert_same_structure(got, ref)


def test_function_sees_per_example_shapes():
    seen = []

    def fn(e):
        seen.append((tuple(e.shape), e.dtype))
        return e * 2.

    out = oh.vectorized_map(fn, _rand(7, 2, 3))
    assert seen == [((2, 3), tf.float32)]
    assert out.shape == (7, 2, 3)


def test_unbatched_outputs_are_broadcast():
    out = oh.vectorized_map(lambda e: (tf.reduce_sum(W), e), _rand(3, 2))
    assert out[0].shape == (3,) and out[1].shape == (3, 2)
    assert_close(out[0], [float(tf.reduce_sum(W))] * 3)


def test_no_rule_falls_back_to_a_loop_with_one_warning(caplog):
    def fn(e):
        m = tf.reshape(e, [2, 2]) + 3. * tf.eye(2)
        return tf.linalg.lu(m)[0]  # pfor has no converter for Lu

    x = _rand(4, 4)
    with caplog.at_level(logging.WARNING, logger="tf_ophandlers"):
        got = oh.vectorized_map(fn, x)
        oh.vectorized_map(fn, x)
    assert caplog.text.count("op Lu") == 1
    assert_close(got, tf.stack([fn(e) for e in x]), 1e-6)
    with pytest.raises(ValueError, match="op Lu"):
        oh.vectorized_map(fn, x, fallback_to_while_loop=False)


def test_pfor_conversion_is_cached_per_signature():
    x = _rand(3, 4)
    oh.vectorized_map(lambda e: tf.cumsum(e), x)
    n = len(vm._converted)  # pylint: disable=protected-access
    for _ in range(3):
        oh.vectorized_map(lambda e: tf.cumsum(e), x)
    assert len(vm._converted) == n  # pylint: disable=protected-access


def test_copy_off_inside_the_function_is_a_clear_error():
    with pytest.raises(oh.CopyOffError, match="per-example"):
        oh.vectorized_map(lambda e: e.numpy(), _rand(2, 2))


def test_keras_layer_per_example():
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(5, activation="relu")
    norm = keras.layers.LayerNormalization()
    x = _rand(6, 4)
    got = oh.vectorized_map(lambda e: norm(layer(e[None]))[0], x)
    assert_close(got, norm(layer(x)), 1e-5)


def _keras_model():
    keras.utils.set_random_seed(2)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(3)])


def test_per_example_gradients_of_a_keras_model():
    model = _keras_model()
    x, y = _rand(6, 4), tf.constant(RNG.integers(0, 3, 6))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def per_example(args):
        e, label = args
        with oh.GradientTape() as tape:
            loss = loss_fn(label[None], model(e[None]))
        return tape.gradient(loss, model.trainable_variables)

    got = oh.vectorized_map(per_example, (x, y))
    for i in range(6):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[i:i + 1], model(x[i:i + 1]))
        for g, r in zip(got, tape.gradient(loss, model.trainable_variables)):
            assert_close(g[i], r, 1e-5)
    assert [g.shape for g in got] == [(6,) + tuple(v.shape) for v in model.trainable_variables]


def test_tape_jacobians_are_vectorized_and_match_the_loop():
    x = _rand(3, 2)
    v = tf.Variable(_rand(2, 4))
    results = []
    for use_pfor in (True, False):
        with oh.GradientTape(persistent=True) as tape:
            tape.watch(x)
            y = tf.tanh(x @ v)
        results.append((tape.jacobian(y, [x, v], experimental_use_pfor=use_pfor),
                        tape.batch_jacobian(y, x, experimental_use_pfor=use_pfor)))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = tf.tanh(x @ v)
    ref_j, ref_b = tape.jacobian(y, [x, v]), tape.batch_jacobian(y, x)
    for got_j, got_b in results:
        for g, r in zip(got_j, ref_j):
            assert_close(g, r, 1e-5)
        assert_close(got_b, ref_b, 1e-5)


def test_nested_vectorized_map():
    x = _rand(3, 4, 2)
    got = oh.vectorized_map(lambda row: oh.vectorized_map(
        lambda e: tf.reduce_sum(e * e) * W[0, 0], row), x)
    assert_close(got, tf.reduce_sum(x * x, -1) * W[0, 0], 1e-5)


def test_with_forward_accumulator_inside():
    x, t = _rand(5, 3), _rand(3)

    def jvp(e):
        with oh.ForwardAccumulator(e, t) as acc:
            y = tf.reduce_sum(tf.sin(e) * e)
        return acc.jvp(y)

    got = oh.vectorized_map(jvp, x)
    ref = tf.reduce_sum((tf.cos(x) * x + tf.sin(x)) * t, -1)
    assert_close(got, ref, 1e-5)


def test_tape_outside_differentiates_through_the_map():
    x = _rand(4, 3)
    with oh.GradientTape() as tape:
        tape.watch(x)
        y = oh.vectorized_map(lambda e: tf.reduce_sum(tf.sin(e) * tf.cumsum(e)), x)
        total = tf.reduce_sum(y)
    with tf.GradientTape() as ref_tape:
        ref_tape.watch(x)
        ref = tf.reduce_sum(tf.map_fn(lambda e: tf.reduce_sum(tf.sin(e) * tf.cumsum(e)), x))
    assert_close(total, ref, 1e-5)
    assert_close(tape.gradient(total, x), ref_tape.gradient(ref, x), 1e-5)


# -- regressions found in review ---------------------------------------------------------------

@pytest.mark.parametrize("fn", [
    lambda r: tf.squeeze(r),
    lambda r: tf.argmax(r) + tf.argmin(r, axis=-1),
    lambda r: tf.nn.bias_add(tf.reshape(r, [1, 3, 1, 1]), W[0], data_format="NCHW"),
    lambda r: tf.nn.bias_add(W[:2, :3], r),
], ids=["squeeze", "argmax", "bias_add_nchw", "bias_add_batched_bias"])
def test_ops_fixed_in_review(fn):
    x = _rand(4, 3)
    got = oh.vectorized_map(fn, x)
    assert_close(got, tf.stack([fn(e) for e in x]), 1e-6)


def test_complex_matmul_with_transposes():
    c = tf.complex(_rand(4, 3, 3), _rand(4, 3, 3))
    m = tf.complex(_rand(3, 3), _rand(3, 3))
    for kw in ({"transpose_a": True}, {"adjoint_b": True}):
        fn = lambda a: tf.matmul(a, m, **kw)  # noqa: E731
        assert_close(oh.vectorized_map(fn, c), tf.stack([fn(e) for e in c]), 1e-5)


def test_random_ops_draw_per_example():
    d = oh.vectorized_map(lambda r: tf.nn.dropout(r, 0.5) + tf.random.normal([3]),
                          tf.ones([4, 3]))
    assert d.shape == (4, 3)
    assert not bool(tf.reduce_all(d[0] == d[1]))


def test_scalar_elems_are_refused():
    with pytest.raises(ValueError, match="leading"):
        oh.vectorized_map(lambda a: a, tf.constant(1.))


# -- tf.function calls inside the map (replayed, core/functions) ---------------------------------

@tf.function
def _branchy(r):
    c = tf.cond(r[0] > 0, lambda: r * 2.0, lambda: tf.zeros_like(r))  # per-example predicate
    c2 = tf.cond(tf.constant(True), lambda: r * 3.0, lambda: tf.ones([3]))  # batched vs not
    s = tf.while_loop(lambda i, s: i < 3, lambda i, s: (i + 1, s + r),
                      [0, tf.zeros([3])])[1]  # the loop variable becomes per-example
    return c + c2 + s


@pytest.mark.parametrize("fn", ["plain", "branchy"])
def test_tf_function_inside_the_map_matches_tf_vectorized_map(fn, caplog):
    f = tf.function(lambda r: tf.reduce_sum(tf.sin(r) * r)) if fn == "plain" else _branchy
    x = _rand(4, 3)
    with caplog.at_level(logging.WARNING):
        got = oh.vectorized_map(f, x)
    assert_close(got, tf.vectorized_map(f, x))
    assert_close(got, tf.stack([f(x[i]) for i in range(4)]))
    assert "runs once per example" not in caplog.text  # replayed op by op, no loop


def test_per_example_gradients_through_a_tf_function_keras_call():
    model = _keras_model()
    call = tf.function(lambda r: model(r[None])[0])
    x = _rand(5, 4)

    def per_example(r):
        with oh.GradientTape() as tape:
            loss = tf.reduce_sum(call(r) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    grads = oh.vectorized_map(per_example, x)
    for i in range(5):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x[i][None])[0] ** 2)
        for g, r in zip(grads, tape.gradient(loss, model.trainable_variables)):
            assert_close(g[i], r)


def test_map_over_a_tf_function_is_replayed_once_and_cached():
    from tf_ophandlers.core import functions as replay
    model = _keras_model()

    @tf.function
    def per_example(r):
        with oh.GradientTape() as tape:  # at trace time: TensorFlow's tape
            loss = tf.reduce_sum(model(r[None])[0] ** 2)
        return tape.gradient(loss, model.trainable_variables)

    x = _rand(6, 4)
    first = oh.vectorized_map(per_example, x)
    gc.collect()  # (earlier tests' dropped functions release their replays now)
    cached = replay.cache_info()
    again = oh.vectorized_map(per_example, x)
    assert replay.cache_info() == cached  # the vectorized replay is reused
    expected = tf.vectorized_map(per_example, x)
    for a, b, e in zip(first, again, expected):
        assert_close(a, e)
        assert_close(b, e)


def test_functions_using_tensor_lists_run_per_example(caplog):
    f = tf.function(lambda r: tf.map_fn(lambda e: tf.sin(e) * e, r))
    x = _rand(4, 3)
    with caplog.at_level(logging.WARNING):
        got = oh.vectorized_map(f, x)
    assert_close(got, tf.vectorized_map(f, x))


def test_signature_matches_tf_vectorized_map():
    """Same arguments, names and defaults as tf.vectorized_map."""
    import inspect  # pylint: disable=import-outside-toplevel
    ours = inspect.signature(oh.vectorized_map).parameters
    theirs = inspect.signature(tf.vectorized_map).parameters
    assert [(p.name, p.default) for p in ours.values()] == \
        [(p.name, p.default) for p in theirs.values()]


_CONV_FALLBACK = r'''
import os, sys
import tensorflow as tf
import tf_ophandlers as oh

# Per-example filters: pfor converts neither Conv2D nor Conv2DBackpropInput with a
# batched filter, so both run once per example (a shared filter has rules).
kernels = tf.random.stateless_normal([3, 3, 3, 2, 4], seed=[0, 1])
x = tf.random.stateless_normal([3, 8, 8, 2], seed=[1, 2])

def per_example(xi, ki, tape_type):
    with tape_type() as tape:
        tape.watch([xi, ki])
        y = tf.nn.conv2d(xi[None], ki, 1, "SAME")
        loss = tf.reduce_sum(y * y)
    return tape.gradient(loss, [ki, xi])

kw = {} if sys.argv[1] == "default" else {"warn": sys.argv[1] == "True"}
for _ in range(2):  # reported once per op type, not per call
    got = oh.vectorized_map(lambda e: per_example(e[0], e[1], oh.GradientTape), (x, kernels),
                            **kw)
ref = [tf.stack(r) for r in zip(*[per_example(x[i], kernels[i], tf.GradientTape)
                                  for i in range(3)])]
for g, r in zip(got, ref):
    assert type(g) is type(r) and g.dtype == r.dtype and g.shape == r.shape, (g, r)
    assert float(tf.reduce_max(tf.abs(g - r))) < 1e-4
print("ok")
'''


@pytest.mark.parametrize("warn", ["True", "False"])
def test_loop_fallback_is_reported_once_per_op_type_quietly(warn):
    """The loop fallback for convolutions (here with per-example
    filters) printed TensorFlow's pfor ERROR node dumps (~160 lines per op). It is
    reported once per op type through the tf_ophandlers logger (warn=True, the default),
    not at all with warn=False, and TensorFlow's dumps never appear; the gradients equal a
    plain per-example loop."""
    from python_process import run_python  # pylint: disable=import-outside-toplevel
    proc = run_python(_CONV_FALLBACK, args=[warn], timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"
    # TensorFlow's start-up banner where oneDNN is on (it ignores TF_CPP_MIN_LOG_LEVEL).
    banner = ("absl::InitializeLog()", "oneDNN custom operations are on")
    lines = [l for l in proc.stderr.splitlines()
             if l.strip() and not any(b in l for b in banner)]
    assert not any("pfor" in l and "error" in l.lower() for l in lines), proc.stderr[-3000:]
    if warn == "False":
        assert lines == [], proc.stderr[-3000:]
    else:
        assert len(lines) == 2, proc.stderr[-3000:]
        for op_type, line in zip(("Conv2D", "Conv2DBackpropInput"), lines):
            assert line.startswith("oh.vectorized_map:") and op_type in line, line


# -- state updates inside the map --------------------------------------------------

_UPDATES = {
    "assign_add": (lambda: tf.Variable(0.), lambda v, e: v.assign_add(tf.reduce_sum(e) * 2.)),
    "assign": (lambda: tf.Variable(0.), lambda v, e: v.assign(tf.reduce_sum(e))),
    "constant_assign_add": (lambda: tf.Variable(0.), lambda v, e: v.assign_add(1.)),
    "scatter_nd_add": (lambda: tf.Variable([0., 0.]),
                       lambda v, e: v.scatter_nd_add([[1]], [tf.reduce_max(e)])),
    "sparse_scatter": (lambda: tf.Variable([0., 0., 0.]),
                       lambda v, e: v.scatter_add(tf.IndexedSlices(e[:1], [1]))),
}


@pytest.mark.parametrize("name", sorted(_UPDATES))
@pytest.mark.parametrize("as_function", [False, True])
def test_a_variable_update_runs_per_example_as_in_map_fn(name, as_function):
    # Before: applied once, with example 0's value (as tf.vectorized_map still does).
    make, update = _UPDATES[name]
    elems = tf.constant([[1., 2.], [3., 4.], [5., -6.]])

    def run(mapper):
        v = make()

        def fn(e):
            update(v, e)
            return e * 2.

        out = mapper(tf.function(fn) if as_function else fn, elems)
        return out, v.read_value()

    want_out, want_v = run(lambda f, e: tf.map_fn(f, e))
    got_out, got_v = run(oh.vectorized_map)
    assert_close(got_out, want_out)
    assert got_v.dtype == want_v.dtype and got_v.shape == want_v.shape
    assert_close(got_v, want_v)


def test_a_variable_used_and_updated_in_the_map_is_refused():
    # tf.map_fn interleaves: example i sees the updates of examples before it, which a map
    # running each op for the whole batch cannot give.
    elems = tf.constant([1., 2., 3.])
    v = tf.Variable(0.)

    def update_then_read(e):
        v.assign_add(e)
        return v + e

    with pytest.raises(ValueError, match=r"oh.vectorized_map: op ReadVariableOp uses a "
                                         r"variable .*that op AssignAddVariableOp updated"):
        oh.vectorized_map(update_then_read, elems)

    def read_then_update(e):
        y = v * e
        v.assign_add(e)
        return y

    v.assign(10.)
    want = tf.map_fn(read_then_update, elems)  # [10, 22, 39]: later examples see updates
    assert float(v) == 16.
    v.assign(10.)
    with pytest.raises(ValueError, match=r"oh.vectorized_map: op AssignAddVariableOp updates "
                                         r".*that op ReadVariableOp used earlier"):
        oh.vectorized_map(read_then_update, elems)
    assert float(v) == 10. and want.numpy().tolist() == [10., 22., 39.]
    # Reading another variable is fine.
    w = tf.Variable(10.)

    def reads_another(e):
        y = w * e
        v.assign_add(e)
        return y

    v.assign(0.)
    want = tf.map_fn(reads_another, elems)
    v.assign(0.)
    assert_close(oh.vectorized_map(reads_another, elems), want)
    assert float(v) == 6.


def test_ragged_elems_with_uneven_rows_are_a_clear_error():
    # tf.vectorized_map fails on them too (InvalidArgumentError deep inside pfor); before,
    # oh.vectorized_map said "object of type 'RaggedTensor' has no len()". Composite
    # elements that do map: tests/handlers/vectorized_map/test_vectorized_map_composites.py.
    elems = tf.ragged.constant([[1., 2.], [3.], [4., 5., 6.]])
    with pytest.raises(tf.errors.InvalidArgumentError):
        tf.vectorized_map(lambda e: e * 2., elems)
    with pytest.raises(ValueError, match=r"oh.vectorized_map: op RaggedTensorFromVariant "
                                         r"gives outputs of different shapes.*tf.map_fn"):
        oh.vectorized_map(lambda e: e["y"] * 2., {"x": tf.ones([3]), "y": elems})
