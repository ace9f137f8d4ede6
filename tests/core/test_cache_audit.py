"""Cache audit: every cache of the package is listed by `oh.caches()` and bounded, never
keeps a graph tensor of a replayed function, and gives results that do not depend on
what ran before in the process (the same op with another dtype, shape, attribute or
handler; a replay followed by eager use)."""
import random

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.core import cache as cache_module
from tf_ophandlers.handlers.forward_accumulator import handler as forward_accumulator

from conftest import assert_same_tensors


# -- bounds ------------------------------------------------------------------------------

def test_forward_accumulator_jvp_functions_are_listed_and_bounded(monkeypatch):
    """The cache of traced JVP functions (TensorFlow's construction, one trace per op
    signature: a new shape is a new trace) was an unbounded FunctionCache missing from
    oh.caches(); each new input shape of lgamma added a trace for good."""
    monkeypatch.setattr(forward_accumulator, "_JVP_FUNCTIONS_MAX", 3)
    for n in range(1, 8):
        x = tf.linspace(0.5, 3.0, n)
        v = tf.ones([n])
        with tf.autodiff.ForwardAccumulator(x, v) as acc:
            want = acc.jvp(tf.math.lgamma(x))
        with oh.ForwardAccumulator(x, v) as acc:
            got = acc.jvp(tf.math.lgamma(x))
        assert_same_tensors(want, got)
        entries, maxsize = oh.caches()["forward_accumulator.jvp_functions"]
        assert entries <= 3 and maxsize == 3


def test_every_cache_states_a_finite_size_and_holds_at_most_it():
    for name, (entries, maxsize) in oh.caches().items():
        assert isinstance(maxsize, int) and 0 < maxsize < 10 ** 7, name
        assert entries <= maxsize, name


# -- replays then eager use ------------------------------------------------------------

def _program(x, ids, V):
    """Ops whose handlers build cached constants (shapes, axes, perms) and signatures."""
    b = tf.shape(x)[0]
    y = tf.reshape(tf.transpose(tf.reshape(x, [b, 2, 3]), [0, 2, 1]), [-1, 6])
    y = tf.nn.softmax(y) + tf.reduce_sum(y, axis=1, keepdims=True)
    y = tf.concat([y, tf.gather(V, ids)], axis=-1)
    img = tf.reshape(y, [-1, 3, 3, 1])
    y = tf.reshape(tf.nn.avg_pool2d(img, 2, 1, "SAME"), [-1, 9])
    return tf.reduce_mean(tf.cast(tf.cast(y * 4.0, tf.int32), tf.float32) + y, axis=0)


def _inputs(batch, seed):
    r = np.random.default_rng(seed)
    return (tf.constant(r.standard_normal((batch, 6)).astype(np.float32)),
            tf.constant(r.integers(0, 4, (batch,)).astype(np.int32)))


_HANDLERS = {
    "OpLogHandler": oh.OpLogHandler, "CheckNumerics": oh.CheckNumericsHandler,
    "Lazy": oh.Lazy, "Async": oh.Async, "DataFormat": oh.DataFormat,
    "Recompute": oh.Recompute, "GradientTape": oh.GradientTape,
}


def _run(name, fn, x, ids, V):
    """(value, gradient of V) of `fn` under handler `name` (None: plain TensorFlow)."""
    if name is None:
        with tf.GradientTape() as tape:
            out = fn(x, ids, V)
        return out, tape.gradient(out, V)
    if name == "GradientTape":
        with oh.GradientTape() as tape:
            out = fn(x, ids, V)
        return out, tape.gradient(out, V)
    if name == "vectorized_map":
        return oh.vectorized_map(lambda e: fn(e[0], e[1], V), (x[None], ids[None]))[0], None
    with oh.GradientTape() as tape:
        with _HANDLERS[name]():
            out = fn(x, ids, V)
    return tf.identity(out), tape.gradient(out, V)


