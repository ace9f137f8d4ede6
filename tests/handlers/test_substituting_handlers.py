"""Handlers that change what an op computes (OpHandler.changes_computation): Relu run as
LeakyRelu(alpha), by a Python handler and by a C++ one (tests/native/leaky_relu_handler.cc).
Under every tape the gradient is that of what ran: each case is compared with the same
program written by hand with tf.nn.leaky_relu under TensorFlow's own tape.
"""
import contextlib
import os
import re

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from test_differential import _same  # values, dtypes, shapes, IndexedSlices, None

ALPHA = 0.1
NATIVE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "native")


class PyLeakyRelu(oh.OpHandler):
    """Runs every Relu as LeakyRelu(alpha) (declares nothing: substituting by default)."""

    def execute(self, op, inputs):
        if op.type == "Relu":
            leaky = oh.Op.create("LeakyRelu", T=op.attrs["T"], alpha=ALPHA)
            return self.next.execute(leaky, inputs)
        return self.next.execute(op, inputs)


@pytest.fixture(scope="module")
def CLeakyRelu():  # pylint: disable=invalid-name
    import sys
    sys.path.insert(0, NATIVE)
    try:
        from test_native_handlers import build_handler_library
    finally:
        sys.path.remove(NATIVE)
    path = build_handler_library(os.path.join(NATIVE, "leaky_relu_handler.cc"))
    cls = oh.load_handler_library(path).handler_types()["LeakyRelu"]
    return lambda: cls(str(ALPHA))


@pytest.fixture(params=["python", "c"])
def substitute(request):
    if request.param == "python":
        return PyLeakyRelu
    return request.getfixturevalue("CLeakyRelu")


def _relu_program(x, w, relu=tf.nn.relu):
    h = relu(tf.matmul(x, w) - 0.2)
    return tf.reduce_sum(relu(tf.sin(h) * 2.0 - 0.5) * h, axis=1)


def _leaky(t):
    return tf.nn.leaky_relu(t, alpha=ALPHA)


def _inputs():
    r = np.random.default_rng(7)
    return (tf.constant(r.standard_normal((3, 4)).astype(np.float32)),
            tf.Variable(r.standard_normal((4, 5)).astype(np.float32)))


def _tf_tape(program, handler):
    x, w = _inputs()
    with tf.GradientTape() as tape:
        tape.watch(x)
        if handler is None:
            y = program(x, w)
        else:
            with handler():
                y = program(x, w)
    return [y] + tape.gradient(y, [x, w])


def test_tf_gradient_tape_outside_gives_the_substitute_gradient(substitute):
    want = _tf_tape(lambda x, w: _relu_program(x, w, _leaky), None)
    got = _tf_tape(_relu_program, substitute)
    _same(want, got, "tf.GradientTape > substituting handler")


def _oh_tape(program, handler):
    x, w = _inputs()
    with oh.GradientTape() as tape:
        tape.watch(x)
        with handler():
            y = program(x, w)
    return [y] + tape.gradient(y, [x, w])


def test_oh_gradient_tape_outside_gives_the_substitute_gradient(substitute):
    want = _tf_tape(lambda x, w: _relu_program(x, w, _leaky), None)
    got = _oh_tape(_relu_program, substitute)
    _same(want, got, "oh.GradientTape > substituting handler")


@pytest.mark.parametrize("around", ["OpLogHandler", "OpHandler"])
def test_a_substitute_below_or_above_a_transparent_handler(substitute, around):
    # The record sits on the representation at the substituting handler's level; the
    # tape's output is a tensor of the handler above it (or below it).
    want = _tf_tape(lambda x, w: _relu_program(x, w, _leaky), None)
    other = getattr(oh, around)
    for outer, inner in ((substitute, other), (other, substitute)):
        def both(outer=outer, inner=inner):
            class _Both:
                def __enter__(self):
                    self._o, self._i = outer(), inner()
                    self._o.__enter__()
                    self._i.__enter__()

                def __exit__(self, *exc):
                    self._i.__exit__(*exc)
                    self._o.__exit__(*exc)
            return _Both()
        got = _tf_tape(_relu_program, both)
        _same(want, got, "tf.GradientTape > %s > %s" % (outer, inner))


