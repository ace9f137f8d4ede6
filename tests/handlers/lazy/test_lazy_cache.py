"""oh.Lazy's process-wide compile cache and Lazy(jit_compile=True)."""
import random

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.handlers.lazy import compiler as lazy_compile

from conftest import assert_close


@pytest.fixture(autouse=True)
def _empty_compile_cache():
    """Tests here count compiles and hits (`compiled == 1` on a structure's first use):
    the process-wide cache starts empty, so a structure compiled by an earlier test (or
    by this test in an earlier run in the same process) cannot turn a compile into a hit."""
    lazy_compile.functions.clear()
    yield


def _chain(h, n=20):
    for _ in range(n):
        h = tf.tanh(h) * 1.01
    return h


def _lazy_value(fn, *args, jit=False):
    """fn(*args) under a fresh `oh.Lazy()`; (value, handler)."""
    lazy = oh.Lazy(jit_compile=jit)
    with lazy:
        value = fn(*args).numpy()
    return value, lazy


def test_fresh_scopes_share_one_compiled_function():
    x = tf.random.stateless_normal([13, 7], seed=[1, 2])  # a shape no other test uses
    entries = len(lazy_compile.functions)
    value, first = _lazy_value(_chain, x)
    assert (first.compiled, first.cache_hits, first.flushes) == (1, 0, 1)
    assert len(lazy_compile.functions) == min(entries + 1, lazy_compile.CACHE_SIZE)
    assert_close(value, _chain(x))
    for seed in range(3):  # new scopes, new input values, same structure: cache hits
        x2 = tf.random.stateless_normal([13, 7], seed=[seed, 5])
        value, lazy = _lazy_value(_chain, x2)
        assert (lazy.compiled, lazy.cache_hits) == (0, 1)
        assert lazy.last_function is first.last_function
        assert_close(value, _chain(x2))
    assert "lazy.functions" in oh.caches()


def test_a_tape_below_runs_op_by_op_never_a_function_compiled_for_physical():
    x = tf.random.stateless_normal([11, 3], seed=[3, 4])
    _lazy_value(_chain, x)  # compiled (or cached) for the physical devices
    with tf.GradientTape() as ref_tape:
        ref_tape.watch(x)
        ref = tf.reduce_sum(_chain(x))
    with oh.GradientTape() as tape:
        tape.watch(x)
        lazy = oh.Lazy()
        with lazy:
            y = tf.reduce_sum(_chain(x))
    assert (lazy.compiled, lazy.cache_hits) == (0, 0)  # the stack below differs
    assert_close(y, ref)
    assert_close(tape.gradient(y, x), ref_tape.gradient(ref, x))


# -- no stale hits: random programs whose structures overlap ------------------------------

_OPS = (
    ("tanh", lambda h, p: tf.tanh(h)),
    ("scale", lambda h, p: h * p),                       # a Python constant: an input
    ("leaky", lambda h, p: tf.nn.leaky_relu(h, alpha=p)),  # an attribute
    ("cumsum", lambda h, p: tf.math.cumsum(h, axis=-1, exclusive=p > 0.5)),
    ("sum", lambda h, p: tf.reduce_sum(h, axis=-1, keepdims=p > 0.5)),
    ("cast", lambda h, p: tf.cast(tf.cast(h, tf.float16 if p > 0.5 else tf.float64),
                                  h.dtype)),
    ("square", lambda h, p: tf.square(h) - h),
)


def _program(rng):
    """A short random program: (op name, parameter) steps from a small alphabet, so
    programs share prefixes and differ in an attribute, a constant or a dtype."""
    return [(rng.choice(_OPS), rng.choice((0.25, 0.75))) for _ in range(rng.randint(1, 4))]


def _run(program, x):
    h = x
    for (name, fn), p in program:  # (a scalar is not reduced or summed along an axis)
        h = fn(h, p) if h.shape.rank or name not in ("cumsum", "sum") else tf.tanh(h) * p
    return h


def _variants(program, shape, dtype, rng):
    """The program and its near twins: one parameter flipped (an attribute or a Python
    constant), the other dtype, another shape of the same rank."""
    out = [(program, shape, dtype)]
    k = rng.randrange(len(program))
    flipped = list(program)
    flipped[k] = (program[k][0], 1.0 - program[k][1])
    out.append((flipped, shape, dtype))
    out.append((program, shape, tf.float64 if dtype == tf.float32 else tf.float32))
    out.append((program, [shape[1], shape[0] + 1], dtype))
    return out