def _graph_tensors(value, depth=0):
    """Symbolic (graph) tensors held in a cache value (one level of containers)."""
    if isinstance(value, tf.Tensor) and not hasattr(value, "numpy"):
        return [value]
    if depth < 2 and isinstance(value, (list, tuple)):
        return [t for v in value for t in _graph_tensors(v, depth + 1)]
    if depth < 2 and isinstance(value, dict):
        return [t for v in value.values() for t in _graph_tensors(v, depth + 1)]
    return []


@pytest.mark.filterwarnings("ignore:oh.Recompute:RuntimeWarning")
def test_replays_leave_no_graph_tensor_in_a_cache_and_eager_use_after_them_is_right():
    """Each handler replays a fresh tf.function with an unknown batch dim (two batch
    sizes), then runs the same ops eagerly; all in one random order. No cache may keep a
    tensor of a replay's graph (an eager use would get a symbolic tensor), and every
    result equals plain TensorFlow's."""
    V = tf.Variable(np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3))
    spec = [tf.TensorSpec([None, 6]), tf.TensorSpec([None], tf.int32)]
    names = sorted(_HANDLERS) + ["vectorized_map"]
    order = [(n, m) for n in names for m in ("function", "eager")]
    random.Random(5).shuffle(order)
    for step, (name, mode) in enumerate(order):
        fn = _program
        if mode == "function":
            fn = tf.function(lambda x, ids, V: _program(x, ids, V), input_signature=spec + [
                tf.TensorSpec([4, 3])], autograph=False) if name == "vectorized_map" else (
                tf.function(lambda x, ids: _program(x, ids, V), input_signature=spec,
                            autograph=False))
            call = (lambda f: (lambda x, ids, _V: f(x, ids)))(fn) if name != "vectorized_map" \
                else (lambda f: (lambda x, ids, _V: f(x, ids, tf.convert_to_tensor(_V))))(fn)
        else:
            call = _program
        for batch in (4, 3):
            x, ids = _inputs(batch, step * 10 + batch)
            want = _run(None, _program, x, ids, V)
            got = _run(name, call, x, ids, V)
            if got[1] is None:
                want = (want[0], None)
            what = "%s %s batch %d (step %d)" % (name, mode, batch, step)
            assert_same_tensors(want[0], got[0], 1e-5)
            if want[1] is not None:
                assert isinstance(got[1], tf.IndexedSlices) == isinstance(
                    want[1], tf.IndexedSlices), what
                assert_same_tensors(tf.convert_to_tensor(want[1]),
                                    tf.convert_to_tensor(got[1]), 1e-5)
        stale = {c.name: len(_graph_tensors(list(c.values())))
                 for c in list(cache_module._all.values())}
        stale = {k: v for k, v in stale.items() if v}
        assert not stale, "after %s %s: caches holding graph tensors: %s" % (
            name, mode, stale)


# -- twins: the same op with another dtype, shape or attribute ------------------------

def _twins():
    """Programs that differ from each other only in a dtype, a static shape, an attribute
    or a constant input (what a loosely keyed cache would confuse)."""
    out = []
    for dtype in (tf.float32, tf.float64, tf.int32):
        out.append(("cast %s" % dtype.name, lambda x, d=dtype: tf.cast(x * 3.0, d)))
    for axis in (0, 1, -1, [0, 1]):
        out.append(("sum axis %s" % axis, lambda x, a=axis: tf.reduce_sum(x, axis=a)))
        out.append(("max keepdims axis %s" % axis,
                    lambda x, a=axis: tf.reduce_max(x, axis=a, keepdims=True)))
    for shape in ([6, 2], [2, 6], [3, 4], [-1]):
        out.append(("reshape %s" % shape, lambda x, s=shape: tf.reshape(x, s)))
    for perm in ([1, 0], [0, 1]):
        out.append(("transpose %s" % perm, lambda x, p=perm: tf.transpose(x, p)))
    for ta, tb in ((False, True), (True, False)):
        out.append(("matmul %s %s" % (ta, tb), lambda x, a=ta, b=tb: tf.matmul(
            x, x, transpose_a=a, transpose_b=b)))
    for k in (1, 2):
        out.append(("pool %d" % k, lambda x, k=k: tf.nn.max_pool2d(
            tf.reshape(x, [1, 3, 4, 1]), k, 1, "VALID")))
    out.append(("cumsum", lambda x: tf.cumsum(x, axis=1)))
    out.append(("cumsum exclusive", lambda x: tf.cumsum(x, axis=1, exclusive=True)))
    out.append(("cumsum reverse", lambda x: tf.cumsum(x, axis=1, reverse=True)))
    return out