def test_persistent_tf_tape_and_second_gradient(substitute):
    x, w = _inputs()
    results = {}
    for name, (handler, relu) in {"tf": (None, _leaky), "oh": (substitute, tf.nn.relu)}.items():
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            if handler is None:
                y = _relu_program(x, w, relu)
            else:
                with handler():
                    y = _relu_program(x, w, relu)
        results[name] = [tape.gradient(y, x), tape.gradient(y, x), tape.gradient(y, w)]
    _same(results["tf"], results["oh"], "persistent tf.GradientTape, three gradients")


def test_an_op_whose_gradient_keeps_no_output_raises_naming_handler_and_op():
    # MatMul's registered gradient reads only its inputs, so TensorFlow's tape keeps no
    # output to find what ran by: a clear error at the op, never MatMul's gradient.
    class Bf16MatMul(oh.OpHandler):
        def execute(self, op, inputs):
            if op.type == "MatMul":
                low = [tf.cast(t, tf.bfloat16) for t in inputs]
                (out,) = self.next.execute(op.replace(T=tf.bfloat16), low)
                return [tf.cast(out, tf.float32)]
            return self.next.execute(op, inputs)

    x, w = _inputs()
    with tf.GradientTape() as tape:
        tape.watch(x)
        with Bf16MatMul():
            with pytest.raises(oh.HandlerError, match=r"Bf16MatMul\(\).*MatMul"):
                tf.matmul(x, w)
            y = tf.nn.relu(x)  # ops it runs unchanged keep their own gradient
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), (x.numpy() > 0).astype(np.float32))


def test_declared_pass_through_keeps_todays_path():
    # A handler that declares it computes every op unchanged is not recorded.
    class Logging(oh.OpHandler):
        changes_computation = False
        seen = 0

        def execute(self, op, inputs):
            Logging.seen += 1
            return self.next.execute(op, inputs)

    x, w = _inputs()
    with tf.GradientTape() as tape:
        tape.watch(x)
        with Logging():
            y = _relu_program(x, w)
    _same(_tf_tape(_relu_program, None), [y] + tape.gradient(y, [x, w]), "declared pass-through")
    assert oh.handler_of(y) is not None and not oh.handler_of(y)._substituting


# -- the execute contract in replays --------------------------------------

class _WrongDtype(oh.OpHandler):
    def execute(self, op, inputs):
        out = self.next.execute(op, inputs)
        return [tf.cast(out[0], tf.float64)] if op.type == "Sin" else out


class _TooMany(oh.OpHandler):
    def execute(self, op, inputs):
        out = self.next.execute(op, inputs)
        return list(out) * 2 if op.type == "Sin" else out


class _TooFew(oh.OpHandler):
    def execute(self, op, inputs):
        out = self.next.execute(op, inputs)
        return [] if op.type == "Sin" else out


def _error_text(handler, fn, x):
    with pytest.raises(oh.HandlerOutputError) as info:
        with handler():
            fn(x)
    return re.sub(r"device:(\w+):\d+", r"device:\1:N", str(info.value))


@pytest.mark.parametrize("handler", [_WrongDtype, _TooMany, _TooFew],
                         ids=["dtype", "too_many", "too_few"])
def test_replayed_function_checks_hook_outputs_as_eager(handler):
    # A wrong dtype gave TensorFlow's "2 errors while building NodeDef 'AddV2'" naming no
    # handler; a wrong count gave no error at all (or a KeyError).
    x = tf.constant([1.0, 2.0])
    program = lambda t: tf.sin(t) + 1.0  # noqa: E731
    eager = _error_text(handler, program, x)
    replay = _error_text(handler, tf.function(program, autograph=False), x)
    assert "invalid outputs for op Sin" in replay and handler.__name__ in replay
    if handler is not _TooFew:  # (eager cannot name a handler that returned no tensor)
        assert replay == eager
    # nothing kept from the failed replay: the same function under a correct handler
    f = tf.function(program, autograph=False)
    with pytest.raises(oh.HandlerOutputError):
        with handler():
            f(x)
    with oh.OpLogHandler():
        np.testing.assert_allclose(f(x).numpy(), program(x).numpy())


# -- functions: gradient ops built at trace time --------------------------

def _step(program):
    @tf.function(autograph=False)
    def step(x, w):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = program(x, w)
        return [y] + tape.gradient(y, [x, w])
    return step


