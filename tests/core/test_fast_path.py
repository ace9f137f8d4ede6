"""The C++ per-op fast path (cc/fast/fast_path.h): stacks whose handler does not execute an op
(default `execute`, or `handles_ops` excluding its type) run it without Python, and give
the results, placements and errors of the Python path and of plain TensorFlow."""
import re

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
import tf_ophandlers._C as _C

from conftest import package_frames


def _same(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


class Forwarding(oh.OpHandler):
    """Overrides execute: every op takes the Python path (the reference)."""

    def execute(self, op, inputs):
        return self.next.execute(op, inputs)


class Seen(oh.OpHandler):
    """Records the op types its execute hook is called for."""

    def __init__(self, handles_ops=None):
        if handles_ops is not None:
            self.handles_ops = handles_ops
        self.seen = []

    def execute(self, op, inputs):
        self.seen.append(op.type)
        return self.next.execute(op, inputs)


def _chain(a, b):
    for _ in range(3):
        a = tf.tanh(a) * 1.5 + tf.matmul(a, b)
    return a


@pytest.fixture
def ab():
    return (tf.random.stateless_normal([3, 3], seed=[1, 2]),
            tf.random.stateless_normal([3, 3], seed=[3, 4]))


def _pass_through_levels(ab):
    """(result, package frames entered, fast-path ops counted, inner handler) of the chain
    under two pass-through levels, after a warm-up run."""
    a0, b0 = ab
    with oh.OpHandler(), oh.OpHandler() as inner:
        a, b = tf.identity(a0), tf.identity(b0)  # physical inputs: copied on in Python
        _chain(a, b)  # each (stack, op type) is decided once, in Python
        before = _C.fast_stats()["fast_ops"]
        got, calls = package_frames(lambda: _chain(a, b))
        ran_fast = _C.fast_stats()["fast_ops"] - before
    return got, calls, ran_fast, inner


def test_pass_through_levels_give_tensorflows_values_on_the_inner_stack(ab):
    got, _, _, inner = _pass_through_levels(ab)
    stack = oh.stack_of(got)
    assert stack is not None and stack.handler is inner and len(stack.handlers) == 2
    _same(got, _chain(*ab))


@pytest.mark.requires_c_paths("pass-through levels run no Python frame")
def test_pass_through_levels_run_without_python_frames(ab):
    _, calls, ran_fast, _ = _pass_through_levels(ab)
    assert calls == []
    assert ran_fast == 12


_HANDLES = (frozenset({"MatMul"}), ["MatMul"], lambda t: t == "MatMul")


def _handles_only_matmul(ab, handles):
    a0, b0 = ab
    h = Seen(handles)
    with h:
        a, b = tf.identity(a0), tf.identity(b0)
        _chain(a, b)
        got, calls = package_frames(lambda: _chain(a, b))
    return h, got, calls


@pytest.mark.parametrize("handles", _HANDLES, ids=["frozenset", "list", "predicate"])
def test_handles_ops_forwards_other_ops_without_calling_execute(ab, handles):
    h, got, _ = _handles_only_matmul(ab, handles)
    assert h.seen == ["MatMul"] * 6
    _same(got, _chain(*ab))
    assert oh.stack_of(got).handler is h


@pytest.mark.requires_c_paths("forwarded op types run no Python frame")
@pytest.mark.parametrize("handles", _HANDLES, ids=["frozenset", "list", "predicate"])
def test_handles_ops_forwards_other_ops_in_c(ab, handles):
    _, _, calls = _handles_only_matmul(ab, handles)
    # Per MatMul only the hook's own Python (`self.next` and PHYSICAL's execute); the
    # hook itself is in this file. The other ops: nothing.
    assert calls == ["next", "execute"] * 3, calls


def test_handles_ops_in_the_python_path_too(ab):
    """Where the fast path cannot run an op (a physical input to copy on below another
    handler), the Python stack forwards unhandled types the same way."""
    a0, b0 = ab
    h = Seen({"MatMul"})
    with Forwarding(), h:
        got = _chain(a0, b0)
    assert h.seen == ["MatMul"] * 3
    _same(got, _chain(a0, b0))


class _Boxed:
    """A representation that is not a tensor: only its handler's execute can run it."""

    def __init__(self, value):
        self.value = value
        self.dtype = value.dtype
        self.shape = value.shape


class Boxing(oh.OpHandler):
    """Keeps Sin's outputs boxed (negated: the box holds -sin); handles only Sin, so other
    ops with plain inputs are forwarded, and any op with a boxed input reaches execute."""

    handles_ops = frozenset({"Sin"})

    def __init__(self):
        self.seen = []

    def value_dtype(self, value):
        return value.dtype

    def num_dims(self, value):
        return value.shape.rank

    def dim(self, value, index):
        return value.shape[index]

    def copy_off(self, value, device):
        return -value.value if type(value) is _Boxed else value

    def execute(self, op, inputs):
        self.seen.append(op.type)
        plain = [-x.value if type(x) is _Boxed else x for x in inputs]
        outputs = self.next.execute(op, plain)
        return [_Boxed(-o) for o in outputs] if op.type == "Sin" else outputs


@pytest.mark.parametrize("below", [False, True])
def test_handles_ops_sends_non_tensor_representations_to_execute(ab, below):
    """An op type outside handles_ops is forwarded only when its inputs' representations
    are tensors; one with a handler's own object reaches execute (C++ path and, below
    another handler, the Python path)."""
    a0, b0 = ab
    h = Boxing()
    with (Forwarding() if below else oh.OpHandler()), h:
        a, b = tf.identity(a0), tf.identity(b0)
        s = tf.sin(a)
        plain = tf.cos(a) * b  # plain inputs: forwarded, execute not called
        mixed = tf.matmul(s, b) + tf.exp(s)  # boxed inputs: execute runs them
    assert h.seen.count("Sin") == 1
    assert "Cos" not in h.seen and h.seen.count("Mul") == 0
    assert h.seen.count("MatMul") == 1 and h.seen.count("Exp") == 1
    _same(plain, tf.cos(a0) * b0)
    _same(mixed, tf.matmul(tf.sin(a0), b0) + tf.exp(tf.sin(a0)))
    _same(s, tf.sin(a0))


def _boxed_exp(ab):
    """(handler, result, fast-path ops counted) of an Exp of a boxed value outside
    handles_ops, after a warm-up run."""
    a0, _ = ab
    h = Boxing()
    with h:
        s = tf.sin(tf.identity(a0))
        tf.exp(s)  # decided once
        before = _C.fast_stats()["fast_ops"]
        got = tf.exp(s)
        ran_fast = _C.fast_stats()["fast_ops"] - before
    return h, got, ran_fast


def test_non_tensor_representations_reach_the_execute_hook(ab):
    """An op outside handles_ops with a handler's own object as input runs the execute
    hook (as a handled type does): the outputs and calls of a handled op."""
    h, got, _ = _boxed_exp(ab)
    assert h.seen == ["Sin", "Exp", "Exp"]
    _same(got, tf.exp(tf.sin(ab[0])))


@pytest.mark.requires_c_paths("the hook is called from C++, counted as a fast-path op")
def test_non_tensor_representations_take_the_cpp_hook_path(ab):
    """That hook is called from C++, not through HandlerStack.execute in Python."""
    _, _, ran_fast = _boxed_exp(ab)
    assert ran_fast == 1


def test_handles_ops_string_is_an_error_naming_the_handler():
    class Bad(oh.OpHandler):
        handles_ops = "MatMul"
    with pytest.raises(TypeError, match=r"Bad\(\)\.handles_ops"):
        with Bad():
            pass


@pytest.mark.parametrize("program", [
    lambda a, b: tf.matmul(a, b),
    lambda a, b: tf.matmul(a, b, name="product"),
    lambda a, b: tf.raw_ops.AddV2(x=a, y=b, name="sum"),
], ids=["matmul", "named", "raw_op"])
def test_same_errors_as_the_python_path_and_tensorflow(program):
    """A kernel's error reaches the user as eager TensorFlow's, type and whole message
    (the ``[Op:MatMul] name: product`` TensorFlow appends included), through a level the
    C++ path forwards and through a Python execute hook."""
    x = tf.ones([2, 3])
    y = tf.ones([4, 5])

    def fail(handler_cls):
        try:
            if handler_cls is None:
                program(x, y)
            else:
                with handler_cls():
                    a, b = tf.identity(x), tf.identity(y)
                    program(a, b)
        except Exception as e:  # pylint: disable=broad-except
            return type(e), str(e)
        raise AssertionError("no error")

    plain, fast, slow = fail(None), fail(oh.OpHandler), fail(Forwarding)
    assert plain[0] is fast[0] is slow[0] is tf.errors.InvalidArgumentError
    assert "[Op:" in plain[1]
    assert plain[1] == fast[1] == slow[1]


def test_a_handlers_own_error_reaches_the_user_unchanged(ab):
    a0, _ = ab

    class Refuses(oh.OpHandler):
        handles_ops = frozenset({"Cos"})

        def execute(self, op, inputs):
            raise ValueError("Refuses() will not run %s" % op.type)

    with Refuses():
        a = tf.identity(a0)
        s = tf.sin(a)  # forwarded (fast path)
        with pytest.raises(ValueError, match=r"^Refuses\(\) will not run Cos$"):
            tf.cos(a)
    _same(s, tf.sin(a0))


def test_invalid_outputs_below_a_fast_level_name_the_handler_and_op(ab):
    a0, _ = ab

    class WrongCount(oh.OpHandler):
        def execute(self, op, inputs):
            extra = [inputs[0]] if op.type == "Sin" else []
            return self.next.execute(op, inputs) + extra

    with WrongCount(), oh.OpHandler():
        a = tf.identity(a0)
        with pytest.raises(oh.HandlerOutputError, match=r"WrongCount.*Sin"):
            tf.sin(a)


def test_new_stacks_invalidate_decisions():
    """Decisions are cached per stack object; a stack built later (possibly at a dead
    stack's address) must never use an old stack's decision."""
    x = tf.constant([[1.0, 2.0]])
    for i in range(30):
        before = _C.fast_stats()["clears"]
        h = Seen() if i % 2 else oh.OpHandler()
        with h:
            a = tf.identity(x)
            y = tf.sin(a) + 1.0
        assert _C.fast_stats()["clears"] > before or _C.fast_stats()["entries"] <= 2
        if i % 2:
            assert h.seen == ["Identity", "Sin", "AddV2"], h.seen
        _same(y, tf.sin(x) + 1.0)
        del h, a, y
    entries, maxsize = oh.caches()["fast_path.decisions"]
    assert 0 <= entries <= maxsize


def test_type_based_dispatch_and_resources_match_the_python_path(ab):
    a0, b0 = ab
    results = {}
    for cls in (oh.OpHandler, Forwarding):
        with cls() as h:
            a = tf.identity(a0)
            v = tf.Variable(b0)  # transient: the handle stays physical
        y = tf.matmul(a, v)  # after the scope: type-based dispatch onto h's stack
        results[cls] = y
        assert oh.stack_of(y).handler is h
        assert oh.stack_of(v.handle) is None
    _same(results[oh.OpHandler], results[Forwarding])
    _same(results[oh.OpHandler], tf.matmul(a0, b0))


def _model():
    tf.keras.utils.set_random_seed(5)
    inputs = tf.keras.Input([4])
    h = tf.keras.layers.Dense(8, activation="relu")(inputs)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(2)(h))