@pytest.mark.parametrize("handler", ["OpLogHandler", "CheckNumerics", "Lazy", "Async",
                                     "DataFormat", "Recompute", "GradientTape",
                                     "vectorized_map", "eval_shape"])
def test_twin_ops_interleaved_never_share_a_cached_result(handler):
    twins = _twins()
    rng = random.Random(11)
    x = tf.constant(np.arange(12, dtype=np.float32).reshape(3, 4) / 7.0 - 0.5)
    for _ in range(2):
        rng.shuffle(twins)
        for what, fn in twins:
            want = fn(x)
            if handler == "vectorized_map":
                got = oh.vectorized_map(fn, x[None])[0]
            elif handler == "eval_shape":
                spec = oh.eval_shape(fn, tf.TensorSpec([3, 4]))
                assert spec.shape == want.shape and spec.dtype == want.dtype, what
                continue
            elif handler == "GradientTape":
                with oh.GradientTape():
                    got = fn(x)
            else:
                with _HANDLERS[handler]():
                    got = tf.identity(fn(x))
            assert got.dtype == want.dtype and got.shape == want.shape, (handler, what)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6,
                                       err_msg="%s under %s" % (what, handler))


# -- the per-op path's decisions: keyed by the handlers' declarations ------------------

class _Declared(oh.OpHandler):
    """Records the op types its execute sees; `handles_ops` given per instance."""

    def __init__(self, handles, name="a"):
        self.handles_ops = handles
        self.name = name
        self.seen = []

    def execute(self, op, inputs):
        self.seen.append(op.type)
        return self.next.execute(op, inputs)


class _Forwarding(oh.OpHandler):
    """The same declaration as `_Declared`, but no execute: everything runs in C++."""

    def __init__(self, handles):
        self.handles_ops = handles


def _ops():
    a = tf.ones([2, 2])
    b = tf.matmul(a, a)
    c = tf.add(b, a)
    return tf.sin(c)


def test_per_op_decisions_follow_each_stacks_declaration_interleaved():
    """The C++ per-op path caches a decision per (declaration, op type), shared between
    stacks of equal declarations: instances declaring other op types, the same types on
    a handler without execute, and nested stacks in either order, interleaved, must each
    see exactly their ops."""
    want = _ops()
    declarations = [None, frozenset(), {"MatMul"}, {"AddV2"}, {"MatMul", "AddV2"},
                    ("Sin",), lambda t: t.startswith("A")]
    universe = ["MatMul", "AddV2", "Sin"]
    rng = random.Random(3)
    for _ in range(3):
        rng.shuffle(declarations)
        for handles in declarations:
            expected_types = [t for t in universe if handles is None or (
                handles(t) if callable(handles) else t in handles)]
            h = _Declared(handles)
            with h:
                got = _ops()
            assert_same_tensors(want, got)
            assert [t for t in h.seen if t in universe] == expected_types, handles
            with _Forwarding(handles):
                assert_same_tensors(want, _ops())
            outer, inner = _Declared(handles, "outer"), _Declared({"Sin", "MatMul"}, "inner")
            first, second = (outer, inner) if rng.random() < 0.5 else (inner, outer)
            with first, second:
                assert_same_tensors(want, _ops())
            assert [t for t in outer.seen if t in universe] == expected_types, handles
            assert [t for t in inner.seen if t in universe] == ["MatMul", "Sin"]
