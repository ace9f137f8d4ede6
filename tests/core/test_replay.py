"""Function calls under handlers: replay into handler-free functions.

Every test compares against plain TensorFlow on the same inputs.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.core import functions as replay

from conftest import assert_close, run_threads


@tf.function
def _inner(a):
    return a * 2.0


@tf.function
def _program(a, b):
    """A nested call, a cond and a while loop."""
    v = _inner(a)
    c = tf.cond(b > 0, lambda: v * v, lambda: tf.sin(v))
    return tf.while_loop(lambda i, s: i < 3, lambda i, s: (i + 1, s * c), [0, c])[1]


def test_replay_shows_the_body_ops_and_gives_the_plain_result():
    a, b = tf.constant(1.5), tf.constant(2.0)
    log = oh.OpLogHandler()
    with log:
        y = _program(a, b)
    assert_close(y, _program(a, b))
    seen = log.op_types_seen()
    # The nested call is inlined; cond branches and the loop body are replayed too.
    for op_type in ("Mul", "Greater", "Sin", "Less", "AddV2"):
        assert op_type in seen, (op_type, seen)
    assert not any(t.startswith("__inference") for t in seen)
    assert y.device.endswith("CPU:0")  # a transparent handler's outputs


def test_cached_replay_is_reused_and_keyed_by_handler_and_specs():
    f = tf.function(lambda t: tf.sin(t) * 3.0)
    log = oh.OpLogHandler()
    replay.clear_cache()  # counted by entries: a full cache (earlier tests) would evict one
    before = replay.cache_info()
    with log:
        f(tf.constant([1.0, 2.0]))
        f(tf.constant([3.0, 4.0]))  # same specs: cached, the log sees no more ops
    assert replay.cache_info() == before + 1
    assert log.op_types_seen() == ["Sin", "Mul", "Identity"]
    with log:
        y = f(tf.constant([1.0, 2.0, 3.0]))  # new shape: replayed again
    assert replay.cache_info() == before + 2
    assert len(log.records) == 6
    assert_close(y, np.sin([1.0, 2.0, 3.0]) * 3.0)
    other = oh.OpLogHandler()  # a new log replays, so it sees the ops
    with other:
        f(tf.constant([1.0, 2.0]))
    assert other.op_types_seen() == ["Sin", "Mul", "Identity"]


def test_check_numerics_inside_a_replayed_function_runs_at_every_call():
    f = tf.function(lambda t: tf.math.log(t) * 2.0)
    handler = oh.CheckNumericsHandler()
    with handler:
        assert_close(f(tf.constant([1.0, 2.0])), np.log([1.0, 2.0]) * 2.0)
        with pytest.raises(tf.errors.InvalidArgumentError, match="op Log produced"):
            f(tf.constant([1.0, -2.0]))  # cached replay: the check is in the function


def test_handler_scopes_compose_in_replay():
    log = oh.OpLogHandler()
    a, b = tf.constant(0.5), tf.constant(-1.0)
    with oh.CheckNumericsHandler():
        with log:
            y = _program(a, b)
    assert_close(y, _program(a, b))
    assert "Sin" in log.op_types_seen()


def test_type_based_dispatch_replays_only_dependent_ops():
    log = oh.OpLogHandler()
    with log:
        x = tf.identity(tf.constant(2.0))  # a tensor of the log's stack
    log.clear()
    f = tf.function(lambda t, u: (tf.sin(t), tf.cos(u)))
    s, c = f(x, tf.constant(0.0))  # no scope: placed by its input
    assert log.op_types_seen() == ["Sin", "Identity"]
    assert_close(s, np.sin(2.0))
    assert_close(c, 1.0)


def test_case_and_switch_case():
    @tf.function
    def f(i, x):
        return tf.switch_case(i, [lambda: x + 1.0, lambda: x * 10.0, lambda: -x])

    log = oh.OpLogHandler()
    for i in range(3):
        with log:
            y = f(tf.constant(i), tf.constant(2.0))
        assert_close(y, f(tf.constant(i), tf.constant(2.0)))
    assert {"AddV2", "Mul", "Neg"} <= set(log.op_types_seen())


def test_variables_updated_once_per_call_in_order():
    v = tf.Variable(1.0)

    @tf.function
    def step(x):
        v.assign_add(x)
        w = v.read_value() * 2.0  # reads after the write
        v.assign(w)
        return w

    ref = tf.Variable(1.0)

    @tf.function
    def ref_step(x):
        ref.assign_add(x)
        w = ref.read_value() * 2.0
        ref.assign(w)
        return w

    for k in range(3):
        with oh.OpLogHandler():
            y = step(tf.constant(float(k)))
        assert_close(y, ref_step(tf.constant(float(k))))
        assert_close(v, ref)


@pytest.mark.parametrize("tape_kind", ["oh_over", "oh_under", "tf_over"])
def test_gradients_through_replayed_control_flow(tape_kind):
    a, b = tf.constant(1.5), tf.constant(2.0)
    with tf.GradientTape() as ref_tape:
        ref_tape.watch(a)
        ref_y = _program(a, b)
    expected = ref_tape.gradient(ref_y, a)
    log = oh.OpLogHandler()
    if tape_kind == "oh_over":
        with oh.GradientTape() as tape:
            tape.watch(a)
            with log:
                y = _program(a, b)
    elif tape_kind == "oh_under":
        with log:
            with oh.GradientTape() as tape:
                tape.watch(a)
                y = _program(a, b)
    else:
        with tf.GradientTape() as tape:
            tape.watch(a)
            with log:
                y = _program(a, b)
    assert_close(y, ref_y)
    assert_close(tape.gradient(y, a), expected)
    assert "Less" in log.op_types_seen()  # the log replayed the loop


def test_second_order_through_replayed_function():
    a, b = tf.constant(0.7), tf.constant(-1.0)
    with tf.GradientTape() as t2:
        t2.watch(a)
        with tf.GradientTape() as t1:
            t1.watch(a)
            y = _program(a, b)
        g = t1.gradient(y, a)
    expected = t2.gradient(g, a)
    with oh.GradientTape() as t2:
        t2.watch(a)
        with oh.GradientTape() as t1:
            t1.watch(a)
            with oh.OpLogHandler():
                y = _program(a, b)
        g = t1.gradient(y, a)
    assert_close(t2.gradient(g, a), expected)


def test_keras_model_under_replay_matches_plain():
    import keras
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)])
    call = tf.function(lambda x: model(x, training=False))
    x = tf.random.stateless_normal([4, 6], seed=[1, 2])
    with tf.GradientTape() as ref_tape:
        ref = call(x)
        ref_loss = tf.reduce_sum(ref ** 2)
    ref_grads = ref_tape.gradient(ref_loss, model.trainable_variables)
    log = oh.OpLogHandler()
    with oh.GradientTape() as tape:
        with log:
            y = call(x)
            loss = tf.reduce_sum(y ** 2)
    assert log.op_types_seen().count("MatMul") == 2  # the forward call, replayed
    grads = tape.gradient(loss, model.trainable_variables)
    assert_close(y, ref)
    for g, r in zip(grads, ref_grads):
        assert_close(g, r)
    # The tape is below the log: it recorded the replayed function (what reached it,
    # call_records.py) and runs its backward below the log, as it does for eager ops
    # (the log sees no gradient MatMuls either way).
    assert log.op_types_seen().count("MatMul") == 2
    with log:
        tf.matmul(x, model.trainable_variables[0])
    with oh.GradientTape() as eager_tape:
        with log:
            loss = tf.reduce_sum(tf.matmul(x, model.trainable_variables[0]))
    eager_tape.gradient(loss, model.trainable_variables[0])
    assert log.op_types_seen().count("MatMul") == 4


# -- handler scopes opened while a function is traced ------------------------------------------

def test_rfc_trace_time_handler_example():
    @tf.function(input_signature=[tf.TensorSpec(shape=[], dtype=tf.float32)])
    def trace_time_handler(x):
        with oh.GradientTape() as tape:
            tape.watch(x)
            y = 2. * x
        return tape.gradient(y, x)

    concrete = trace_time_handler.get_concrete_function()
    # The gradient ops are in the function body; no handler is involved in the call.
    assert "Mul" in [n.op for n in concrete.function_def.node_def]
    assert float(concrete(tf.constant(3.))) == 2.0


def test_trace_time_tape_accumulator_and_vectorized_map_match_tensorflow():
    v = tf.Variable([1.0, 2.0])

    @tf.function
    def f(x):
        with oh.GradientTape() as tape:
            loss = tf.reduce_sum(tf.sin(x * v))
        g = tape.gradient(loss, v)
        with oh.ForwardAccumulator(x, tf.ones_like(x)) as acc:
            y = tf.exp(x)
        j = acc.jvp(y)
        m = oh.vectorized_map(lambda r: tf.reduce_sum(r * r), tf.reshape(x, [2, 1]))
        return g, j, m

    x = tf.constant([0.3, -0.2])
    g, j, m = f(x)
    assert_close(g, x.numpy() * np.cos(x.numpy() * v.numpy()))
    assert_close(j, np.exp(x.numpy()))
    assert_close(m, x.numpy() ** 2)


def test_scope_opened_while_tracing_runs_on_the_handler_at_call_time():
    log = oh.OpLogHandler()

    @tf.function
    def f(x):
        y = tf.sin(x)  # outside the scope: not the log's
        with log:
            z = y * 2.0
            w = tf.cond(z > 0, lambda: z + 1.0, lambda: z - 1.0)
        return w

    assert log.records == []  # nothing runs on the handler while tracing
    for value in (1.0, -1.0):
        x = tf.constant(value)
        expected = (np.sin(value) * 2 + 1) if np.sin(value) > 0 else (np.sin(value) * 2 - 1)
        assert_close(f(x), expected)
    seen = log.op_types_seen()
    assert "Sin" not in seen and {"Mul", "Greater", "AddV2", "Sub"} <= set(seen)


def test_scope_opened_while_tracing_merges_onto_the_stack_of_the_call():
    log = oh.OpLogHandler()

    @tf.function
    def f(x):
        with log:
            return tf.math.log(x)

    with oh.CheckNumericsHandler():
        assert_close(f(tf.constant(2.0)), np.log(2.0))
        with pytest.raises(tf.errors.InvalidArgumentError, match="op Log produced"):
            f(tf.constant(-2.0))
    assert log.op_types_seen().count("Log") >= 1


def test_check_numerics_scope_inside_a_function_never_silently_skips():
    @tf.function
    def f(x):
        with oh.CheckNumericsHandler():
            return tf.sqrt(x)

    assert_close(f(tf.constant(4.0)), 2.0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="op Sqrt produced NaN"):
        f(tf.constant(-4.0))


def test_handlers_that_take_calls_whole_refuse_trace_time_scopes():
    @tf.function
    def f(x):
        with oh.ParallelHandler(["CPU:0", "CPU:1"]):
            return x * 2.0

    with pytest.raises(Exception, match="cannot be opened inside a function being traced"):
        f(tf.constant(1.0))


def test_saving_a_function_that_depends_on_a_live_handler_is_an_error(tmp_path):
    log = oh.OpLogHandler()
    module = tf.Module()
    module.f = tf.function(lambda x: _with(log, lambda: x * 2.0),
                           input_signature=[tf.TensorSpec([], tf.float32)])
    with pytest.raises(oh.HandlerError, match="depends on the live handler stack"):
        tf.saved_model.save(module, str(tmp_path / "m"))
    plain = tf.Module()
    plain.f = tf.function(lambda x: x * 2.0, input_signature=[tf.TensorSpec([], tf.float32)])
    tf.saved_model.save(plain, str(tmp_path / "plain"))  # no handler: saves


def _with(handler, fn):
    with handler:
        return fn()


# -- SavedModels --------------------------------------------------------------------------------

class _Scaled(tf.Module):
    def __init__(self):
        super().__init__()
        self.w = tf.Variable([[1.0, 2.0], [3.0, -4.0]])

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)])
    def __call__(self, x):
        h = tf.matmul(x, self.w)
        return tf.cond(tf.reduce_sum(h) > 0, lambda: tf.tanh(h), lambda: h * 2.0)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_saved_model_functions_run_and_differentiate_under_handlers(tmp_path, sign):
    original = _Scaled()
    tf.saved_model.save(original, str(tmp_path / "m"))
    loaded = tf.saved_model.load(str(tmp_path / "m"))
    x = tf.constant([[1.0, -1.0], [0.5, 0.25]]) * sign
    with tf.GradientTape() as ref_tape:
        ref = original(x)
    ref_grad = ref_tape.gradient(ref, original.w)
    log = oh.OpLogHandler()
    with oh.GradientTape() as tape:
        with log:
            y = loaded(x)
    assert_close(y, ref)
    assert_close(tape.gradient(y, loaded.w), ref_grad)
    assert "MatMul" in log.op_types_seen() and "If" not in log.op_types_seen()


def test_keras_export_artifact_under_handlers(tmp_path):
    import keras
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="relu"),
                              keras.layers.Dense(2)])
    model.export(str(tmp_path / "export"), verbose=False)
    artifact = tf.saved_model.load(str(tmp_path / "export"))
    x = tf.random.stateless_normal([3, 4], seed=[4, 5])
    with tf.GradientTape() as ref_tape:
        ref_tape.watch(x)
        ref = model(x)
    ref_grad = ref_tape.gradient(ref, x)
    log = oh.OpLogHandler()
    with oh.GradientTape() as tape:
        tape.watch(x)
        with oh.CheckNumericsHandler(), log:
            y = artifact.serve(x)
    assert log.op_types_seen().count("MatMul") == 2
    assert_close(y, ref)
    assert_close(tape.gradient(y, x), ref_grad)


# -- Keras fit ------------------------------------------------------------------------------------

def _fit(handler):
    import keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    rng = np.random.RandomState(0)
    x = rng.randn(64, 8).astype("float32")
    y = x.sum(1, keepdims=True)
    if handler is None:
        return model.fit(x, y, epochs=2, batch_size=16, verbose=0, shuffle=False).history["loss"]
    with handler:
        return model.fit(x, y, epochs=2, batch_size=16, verbose=0, shuffle=False).history["loss"]


def test_keras_fit_under_op_log_and_check_numerics_has_the_same_losses():
    plain = _fit(None)
    log = oh.OpLogHandler()
    assert _fit(log) == plain
    assert {"MatMul", "ReluGrad", "AssignVariableOp"} <= set(log.op_types_seen())
    assert _fit(oh.CheckNumericsHandler()) == plain


def test_custom_training_step_in_tf_function_with_oh_gradient_tape():
    import keras
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(1)])
    ref_model = keras.models.clone_model(model)
    ref_model.set_weights(model.get_weights())
    opt, ref_opt = keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)
    x = tf.random.stateless_normal([8, 3], seed=[0, 1])
    y = tf.reduce_sum(x, axis=1, keepdims=True)

    def make_step(m, o, tape_cls):
        @tf.function
        def step():
            with tape_cls() as tape:
                loss = tf.reduce_mean((m(x) - y) ** 2)
            o.apply_gradients(zip(tape.gradient(loss, m.trainable_variables),
                                  m.trainable_variables))
            return loss
        return step

    step = make_step(model, opt, oh.GradientTape)
    ref_step = make_step(ref_model, ref_opt, tf.GradientTape)
    for _ in range(3):
        assert_close(step(), ref_step())


# -- regressions from the review of the replay -------------------------------------------------

def test_accumulator_below_a_pass_through_handler_keeps_tangents_of_arguments():
    f = tf.function(lambda x: tf.sin(x) * 2.0)
    x = tf.constant(1.5)
    with oh.ForwardAccumulator(x, tf.constant(1.0)) as acc:
        with oh.OpLogHandler():
            y = f(x)
    assert_close(acc.jvp(y), 2.0 * np.cos(1.5))


def test_tangent_appearing_in_one_branch_under_an_outer_handler():
    f = tf.function(lambda x: tf.cond(x > 0, lambda: x * 2.0, lambda: tf.constant(1.0)))
    x = tf.constant(1.2)
    with oh.OpLogHandler():
        with oh.ForwardAccumulator(x, tf.constant(1.0)) as acc:
            y = f(x)
    assert_close(acc.jvp(y), 2.0)


def test_replay_cache_is_keyed_by_physical_placement():
    f = tf.function(lambda t: t * 3.0)
    x = tf.constant([1.0, 2.0])
    with oh.OpLogHandler():
        with tf.device("CPU:1"):
            f(x)
        before = replay.cache_info()
        with tf.device("CPU:0"):
            f(x)
    assert replay.cache_info() == before + 1


def test_tf_function_called_by_a_hook_is_replayed_on_the_next_stack():
    helper = tf.function(lambda t: tf.identity(t))

    class CallsHelper(oh.OpHandler):
        def execute(self, op, inputs):
            outs = self.next.execute(op, inputs)
            return [helper(outs[0])] if op.type == "Mul" else outs

    f = tf.function(lambda t: tf.sin(t) * 2.0)
    x = tf.constant(1.5)
    with oh.ForwardAccumulator(x, tf.constant(1.0)) as acc:
        with CallsHelper():
            y = f(x)
    assert_close(acc.jvp(y), 2.0 * np.cos(1.5))


def test_hook_building_control_flow_while_replaying_is_a_clear_error():
    class CondHook(oh.OpHandler):
        def execute(self, op, inputs):
            outs = self.next.execute(op, inputs)
            if op.type != "Mul":
                return outs
            o = outs[0]
            return [tf.cond(tf.reduce_any(tf.math.is_nan(o)), lambda: tf.zeros_like(o),
                            lambda: o)]

    f = tf.function(lambda t: t * 2.0)
    with CondHook():  # the hook's next stack is physical: its cond is built as it is
        assert_close(f(tf.constant([1.0, 2.0])), [2.0, 4.0])
    with pytest.raises(Exception, match="hook built a nested graph"):
        with oh.OpLogHandler():  # on tensors of a handler below: refused, clearly
            with CondHook():
                f(tf.constant([1.0, 2.0]))


def test_rfc_no_handler_example_with_a_concrete_function():
    @tf.function(input_signature=[tf.TensorSpec(shape=[], dtype=tf.float32)])
    def no_handler(x):
        return 2. * x

    concrete = no_handler.get_concrete_function()
    log = oh.OpLogHandler()
    with oh.GradientTape() as tape:
        a = tf.constant(3.)
        tape.watch(a)
        with log:
            b = concrete(a)
    assert float(b) == 6.0
    assert float(tape.gradient(b, a)) == 2.0
    assert "Mul" in log.op_types_seen()  # the ConcreteFunction's body, replayed


def test_replays_from_several_threads():
    f = tf.function(lambda t: tf.cond(tf.reduce_sum(t) > 0, lambda: t * 2.0, lambda: -t))
    results, errors = {}, []

    def work(k):
        try:
            log = oh.OpLogHandler()
            for i in range(15):
                x = tf.constant([float(k - 1), float(i)])
                with log:
                    results[(k, i)] = (f(x).numpy(), f(x).numpy() is not None)
        except Exception as e:  # pylint: disable=broad-except
            errors.append(e)

    run_threads([lambda k=k: work(k) for k in range(3)])
    assert errors == []
    for (k, i), (value, _) in results.items():
        x = np.array([k - 1.0, float(i)], np.float32)
        assert_close(value, x * 2.0 if x.sum() > 0 else -x)
