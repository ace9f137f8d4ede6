"""oh.Lazy's recording path: nodes keep their op's type and attributes key
(no Op), functions are compiled from rebuilt Ops, C-level copy and dtype hooks, the
values a pending op outside a request needs, and errors naming oh.Lazy and the ops."""
import gc
import random
import sys
import weakref

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
import tf_ophandlers._C as _C
from tf_ophandlers.handlers.lazy import compiler as lazy_compile

from conftest import assert_same_tensors

_FILTER = tf.random.stateless_normal([3, 3, 1, 2], seed=[7, 7])

# Ops with attributes of every kind (types, ints, floats, bools, strings, lists), several
# outputs, integer outputs and inputs that are tensors of the program or constants.
_PROGRAMS = {
    "split": lambda h: (lambda a, b: a * b - a)(*tf.split(h, 2, axis=1)),
    "transpose": lambda h: tf.transpose(h, [1, 0]) * 2.0,
    "cast": lambda h: tf.cast(h * 10.0, tf.int32) // 3,
    "leaky": lambda h: tf.nn.leaky_relu(h, alpha=0.3),
    "cumsum": lambda h: tf.math.cumsum(h, axis=1, exclusive=True, reverse=True),
    "one_hot": lambda h: tf.one_hot(tf.cast(h > 0, tf.int32), depth=3, axis=1),
    "slice": lambda h: h[1:, ::2] + 1.0,
    "reduce": lambda h: tf.reduce_max(tf.abs(h), axis=1, keepdims=True),
    "concat": lambda h: tf.concat([h, h * 2.0, tf.tanh(h)], axis=0),
    "conv": lambda h: tf.nn.conv2d(tf.reshape(h, [1, 6, 8, 1]), _FILTER,
                                   strides=[1, 1, 2, 1], padding="SAME"),
    "argmax": lambda h: tf.argmax(h, axis=1, output_type=tf.int32) + 1,
    "bias": lambda h: tf.nn.bias_add(h, tf.range(8, dtype=h.dtype) * 0.5),
    "gather": lambda h: tf.gather(h, [2, 0, 5], axis=1),
    "float64": lambda h: tf.math.reduce_std(tf.cast(h, tf.float64), axis=0),
}


@pytest.fixture
def fresh_caches():
    """Empty compile and op-template caches: every structure is compiled anew. (Emptied,
    not replaced: a replacement would take over the cache's name in `oh.caches()`, and
    the name would vanish with it after the test.)"""
    lazy_compile.functions.clear()
    lazy_compile._templates.clear()  # pylint: disable=protected-access


@pytest.mark.parametrize("name", sorted(_PROGRAMS))
def test_functions_compiled_from_rebuilt_ops_equal_eager_then_hit(name, fresh_caches):
    fn = _PROGRAMS[name]
    x = tf.random.stateless_normal([6, 8], seed=[1, 2])
    first = oh.Lazy()
    with first:
        got = fn(x)
        got.numpy()
    assert (first.compiled, first.cache_hits) == (1, 0)
    assert_same_tensors(fn(x), got, tol=1e-5)
    x2 = tf.random.stateless_normal([6, 8], seed=[3, 4])  # other values, same structure
    again = oh.Lazy()
    with again:
        got = fn(x2)
        got.numpy()
    assert (again.compiled, again.cache_hits) == (0, 1)
    assert_same_tensors(fn(x2), got, tol=1e-5)


def _random_dag(rng, x):
    """Random ops on random earlier values (branches and joins); returns the values."""
    values = [x]
    for _ in range(rng.randint(3, 12)):
        a, b = rng.choice(values), rng.choice(values)
        kind = rng.randrange(4)
        if kind == 0:
            values.append(tf.tanh(a) * rng.choice((0.5, 1.5)))
        elif kind == 1:
            values.append(a + b)
        elif kind == 2:
            values.append(tf.nn.relu(a - b * 0.25))
        else:
            values.append(tf.math.cumsum(a, axis=1, exclusive=rng.random() > 0.5))
    return values