def test_function_with_gradient_ops_is_retraced_under_a_substitute(substitute):
    # The step's ReluGrad ops were built for Relu when it was traced: replayed under the
    # handler they gave Relu's gradient of the LeakyRelu that ran ([0. 0. 1. 1.]), then a
    # refusal. Its Python body is traced again under the handler: the tape inside records
    # what ran.
    x, w = _inputs()
    want = _step(lambda x, w: _relu_program(x, w, _leaky))(x, w)
    step = _step(_relu_program)
    relu_want = step(x, w)
    with substitute():
        got = step(x, w)
        again = step(x, w)  # the cached re-trace
    _same(want, got, "a tf.function step with a tf.GradientTape inside, re-traced")
    _same(want, again, "the same step, second call")
    # nothing kept: the step without the handler, and under a declared pass-through
    _same(relu_want, step(x, w), "the step after the re-trace")
    with oh.OpLogHandler():
        _same(relu_want, step(x, w), "the step under OpLogHandler")


@pytest.mark.parametrize("order", ["substitute_outside", "substitute_inside"])
def test_a_retraced_step_with_a_transparent_handler_on_the_stack(substitute, order):
    # The record of what ran is found through the representations of the handler above
    # (or the substitute's outputs are below a logging handler).
    x, w = _inputs()
    want = _step(lambda x, w: _relu_program(x, w, _leaky))(x, w)
    step = _step(_relu_program)
    outer, inner = ((substitute, oh.OpLogHandler) if order == "substitute_outside"
                    else (oh.OpLogHandler, substitute))
    with outer():
        with inner():
            got = step(x, w)
    _same(want, got, "step under %s" % order)


def test_a_function_traced_before_the_runtime_noted_traces_is_retraced():
    # A step traced before the first handler scope opened (no note of its Python
    # function) was refused; it is found among the live tf.function objects.
    from tf_ophandlers.core.functions import retrace
    x, w = _inputs()
    step = _step(_relu_program)
    step(x, w)
    retrace._sources.clear()  # pylint: disable=protected-access  (as before any scope)
    with PyLeakyRelu():
        got = step(x, w)
    _same(_step(lambda x, w: _relu_program(x, w, _leaky))(x, w), got, "found by a scan")


def _counted_step(program):
    traces = []

    @tf.function(autograph=False)
    def step(x, w):
        traces.append(1)  # once per trace of the Python body
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = program(x, w)
        return [y] + tape.gradient(y, [x, w])
    return step, traces


class _PassThrough(oh.OpHandler):
    changes_computation = False

    def execute(self, op, inputs):
        return self.next.execute(op, inputs)


def test_pass_through_handlers_replay_without_retracing(substitute):
    x, w = _inputs()
    step, traces = _counted_step(_relu_program)
    want = step(x, w)
    assert len(traces) == 1
    for handler in (oh.OpLogHandler, _PassThrough, _PassThrough):
        with handler():
            _same(want, step(x, w), handler.__name__)
    assert len(traces) == 1  # replayed from the traced body, never re-traced
    # a substituting handler re-traces once per handler configuration (the replay
    # cache's key: function, arguments, handlers' cache keys and types)
    h = substitute()
    with h:
        step(x, w)
        step(x, w)
    assert len(traces) == 2
    with h:
        step(x, w)
    assert len(traces) == 2


def test_a_retraced_function_is_not_kept_alive():
    import gc
    import weakref
    from tf_ophandlers.core import functions
    x, w = _inputs()
    step = _step(_relu_program)
    step(x, w)
    gc.collect()
    before = functions.cache_info()
    with PyLeakyRelu():
        step(x, w)
    assert functions.cache_info() == before + 1  # the re-traced replay
    ref = weakref.ref(step)
    fn = weakref.ref(step.python_function)
    del step
    gc.collect()
    assert ref() is None and fn() is None
    # its replay (holding what the body captured) goes with the function
    assert functions.cache_info() == before


# -- control flow in a re-traced step ------------------------------------------------------

def _two_layers():
    r = np.random.default_rng(3)
    return (tf.Variable(r.standard_normal((4, 6)).astype(np.float32)),
            tf.Variable(r.standard_normal((6, 1)).astype(np.float32)))


def _loss(x, y, a, b, relu, conditional=False):
    h = relu(tf.matmul(x, a))
    loss = tf.reduce_mean((tf.matmul(h, b) - y) ** 2)
    if conditional:
        # A conditional loss term whose branches capture both the loss and the
        # activation it is computed from (the branch's gradient is a partial one).
        loss = tf.cond(tf.reduce_mean(h) > 0.3,
                       lambda: loss + 0.1 * tf.reduce_mean(relu(h - 0.5)),
                       lambda: loss * 1.5)
    return loss