def test_random_programs_and_their_twins_never_hit_a_stale_function():
    rng = random.Random(17)
    runs = []
    for _ in range(10):
        shape = [rng.randint(1, 3), rng.randint(2, 3)]
        runs += _variants(_program(rng), shape, rng.choice((tf.float32, tf.float64)), rng)
    rng.shuffle(runs)  # twins interleaved with other programs
    for case, (program, shape, dtype) in enumerate(runs):
        x = tf.cast(tf.random.stateless_normal(shape, seed=[case, 1]), dtype)
        if case % 4 == 0:
            # A fresh tf.function: called under Lazy it runs as one op in program order
            # and its output feeds recorded ops.
            fn = tf.function(lambda t, program=program: _run(program, t))
            value, _ = _lazy_value(lambda t: tf.tanh(fn(t)) * 2.0, x)
            expected = tf.tanh(fn(x)) * 2.0
        else:
            value, _ = _lazy_value(lambda t, program=program: _run(program, t), x)
            expected = _run(program, x)
        assert value.dtype == expected.dtype.as_numpy_dtype, program
        assert value.shape == tuple(expected.shape), program
        assert_close(value, expected)


def test_unknown_and_partial_batch_dims_compile_per_shape():
    w = tf.random.stateless_normal([4, 3], seed=[1, 9])

    def step(x):
        return tf.reduce_sum(tf.tanh(tf.matmul(x, w)), axis=1)

    @tf.function(input_signature=[tf.TensorSpec([None, 4])])
    def reference(x):
        return step(x)

    seen = set()
    for batch in (5, 5, 2, 5, 1):  # a partial last batch
        x = tf.random.stateless_normal([batch, 4], seed=[batch, 2])
        value, lazy = _lazy_value(step, x)
        # One function per input shape (its static shapes are those of the inputs).
        assert (lazy.compiled, lazy.cache_hits) == ((0, 1) if batch in seen else (1, 0))
        seen.add(batch)
        assert value.shape == (batch,)
        assert_close(value, reference(x))


def test_device_scopes_are_part_of_the_key():
    x = tf.random.stateless_normal([6, 5], seed=[4, 4])
    cpu = tf.config.list_logical_devices("CPU")[0].name
    plain, _ = _lazy_value(_chain, x)
    lazy = oh.Lazy()
    with lazy:
        with tf.device(cpu):
            h = _chain(x)
        placed = h.numpy()
    assert lazy.compiled + lazy.cache_hits == 1
    ops = [o for o in lazy.last_function.graph.get_operations() if o.type == "Tanh"]
    assert ops and all(o.device.endswith("CPU:0") for o in ops)
    assert_close(placed, plain)


def test_cache_is_bounded_and_evicted_structures_recompile(monkeypatch):
    monkeypatch.setattr(lazy_compile.functions, "maxsize", 3)
    lazy_compile.functions.clear()
    for n in range(1, 6):
        x = tf.random.stateless_normal([n, 9], seed=[n, 3])
        value, lazy = _lazy_value(_chain, x)
        assert lazy.compiled == 1
        assert len(lazy_compile.functions) <= 3
        assert_close(value, _chain(x))
    x = tf.random.stateless_normal([1, 9], seed=[1, 3])  # evicted: built again
    value, lazy = _lazy_value(_chain, x)
    assert lazy.compiled == 1 and len(lazy_compile.functions) == 3
    x = tf.random.stateless_normal([5, 9], seed=[0, 3])  # still cached
    value, lazy = _lazy_value(_chain, x)
    assert (lazy.compiled, lazy.cache_hits) == (0, 1)
    assert_close(value, _chain(x))


# -- jit_compile=True ------------------------------------------------------------------------

def test_jit_compile_equals_xla_and_eager_and_has_its_own_cache_entry():
    x = tf.random.stateless_uniform([32, 32], seed=[5, 6])
    value, lazy = _lazy_value(_chain, x, jit=True)
    assert lazy.compiled + lazy.cache_hits == 1
    assert lazy.last_function.function_def.attr["_XlaMustCompile"].b
    assert_close(value, tf.function(_chain, jit_compile=True)(x))
    assert_close(value, _chain(x))
    plain, other = _lazy_value(_chain, x)
    assert other.last_function is not lazy.last_function
    assert "_XlaMustCompile" not in other.last_function.function_def.attr
    again, hit = _lazy_value(_chain, tf.random.stateless_uniform([32, 32], seed=[7, 6]),
                             jit=True)
    assert (hit.compiled, hit.cache_hits) == (0, 1)
    assert hit.debug_string() == "Lazy(jit_compile=True)"


def _with_dawsn(h):
    # Dawsn has no XLA kernel on CPU: XLA's error names it, it runs outside the XLA calls.
    h = tf.tanh(h) * 2.0
    return tf.tanh(tf.math.special.dawsn(h) + 1.0) * 3.0


def test_jit_compile_falls_back_around_an_op_without_an_xla_kernel():
    x = tf.random.stateless_normal([3, 17], seed=[8, 8])
    lazy_compile.no_xla_ops.pop("Dawsn", None)
    value, lazy = _lazy_value(_with_dawsn, x, jit=True)
    assert "Dawsn" in lazy_compile.no_xla_ops
    assert lazy.compiled == 2  # the XLA attempt failed, the segmented function ran
    graph_ops = {o.type for o in lazy.last_function.graph.get_operations()}
    assert "Dawsn" in graph_ops and "PartitionedCall" in graph_ops  # XLA calls around it
    assert_close(value, _with_dawsn(x))
    # A new structure with Dawsn is segmented at once; the same one hits the cache.
    y = tf.random.stateless_normal([2, 17], seed=[8, 9])
    value, lazy = _lazy_value(_with_dawsn, y, jit=True)
    assert lazy.compiled == 1
    assert_close(value, _with_dawsn(y))
    value, lazy = _lazy_value(_with_dawsn, y, jit=True)
    assert (lazy.compiled, lazy.cache_hits) == (0, 1)