@pytest.mark.parametrize("seed", range(12))
def test_random_dags_forced_in_random_order_with_dropped_values_equal_eager(seed):
    """A request computes some values; pending ops outside it still get the outputs
    they need though the program dropped them (found at the request)."""
    rng = random.Random(seed)
    x = tf.random.stateless_normal([3, 5], seed=[seed, 9])
    want = [v.numpy() for v in _random_dag(random.Random(seed), x)]
    keep = sorted(set(rng.sample(range(len(want)), rng.randint(1, len(want))))
                  | {len(want) - 1})  # (the last value is always an op's)
    order = list(keep)
    rng.shuffle(order)
    with oh.Lazy() as lazy:
        values = _random_dag(random.Random(seed), x)
        kept = {i: values[i] for i in keep}
        del values  # the others are dropped: only pending ops may still need them
        for i in order:
            np.testing.assert_allclose(kept[i].numpy(), want[i], rtol=1e-5, atol=1e-6)
            assert kept[i].dtype == want[i].dtype
    assert lazy.flushes >= 1


def test_a_fresh_tf_function_between_pending_ops_and_a_keras_partial_batch():
    x = tf.random.stateless_normal([4, 6], seed=[5, 6])
    fresh = tf.function(lambda t: tf.nn.softplus(t) * 3.0)
    eager = _PROGRAMS["leaky"](fresh(_PROGRAMS["cumsum"](x)))
    with oh.Lazy():
        got = _PROGRAMS["leaky"](fresh(_PROGRAMS["cumsum"](x)))
        assert_same_tensors(eager, got)
    model = tf.keras.Sequential([tf.keras.Input([6]), tf.keras.layers.Dense(5, "relu"),
                                 tf.keras.layers.Dense(2)])
    data = tf.random.stateless_normal([21, 6], seed=[1, 1])
    for start in (0, 8, 16, 0):  # batches of 8, 8, 5 (partial), then 8 again: a hit
        batch = data[start:start + 8]
        lazy = oh.Lazy()
        with lazy:
            got = model(batch)
            assert_same_tensors(model(batch), got, tol=1e-5)
    assert lazy.compiled == 0 and lazy.cache_hits >= 1


def _chain_of_ten(chunk_ops):
    """(value, fast-path ops counted, package frames entered) of ten recorded Tanh, Mul
    pairs under oh.Lazy(chunk_ops), after the first of each type."""
    x = tf.random.stateless_normal([4, 4], seed=[1, 2])
    seen = []

    def profile(frame, event, arg):
        if event == "call" and "tf_ophandlers" in frame.f_code.co_filename:
            path = "/".join(frame.f_code.co_filename.rsplit("/", 2)[-2:])
            seen.append((path, frame.f_code.co_name))

    with oh.Lazy(chunk_ops=chunk_ops):
        h = tf.tanh(x) * 1.01  # (first ops of each type: the hook fills the caches)
        before = _C.fast_stats()["fast_ops"]
        sys.setprofile(profile)
        try:
            for _ in range(10):
                h = tf.tanh(h) * 1.01
        finally:
            sys.setprofile(None)
        ran_fast = _C.fast_stats()["fast_ops"] - before
        value = h.numpy()
    return value, ran_fast, seen


@pytest.mark.parametrize("chunk_ops", [None, 6])
def test_recorded_chains_equal_eager(chunk_ops):
    value, _, seen = _chain_of_ten(chunk_ops)
    # A chunk's launch is the hook's: no launch without the hook that makes it.
    hooks = seen.count(("lazy/handler.py", "execute"))
    assert hooks >= seen.count(("lazy/handler.py", "_launch_chunk"))
    if chunk_ops is not None:
        assert seen.count(("lazy/handler.py", "_launch_chunk")) == 3, seen
    x = tf.random.stateless_normal([4, 4], seed=[1, 2])
    want = tf.tanh(x) * 1.01
    for _ in range(10):
        want = tf.tanh(want) * 1.01
    np.testing.assert_allclose(value, want, rtol=1e-6)