@pytest.mark.parametrize("make", [oh.OpHandler, lambda: Seen({"MatMul"})],
                         ids=["default-execute", "handles_ops"])
def test_keras_model_values_and_gradients_eager_and_in_a_function(make):
    model = _model()
    x = tf.random.stateless_normal([5, 4], seed=[7, 8])

    def loss_grads(tape_cls):
        with tape_cls() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        return loss, tape.gradient(loss, model.trainable_variables)

    want_loss, want_grads = loss_grads(tf.GradientTape)
    for tape_cls in (tf.GradientTape, oh.GradientTape):
        with tape_cls() as tape:
            with make():
                loss = tf.reduce_sum(model(x) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        _same(loss, want_loss)
        for g, w in zip(grads, want_grads):
            assert type(g) is type(w) and g.dtype == w.dtype and g.shape == w.shape
            _same(g, w)

    @tf.function
    def f(x):
        with make():
            return model(x)
    _same(f(x), model(x))
    _same(f(x[:3]), model(x[:3]))  # a partial batch


def test_model_fit_under_a_pass_through_scope_matches_plain_fit():
    x = tf.random.stateless_normal([10, 4], seed=[1, 1])
    y = tf.random.stateless_normal([10, 2], seed=[2, 2])
    weights = []
    for scope in (None, oh.OpHandler):
        model = _model()
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
        if scope is None:
            model.fit(x, y, batch_size=4, epochs=2, verbose=0)  # a partial last batch
        else:
            with scope():
                model.fit(x, y, batch_size=4, epochs=2, verbose=0)
        weights.append(model.get_weights())
    for w_plain, w_oh in zip(*weights):
        _same(w_oh, w_plain)


class _Hooked(oh.OpHandler):
    """A Python execute hook; `returns_off_stack = True` sends it down the Python path."""

    def __init__(self, mode):
        self.mode = mode

    def execute(self, op, inputs):
        outputs = self.next.execute(op, inputs)
        if op.type != "Sin":
            return outputs
        if self.mode == "count":
            return outputs + outputs
        if self.mode == "dtype":
            return [tf.cast(outputs[0], tf.float64)]
        if self.mode == "tuple":
            return tuple(outputs)
        if self.mode == "bare":
            return outputs[0]
        if self.mode == "numpy":
            return [outputs[0].numpy()]
        if self.mode == "raise":
            raise KeyError("no Sin here")
        return [outputs[0] * 2.0]


class _HookedSlow(_Hooked):
    returns_off_stack = True  # (never used: only to take the Python path)


@pytest.mark.parametrize("mode", ["ok", "tuple", "count", "dtype", "bare", "numpy", "raise"])
def test_python_hooks_called_from_cpp_match_the_python_path(mode, ab):
    a0, _ = ab
    outcomes = []
    for cls in (_Hooked, _HookedSlow):
        h = cls(mode)
        with h:
            a = tf.identity(a0)
            try:
                y = tf.sin(a)
                outcomes.append(("ok", oh.stack_of(y).handler is h, y.numpy().tolist()))
            except Exception as e:  # pylint: disable=broad-except
                text = re.sub(r"device:\w+:\d+", "device:?", str(e))  # the stack's name
                outcomes.append((type(e), text.replace("_HookedSlow", "_Hooked")))
    assert outcomes[0] == outcomes[1]
    if mode in ("ok", "tuple"):
        want = tf.sin(a0) * (2.0 if mode == "ok" else 1.0)
        _same(outcomes[0][2], want)
    elif mode == "raise":
        assert outcomes[0][0] is KeyError
    else:
        assert issubclass(outcomes[0][0], oh.HandlerOutputError), outcomes[0]
        assert "_Hooked()" in outcomes[0][1] and "Sin" in outcomes[0][1], outcomes[0]


def _count_asks(monkeypatch):
    """Counts the fast path's questions to Python (HandlerStack._oh_fast calls)."""
    from tf_ophandlers.core.stack import HandlerStack
    asked = []
    original = HandlerStack._oh_fast

    def counting(self, op_type):
        asked.append((type(self.handler).__name__, op_type))
        return original(self, op_type)
    monkeypatch.setattr(HandlerStack, "_oh_fast", counting)
    return asked


def test_fresh_handler_per_step_reuses_decisions(monkeypatch, ab):
    """`with Handler():` per step: after the first step, the decisions for known op types
    are shared by the new stacks (no Python call), and the results stay TensorFlow's."""
    asked = _count_asks(monkeypatch)
    a0, b0 = ab
    want = _chain(a0, b0)

    class PerStep(Seen):
        pass

    for step in range(3):
        del asked[:]
        with PerStep(handles_ops=("MatMul",)) as h:
            a, b = tf.identity(a0), tf.identity(b0)
            got = _chain(a, b)
        _same(got, want)
        assert h.seen == ["MatMul"] * 3
        if step == 0:
            assert ("PerStep", "Tanh") in asked and ("PerStep", "MatMul") in asked
        else:
            assert asked == [], asked
        assert _C.fast_stats()["shared_entries"] <= _C.fast_stats()["shared_maxsize"]
    assert oh.caches()["fast_path.shared_decisions"][0] >= 1


def test_a_different_declaration_gets_its_own_decision(monkeypatch, ab):
    """A handler of the same class whose handles_ops, transient or returns_off_stack
    differs is never served another declaration's shared decision."""
    asked = _count_asks(monkeypatch)
    a0, b0 = ab
    want = _chain(a0, b0)

    class Declared(Seen):
        pass

    with Declared(handles_ops=("MatMul",)) as h1:
        _same(_chain(tf.identity(a0), tf.identity(b0)), want)
    del asked[:]
    with Declared(handles_ops=("Tanh",)) as h2:  # same class, other op types
        _same(_chain(tf.identity(a0), tf.identity(b0)), want)
    assert h1.seen == ["MatMul"] * 3 and h2.seen == ["Tanh"] * 3
    assert ("Declared", "Tanh") in asked and ("Declared", "MatMul") in asked

    ops = {"MatMul"}

    class Dynamic(Seen):
        """handles_ops reads instance state: never shared between instances."""

        def __init__(self, types):
            super().__init__()
            self.types = types

        def handles_ops(self, op_type):  # pylint: disable=method-hidden
            return op_type in self.types

    for types_ in (ops, {"Tanh"}, ops):
        with Dynamic(types_) as h3:
            _same(_chain(tf.identity(a0), tf.identity(b0)), want)
        assert h3.seen == [t for t in ["Tanh", "MatMul"] * 3 if t in types_]

    # An instance attribute the decision reads (transient: whether a resource output
    # leaves the stack) differs between two handlers of one class.
    for n, transient in enumerate((True, False, True)):
        h = oh.OpHandler()
        h.transient = transient
        with h:
            r = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[], shared_name="fp%d" % n)
        assert (oh.stack_of(r) is None) == transient