def _train(make_step, relu, handler):
    """Three SGD steps of the step `make_step(relu, w1, w2)` builds: losses, weights."""
    w1, w2 = _two_layers()
    step = make_step(relu, w1, w2)
    r = np.random.default_rng(0)
    x = tf.constant(r.standard_normal((8, 4)).astype(np.float32))
    y = tf.constant(r.standard_normal((8, 1)).astype(np.float32))
    h = handler() if handler is not None else None
    losses = []
    for _ in range(3):
        with h if h is not None else contextlib.nullcontext():
            losses.append(step(x, y))
    return [tf.stack(losses), w1.read_value(), w2.read_value()]


def _check_trains_as_the_substitute(make_step, substitute, what):
    want = _train(make_step, _leaky, None)
    relu = _train(make_step, tf.nn.relu, None)
    assert not np.allclose(want[0].numpy(), relu[0].numpy())  # the substitute matters
    _same(want, _train(make_step, tf.nn.relu, substitute), what)


def _sgd_update(tape, loss, w1, w2):
    g1, g2 = tape.gradient(loss, [w1, w2])
    w1.assign_sub(0.1 * g1)
    w2.assign_sub(0.1 * g2)


def _cond_step(relu, w1, w2):
    @tf.function(autograph=False)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = _loss(x, y, w1, w2, relu, conditional=True)
        _sgd_update(tape, loss, w1, w2)
        return loss
    return step


def test_a_retraced_training_step_with_tf_cond(substitute):
    # Its branches were traced as functions on the handlers' tensors, which the re-trace
    # refused. They are interpreted on the handlers as a traced function's are, and the
    # tape inside gets the gradient of the If that ran.
    _check_trains_as_the_substitute(_cond_step, substitute, "a step with tf.cond")


def _loop_step(relu, w1, w2):
    @tf.function(autograph=False)
    def step(x, y):
        with tf.GradientTape() as tape:
            _, h = tf.while_loop(
                lambda i, h: i < 3,
                lambda i, h: (i + 1, relu(tf.matmul(h, tf.ones((4, 4)) * 0.3) - 0.1)),
                [tf.constant(0), x])
            loss = _loss(h, y, w1, w2, relu)
        _sgd_update(tape, loss, w1, w2)
        return loss
    return step


def test_a_retraced_training_step_with_tf_while_loop(substitute):
    # The loop's body ran Relu below the handler (its While went whole to the bottom):
    # Relu's losses and weights, silently.
    _check_trains_as_the_substitute(_loop_step, substitute, "a step with tf.while_loop")


def _autograph_step(relu, w1, w2):
    @tf.function  # autograph's if and for on tensors, and tf.switch_case
    def step(x, y):
        with tf.GradientTape() as tape:
            h = x
            for _ in tf.range(2):
                h = relu(h * 0.9 + 0.1)
            loss = _loss(h, y, w1, w2, relu)
            if tf.reduce_mean(h) > 0.3:
                loss = loss + 0.1 * tf.reduce_mean(relu(h - 0.5))
            loss = tf.switch_case(tf.cast(loss > 1.0, tf.int32),
                                  [lambda: loss, lambda: tf.reduce_mean(relu(loss - 1.0)) + 1.0])
        _sgd_update(tape, loss, w1, w2)
        return loss
    return step


def test_a_retraced_training_step_with_autograph_control_flow(substitute):
    # The re-traced body ran with autograph disabled (the replay's own trace): a Python
    # `if` on a tensor raised OperatorNotAllowedInGraphError.
    _check_trains_as_the_substitute(_autograph_step, substitute, "autograph if/for, switch_case")


def _inner_sgd_step(relu, w1, w2):
    @tf.function(autograph=False)
    def inner(x, y, a, b):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            loss = _loss(x, y, a, b, relu)
        ga, gb = tape.gradient(loss, [a, b])
        return loss, a - 0.1 * ga, b - 0.1 * gb

    @tf.function(autograph=False)
    def step(x, y):
        _, loss, a, b = tf.while_loop(
            lambda i, *_: i < 3, lambda i, _, a, b: (i + 1,) + inner(x, y, a, b),
            [tf.constant(0), tf.constant(0.0), w1.read_value(), w2.read_value()])
        w1.assign(a)
        w2.assign(b)
        return loss
    return step


def test_a_retraced_step_with_an_inner_loop_of_sgd_steps(substitute):
    # A tf.function holding gradient ops, called in the loop body: its Python body is
    # traced again under the handler too.
    _check_trains_as_the_substitute(_inner_sgd_step, substitute, "an inner loop of SGD steps")