@pytest.mark.requires_c_paths("recording runs no Python frame per op")
@pytest.mark.parametrize("chunk_ops", [None, 6])
def test_recording_runs_no_python_frame_per_op(chunk_ops):
    """Once an op type was recorded (its signature and statefulness cached), recording
    it again is done in C (cc/handlers/lazy/fast_lazy.cc): no package frame per op; with chunk_ops,
    the hook runs only for the op before which a chunk is launched."""
    _, ran_fast, seen = _chain_of_ten(chunk_ops)
    assert ran_fast == 20
    hooks = seen.count(("lazy/handler.py", "execute"))
    assert hooks == seen.count(("lazy/handler.py", "_launch_chunk"))
    if chunk_ops is None:
        assert seen == [], sorted(set(seen))
    else:  # a chunk is due every 6 recorded ops: its hook launches it, C records the rest
        assert hooks == 3, seen


def test_never_copy_handler_gets_constants_as_they_are():
    class Recorder(oh.OpHandler):
        needs_copy = staticmethod(oh.never_copy)

        def __init__(self):
            self.kinds = []

        def execute(self, op, inputs):
            self.kinds.append([type(i).__name__ for i in inputs])
            return self.next.execute(op, inputs)

    r = Recorder()
    with r:
        y = tf.constant([1.0, 2.0]) * 3.0
    assert r.kinds == [["EagerTensor", "EagerTensor"]]
    np.testing.assert_allclose(y.numpy(), [3.0, 6.0])
    assert not oh.never_copy(None, 0)


@pytest.mark.parametrize("jit", [False, True])
def test_value_request_errors_name_oh_lazy_and_the_ops_and_the_handler_recovers(jit):
    x = tf.ones([2, 3])
    with oh.Lazy(jit_compile=jit) as lazy:
        bad = tf.reshape(tf.tanh(x) * 2.0, [7])
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r"oh\.Lazy: pending ops \(op types [^)]*Reshape[^)]*\) "
                                 r"failed: .*(Input to reshape|7)"):
            bad.numpy()
        good = tf.reduce_sum(tf.tanh(x) * 2.0)
        np.testing.assert_allclose(good.numpy(), np.sum(np.tanh(np.ones([2, 3])) * 2.0),
                                   rtol=1e-5)
    assert lazy.flushes >= 1


def test_error_naming_keeps_a_bare_op_error():
    # tf.errors.OpError itself takes an error code its subclasses fill in: renaming it
    # must not replace the error with a TypeError from its constructor.
    from tf_ophandlers.handlers.lazy import (  # pylint: disable=import-outside-toplevel
        handler as lazy)
    error = tf.errors.OpError(None, None, "boom", tf.errors.UNKNOWN)
    got = lazy._named(error, {"Reshape"})  # pylint: disable=protected-access
    assert type(got) is tf.errors.OpError and got.error_code == tf.errors.UNKNOWN
    assert "oh.Lazy" in got.message and "Reshape" in got.message and "boom" in got.message
    got = lazy._named(tf.errors.InvalidArgumentError(None, None, "bad"), {"Tanh"})  # pylint: disable=protected-access
    assert type(got) is tf.errors.InvalidArgumentError and "Tanh" in got.message


class _HookLazy(oh.Lazy):
    """oh.Lazy whose execute is its Python hook for every op (no C record path)."""

    def execute(self, op, inputs):
        return super().execute(op, inputs)