@pytest.mark.parametrize("make", [oh.OpHandler, lambda: oh.native.PassThrough()],
                         ids=["python", "cxx"])
def test_c_outputs_make_their_value_on_demand(make, ab):
    """Outputs of a C level hold only a TensorFlow handle until something asks for their
    value: shape, printing, the payload (one stable object), copy-off, a Python hook and
    further C levels all see TensorFlow's values."""
    a0, b0 = ab
    want = tf.tanh(a0) * 2.0 + b0
    with Seen(handles_ops=("AddV2",)) as seen, make():
        a, b = tf.identity(a0), tf.identity(b0)
        y = tf.tanh(a)  # a C output (no Python value yet)
        assert y.shape == a0.shape and y.dtype == tf.float32
        assert "[" in repr(y)  # summary through the payload
        p1, p2 = _C.payload(y), _C.payload(y)
        assert p1[1] is p2[1]  # made once, then kept
        _same(p1[1], tf.tanh(a0))
        z = tf.tanh(a) * 2.0  # C output feeding a C level
        got = z + b  # the Python hook of the outer level gets the inner level's values
    assert seen.seen == ["AddV2"]
    _same(got, want)
    _same(y, tf.tanh(a0))


def test_op_counter_counts_chains_and_resets_per_instance(ab):
    """OpCounter's per-thread slot cache: counts per instance, several types in turn, and a
    new counter (possibly at a dead one's address) starts from zero."""
    a0, b0 = ab
    for _ in range(3):
        with oh.native.OpCounter() as counter:
            a, b = tf.identity(a0), tf.identity(b0)
            _chain(a, b)
        counts = counter.counts
        assert {k: counts[k] for k in ("Tanh", "Mul", "MatMul", "AddV2")} == {
            "Tanh": 3, "Mul": 3, "MatMul": 3, "AddV2": 3}
        del counter