def test_a_tape_inside_a_loop_body_of_a_retraced_step_is_refused_clearly(substitute):
    # Gradient ops built in the loop body's own trace are those of the original ops;
    # they would be interpreted as they are.
    def make_step(relu, w1, w2):
        @tf.function(autograph=False)
        def step(x, y):
            def body(i, _, a, b):
                with tf.GradientTape() as tape:
                    tape.watch([a, b])
                    loss = _loss(x, y, a, b, relu)
                ga, gb = tape.gradient(loss, [a, b])
                return i + 1, loss, a - 0.1 * ga, b - 0.1 * gb
            _, loss, a, b = tf.while_loop(
                lambda i, *_: i < 3, body,
                [tf.constant(0), tf.constant(0.0), w1.read_value(), w2.read_value()])
            w1.assign(a)
            w2.assign(b)
            return loss
        return step

    with pytest.raises(oh.HandlerError, match=r"function __inference_step_\d+ holds gradient "
                       r"ops and runs under .*LeakyRelu.*control flow \(StatelessWhile .*"
                       r"gradient ops built in a branch or loop body \(gradient_tape/"):
        _train(make_step, tf.nn.relu, substitute)
    # nothing kept: the same program without the handler
    _same(_train(make_step, tf.nn.relu, None), _train(make_step, tf.nn.relu, None), "after")


def test_a_step_differentiating_a_nested_function_call_refuses_a_substitute(substitute):
    # The step's only gradient ops are in the backward function TensorFlow's tape built
    # for the call (named "gradients/" there): taken for a step without gradient ops,
    # it was replayed with Relu's gradient of the LeakyRelu that ran, silently.
    def make(relu):
        forward = tf.function(lambda x, w: tf.reduce_sum(relu(tf.matmul(x, w))),
                              autograph=False)

        @tf.function(autograph=False)
        def step(x, w):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = forward(x, w)
            return [y] + tape.gradient(y, [x, w])
        return step

    x, w = _inputs()
    step = make(tf.nn.relu)
    with pytest.raises(oh.HandlerError, match=r"LeakyRelu.*op Relu .*"
                       r"__inference___backward_"):
        with substitute():
            step(x, w)
    _same(make(tf.nn.relu)(x, w), step(x, w), "the step after the refusal")


def test_function_with_gradient_ops_and_no_substitution_runs(substitute):
    # The handler substitutes nothing in this step (no Relu): its gradients are right.
    program = lambda x, w: tf.reduce_sum(tf.tanh(tf.matmul(x, w)) * 2.0, axis=1)  # noqa: E731
    x, w = _inputs()
    want = _step(program)(x, w)
    with substitute():
        got = _step(program)(x, w)
    _same(want, got, "a step with gradient ops under a handler that substitutes nothing")


def test_tf_tape_over_a_function_call_refuses_a_substitute(substitute):
    # TensorFlow's tape records the call with a backward function built from Relu.
    x, w = _inputs()
    f = tf.function(_relu_program, autograph=False)
    with tf.GradientTape() as tape:
        tape.watch(x)
        with substitute():
            with pytest.raises(oh.HandlerError, match=r"op Relu of function"):
                f(x, w)


def test_tf_tape_over_a_step_holding_gradient_ops_refuses_a_substitute(substitute):
    # Re-tracing cannot help: TensorFlow's tape outside builds the call's backward
    # function from the traced body. The refusal says so.
    x, w = _inputs()
    step = _step(_relu_program)
    with tf.GradientTape() as tape:
        tape.watch(x)
        with substitute():
            with pytest.raises(oh.HandlerError, match=r"op Relu.*TensorFlow tape outside "
                               r"records the call"):
                step(x, w)


def test_oh_tape_over_a_function_call_gives_the_substitute_gradient(substitute):
    want = _tf_tape(lambda x, w: _relu_program(x, w, _leaky), None)
    got = _oh_tape(tf.function(_relu_program, autograph=False), substitute)
    _same(want, got, "oh.GradientTape > substituting handler > tf.function")


def _jvp(accumulator, program, handler):
    x, w = _inputs()
    with accumulator(x, tf.ones_like(x)) as acc:
        if handler is None:
            y = program(x, w)
        else:
            with handler():
                y = program(x, w)
    return [y, acc.jvp(y)]