def test_jit_compile_with_string_ops_and_eager_errors():
    x = tf.constant([[1.5, -2.25]])

    def strings(h):
        n = tf.cast(tf.strings.length(tf.strings.as_string(h)), tf.float32)
        return tf.tanh(n * 0.1 + h) * 3.0

    value, lazy = _lazy_value(strings, x, jit=True)
    assert lazy.compiled == 1  # string ops stay outside the XLA call from the start
    assert_close(value, strings(x))
    with pytest.raises(TypeError, match="jit_compile"):
        oh.Lazy(jit_compile="yes")
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="eshape"):
        with oh.Lazy(jit_compile=True):
            tf.reshape(tf.ones([2, 3]) * 2.0, [7]).numpy()


def test_jit_compile_keras_model_matches_eager():
    import keras  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(4)])
    x = np.random.RandomState(0).randn(5, 8).astype(np.float32)
    expected = model(x)
    for jit in (False, True):
        with oh.Lazy(jit_compile=jit):
            got = model(x).numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def _split_program(x):
    """Multi-output ops whose outputs are dropped, kept, or needed by pending ops that a
    first value request does not cover; returns (first request, the rest)."""
    a, b, c = tf.split(tf.tanh(x), 3, axis=1)
    u = a * 2.0  # pending, outside the first request's subgraph, needs a
    del a, c  # dropped by the program: only u still needs a
    first = tf.reduce_sum(b + 1.0).numpy()  # runs split (keeps a for u) and b's chain
    m, i = tf.nn.top_k(u + b, k=2)  # two outputs, both kept
    return first, (m.numpy(), i.numpy(), (u - 1.0).numpy())


def test_partial_value_requests_keep_outputs_pending_ops_need():
    x = tf.random.stateless_normal([4, 9], seed=[8, 1])
    want = _split_program(x)
    for step in range(3):  # a fresh scope per step: the first one compiles, then hits
        lazy = oh.Lazy()
        with lazy:
            got = _split_program(x)
        assert lazy.flushes >= 2
        if step:
            assert lazy.compiled == 0 and lazy.cache_hits == lazy.flushes
        assert_close(got[0], want[0])
        for g, w in zip(got[1], want[1]):
            assert g.dtype == w.dtype
            np.testing.assert_allclose(g, w, rtol=1e-6)


def test_signatures_from_output_dtypes_only_where_the_attributes_follow():
    """A node's signature is looked up by (op type, output dtypes) only for op types whose
    attributes all follow from the output dtypes; ops of one type and output dtype with
    other attributes (LeakyRelu's alpha, Cast's source type, a reduction's keepdims)
    never share a compiled function, and neither do dtypes."""
    follow = lazy_compile.attrs_follow_outputs
    assert follow("Tanh") and follow("Mul") and follow("AddV2")
    assert not follow("LeakyRelu")  # alpha: a float
    assert not follow("Cast")  # SrcT is no output's dtype
    assert not follow("IsFinite")  # T only types the input
    assert not follow("Sum")  # keep_dims, Tidx
    assert not follow("NoSuchOpType")
    x32 = tf.random.stateless_normal([5, 4], seed=[7, 8])
    programs = [
        (lambda x: tf.nn.leaky_relu(tf.tanh(x), alpha=0.1), x32),
        (lambda x: tf.nn.leaky_relu(tf.tanh(x), alpha=0.3), x32),
        (lambda x: tf.cast(tf.cast(tf.tanh(x), tf.float64), tf.float32), x32),
        (lambda x: tf.cast(tf.cast(tf.tanh(x), tf.int32), tf.float32), x32 * 3.0),
        (lambda x: tf.reduce_sum(tf.tanh(x) * 2.0, axis=0, keepdims=True), x32),
        (lambda x: tf.reduce_sum(tf.tanh(x) * 2.0, axis=0, keepdims=False), x32),
        (lambda x: tf.tanh(x) * 2.0 + x, x32),
        (lambda x: tf.tanh(x) * 2.0 + x, tf.cast(x32, tf.float64)),
        (lambda x: tf.tanh(x) * 2.0 + x, tf.cast(x32, tf.float16)),
    ]
    for _ in range(2):  # the second round's lookups hit
        for fn, x in programs:
            want = fn(x)
            got, _ = _lazy_value(fn, x)
            assert got.dtype == want.dtype.as_numpy_dtype and got.shape == tuple(want.shape)
            assert_close(got, want)