def test_c_record_path_builds_the_nodes_the_hook_builds():
    """A structure recorded by the Python hook and the same one recorded in C have one
    key: the C path's nodes (signature, wiring, device, live outputs) are the hook's. A
    subclass overriding execute gets its hook per op."""
    assert oh.Lazy._oh_records_in_c and not _HookLazy._oh_records_in_c
    x = tf.random.stateless_normal([5, 3], seed=[3, 9])
    plain, calls = oh.Lazy(), []
    plain.execute = lambda op, inputs: (calls.append(op.type), oh.Lazy.execute(plain, op,
                                                                                 inputs))[1]
    with plain:  # an execute set on the instance is called too
        tf.tanh(tf.tanh(x) * 2.0).numpy()
    assert calls == ["Tanh", "Mul", "Tanh"]
    c = tf.constant(2.0)

    def program(h):
        a, b = tf.split(h, [2, 1], axis=1)  # several outputs
        h = tf.tanh(a) * c + tf.reduce_sum(b)  # a captured tensor, a fresh constant
        with tf.device("/cpu:0"):
            h = tf.nn.relu(h - 0.5)
        return tf.cast(h > 0.1, tf.int32) + tf.cast(h * 10.0, tf.int32)

    want = program(x)
    for first, second in ((_HookLazy, oh.Lazy), (oh.Lazy, _HookLazy)):
        lazy_compile.functions.clear()
        handlers = (first(), second(), first())
        for handler in handlers:
            calls = []
            if isinstance(handler, _HookLazy):
                handler.execute = lambda op, inputs, h=handler: (
                    calls.append(op.type), _HookLazy.execute(h, op, inputs))[1]
            with handler:
                program(x)  # (the first ops of a type fill the caches)
                got = program(x)
                assert_same_tensors(want, got)
            if isinstance(handler, _HookLazy):
                assert len(calls) >= 2 * 9, calls  # its hook ran for every op
        assert handlers[0].compiled == 1
        assert [h.compiled for h in handlers[1:]] == [0, 0], (first, second)
        assert [h.cache_hits for h in handlers[1:]] == [1, 1]


def _young_objects():
    """The objects in the collector's youngest generation, but for tensors (TensorFlow's:
    the constant `1.01` each Mul converts is an input the node keeps)."""
    return sum(1 for o in gc.get_objects(generation=0) if not isinstance(o, tf.Tensor))


def _record_200_pairs(lazy, x):
    """Records 200 Tanh, Mul pairs under `lazy` (open), the collector off: (result,
    objects added to the collector's youngest generation)."""
    h = tf.tanh(x) * 1.01  # (first ops of each type: the hook fills the caches)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        before = _young_objects()
        for _ in range(200):
            h = tf.tanh(h) * 1.01
        added = _young_objects() - before
    finally:
        if enabled:
            gc.enable()
    return h, added


def test_recorded_programs_are_freed_by_reference_counting():
    """The nodes and values recording builds form no cycle: with the collector off, the
    dropped program's nodes are gone after the scope, and the result is eager's."""
    x = tf.random.stateless_normal([4, 4], seed=[5, 6])
    lazy = oh.Lazy()
    enabled = gc.isenabled()
    try:
        with lazy:
            h, _ = _record_200_pairs(lazy, x)
            gc.disable()
            first = weakref.ref(lazy._pending[1]())  # pylint: disable=protected-access
            value = h.numpy()
            dropped = tf.tanh(h) * 2.0  # recorded, then dropped unrun
            last = weakref.ref(lazy._pending[-1]())  # pylint: disable=protected-access
            del dropped
        assert first() is None and last() is None
    finally:
        if enabled:
            gc.enable()
    want = tf.tanh(x) * 1.01
    for _ in range(200):
        want = tf.tanh(want) * 1.01
    np.testing.assert_allclose(value, want, rtol=1e-5)


@pytest.mark.requires_c_paths("the objects the C record path builds are untracked")
def test_recording_leaves_the_cyclic_collector_nothing_to_walk():
    """The objects the C record path builds per op (the node, its values, lists, tuples
    and weak references) are not tracked by the cyclic garbage collector: recording a
    400-op program adds almost nothing to the collector's youngest generation, so a
    collection during recording walks none of it and full collections (which walk the
    whole heap) come as rarely as without Lazy. (The Python path's objects are tracked:
    Python tracks every instance of a class it cannot prove acyclic.)"""
    x = tf.random.stateless_normal([4, 4], seed=[5, 6])
    with oh.Lazy() as lazy:
        _, added = _record_200_pairs(lazy, x)
    assert added < 50, added  # (tracked before: about 6 per op, 2400)