def test_forward_accumulators_outside_a_substitute(substitute):
    # tf.autodiff.ForwardAccumulator gave Relu's JVP of the LeakyRelu that ran (its JVP
    # functions are traced per op signature, out of reach of the record): refused;
    # oh.ForwardAccumulator sees what ran.
    want = _jvp(tf.autodiff.ForwardAccumulator, lambda x, w: _relu_program(x, w, _leaky), None)
    _same(want, _jvp(oh.ForwardAccumulator, _relu_program, substitute),
          "oh.ForwardAccumulator > substituting handler")
    with pytest.raises(oh.HandlerError, match=r"in place of op Relu.*ForwardAccumulator"):
        _jvp(tf.autodiff.ForwardAccumulator, _relu_program, substitute)


def _fit(handler, activation, run_eagerly, steps_per_execution=1):
    r = np.random.default_rng(0)
    x = r.standard_normal((16, 4)).astype(np.float32)
    y = r.standard_normal((16, 1)).astype(np.float32)
    tf.keras.utils.set_random_seed(1)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(8, activation),
                                 tf.keras.layers.Dense(1)])
    model.compile(tf.keras.optimizers.SGD(0.1), "mse", run_eagerly=run_eagerly,
                  steps_per_execution=steps_per_execution)
    with handler() if handler is not None else contextlib.nullcontext():
        history = model.fit(x, y, epochs=2, batch_size=8, verbose=0, shuffle=False)
    return [tf.constant(history.history["loss"])] + model.get_weights()


def test_keras_fit_under_a_substitute(substitute):
    # The example: fit's compiled step silently trained with Relu's gradient
    # (losses 0.84200 vs 0.84184), then was refused. Its step is re-traced under the
    # handler: compiled and run eagerly, it trains as the model written with leaky_relu.
    want = _fit(None, _leaky, False)
    _same(want, _fit(substitute, "relu", False), "fit, compiled")
    _same(_fit(None, _leaky, True), _fit(substitute, "relu", True), "fit, run_eagerly")


def test_keras_fit_with_steps_per_execution_under_a_substitute(substitute):
    # Keras loops over its train step with a tf.while_loop: the step, called in the loop
    # body, is re-traced under the handler (it trained with Relu's gradient, silently).
    want = _fit(None, _leaky, False, 2)
    assert not np.allclose(want[0].numpy(), _fit(None, "relu", False, 2)[0].numpy())
    _same(want, _fit(substitute, "relu", False, 2), "fit, steps_per_execution=2")


def test_the_record_of_what_ran_is_freed_with_the_outputs(substitute):
    # The record sat on the value its private tape recorded: a cycle through the tape's
    # C record, which the garbage collector could not free (one tape per op, kept).
    import gc
    import weakref
    from tf_ophandlers.handlers import substitutes
    x, w = _inputs()
    with tf.GradientTape() as tape:
        tape.watch(x)
        with substitute():
            y = tf.nn.relu(tf.matmul(x, w))
    record = substitutes._record_of(y)  # pylint: disable=protected-access
    assert record is not None
    private = weakref.ref(record.tape)
    tape.gradient(y, x)
    del tape, y, record
    gc.collect()
    assert private() is None


class _MatMulThroughTf(oh.OpHandler):
    """Computes MatMul unchanged, with a TensorFlow call instead of execute_next."""

    def execute(self, op, inputs):
        if op.type == "MatMul":
            return [tf.matmul(inputs[0], inputs[1], transpose_a=op.attrs["transpose_a"],
                              transpose_b=op.attrs["transpose_b"])]
        return self.next.execute(op, inputs)


def test_a_hook_computing_the_op_with_a_tensorflow_call_is_no_substitute_in_a_function():
    """In a replayed tf.function under a tf.GradientTape the op such a hook builds is a
    node of the function: it was taken for a substitute (HandlerError) though eagerly the
    same handler gave TensorFlow's gradient."""
    a = tf.constant([[1., -2.], [3., 4.]])
    b = tf.constant([[0.5, -1.], [2., 1.]])

    def body(a, b):
        return tf.reduce_sum(tf.nn.relu(tf.matmul(a, b)) * a)

    def grads(fn, handler=None):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            with oh.handler(handler) if handler else contextlib.nullcontext():
                y = fn(a, b)
        return tape.gradient(y, [a, b])

    want = grads(body)
    _same(want, grads(body, _MatMulThroughTf()), "eager")
    _same(want, grads(tf.function(body), _MatMulThroughTf()), "tf.function")
