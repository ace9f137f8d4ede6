"""oh.Lazy(chunk_ops=N): pending ops launched in compiled chunks on an async executor
while recording goes on."""
import random

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

from conftest import assert_close

_STEPS = (
    lambda h, p: tf.tanh(h),
    lambda h, p: h * p,
    lambda h, p: tf.nn.leaky_relu(h, alpha=p),
    lambda h, p: tf.math.cumsum(h, axis=-1, exclusive=p > 0.5),
    lambda h, p: tf.cast(tf.cast(h, tf.float64 if p > 0.5 else tf.float16), h.dtype),
    lambda h, p: tf.square(h) - h * p,
    lambda h, p: tf.concat(tf.split(h, 2, axis=-1)[::-1], axis=-1),  # multi-output
    lambda h, p: tf.cast(tf.cast(h * 4.0, tf.int32) % 3, h.dtype) + tf.sin(h),
)


def _program(rng, n):
    return [(rng.randrange(len(_STEPS)), rng.choice((0.25, 0.75))) for _ in range(n)]


def _run(program, x, keep_every=0):
    """The program on x; returns the last value and some intermediate values the
    program keeps (outputs of chunks referenced by the user)."""
    h, kept = x, []
    for j, (k, p) in enumerate(program):
        h = _STEPS[k](h, p)
        if keep_every and j % keep_every == 0:
            kept.append(h)
    return [h] + kept


def _lazy(fn, *args, **kwargs):
    lazy = oh.Lazy(**kwargs)
    with lazy:
        out = [t.numpy() for t in fn(*args)]
    return out, lazy


def _same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        w = np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        assert_close(g, w, 1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_random_chains_crossing_chunk_boundaries_equal_eager(chunk):
    rng = random.Random(chunk)
    for case in range(4):
        program = _program(rng, rng.randint(5, 20))
        dtype = (tf.float32, tf.float64)[case % 2]
        x = tf.cast(tf.random.stateless_normal([3, 4], seed=[case, chunk]), dtype)
        want = _run(program, x, keep_every=case)
        got, lazy = _lazy(_run, program, x, case, chunk_ops=chunk)
        _same(got, want)
        # A fresh scope on new values: every chunk is a cache hit, launched async.
        x2 = x * 0.5
        got, lazy = _lazy(_run, program, x2, case, chunk_ops=chunk)
        _same(got, _run(program, x2, keep_every=case))
        assert lazy.compiled == 0
        if len(program) >= 2 * chunk:
            assert lazy.chunks >= 1


def test_chunks_next_to_a_fresh_tf_function_and_stateful_ops_keep_order():
    v = tf.Variable(tf.ones([4, 4]))
    x = tf.random.stateless_normal([4, 4], seed=[5, 5])

    def step(x):
        fn = tf.function(lambda t: tf.tanh(t) * 3.0)  # a fresh tf.function, one op
        h = x
        for _ in range(6):
            h = tf.sin(h) + 1.0
        h = fn(h) + v  # a variable read: runs in program order
        v.assign_add(h)  # stateful: after its inputs are computed
        for _ in range(6):
            h = tf.tanh(h) * v  # reads the updated value
        r = tf.random.uniform([4, 4])  # a stateful random op: in program order
        for _ in range(6):
            h = tf.cos(h) + r
        return [h, v.read_value(), r + tf.random.uniform([4, 4])]

    v.assign(tf.ones([4, 4]))
    tf.random.set_seed(11)
    want = [t.numpy() for t in step(x)]
    for _ in range(2):
        v.assign(tf.ones([4, 4]))
        tf.random.set_seed(11)
        got, lazy = _lazy(step, x, chunk_ops=4)
        _same(got, want)
    assert lazy.chunks >= 2


def test_fresh_scopes_hit_the_cache_and_a_chunk_returns_only_referenced_outputs():
    x = tf.random.stateless_normal([6, 5], seed=[1, 7])  # a shape no other test uses

    def chain(h, n=10):
        for _ in range(n):
            h = tf.tanh(h) * 1.5
        return h

    def step(x):  # 40 ops, one more: a chunk of 10 launched 4 times; 1 op at the request
        h = tf.sin(chain(chain(x)))
        # (the last launched chunk) its intermediate values stay inside the function
        outputs.append(len(lazy.last_function.outputs))
        return [h]

    want = [tf.sin(chain(chain(x)))]
    for seed in range(4):
        x2 = x if seed == 3 else tf.random.stateless_normal([6, 5], seed=[seed, 8])
        outputs = []
        lazy = oh.Lazy(chunk_ops=10)
        with lazy:
            got = [t.numpy() for t in step(x2)]
        _same(got, want if seed == 3 else [tf.sin(chain(chain(x2)))])
        assert outputs == [1]
        if seed:
            assert (lazy.compiled, lazy.chunks, lazy.cache_hits) == (0, 4, 5)


def test_partial_batches_compile_per_shape_and_equal_a_tf_function():
    w = tf.random.stateless_normal([4, 3], seed=[1, 9])

    def step(x):
        h = tf.matmul(x, w)
        for _ in range(5):
            h = tf.nn.relu(h) - 0.1 * h
        return [tf.reduce_sum(h, axis=1)]

    ref = tf.function(step, input_signature=[tf.TensorSpec([None, 4])])
    for batch in (5, 5, 2, 5, 2):  # a partial last batch
        x = tf.random.stateless_normal([batch, 4], seed=[batch, 2])
        got, _ = _lazy(step, x, chunk_ops=3)
        _same(got, ref(x))


def test_a_kernel_error_in_a_chunk_is_raised_at_the_value_request_and_scope_exit():
    x = tf.ones([7])

    def bad(h):
        for _ in range(3):
            h = tf.tanh(h)
        r = tf.reshape(h, [3, 5])  # 7 values: the kernel rejects it
        for _ in range(8):
            r = r * 2.0
        return r

    lazy = oh.Lazy(chunk_ops=4)
    for trial in range(3):  # compiled chunk (run at once), then async cache hits
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r"oh\.Lazy: a compiled chunk .*Reshape.*Input to reshape"):
            with lazy:
                r = bad(x)
                good = tf.reduce_sum(x) * 2.0  # recorded after the failing chunk
        if trial:
            assert lazy.chunks >= 1
        # The handler (and its executor) stays usable.
        with lazy:
            assert float(tf.reduce_sum(tf.tanh(x) * 2.0)) == pytest.approx(
                float(tf.reduce_sum(tf.tanh(x) * 2.0)))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"oh\.Lazy.*Reshape"):
        with lazy:
            r = bad(x)
            r.numpy()  # the value request raises (inside the scope)
    del r, good
    with lazy:
        assert bad(tf.ones([15])).numpy().shape == (3, 5)


def test_keras_model_and_jit_compile_chunks():
    import keras  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(4)])
    x = np.random.RandomState(1).randn(5, 8).astype(np.float32)
    expected = model(x).numpy()
    for jit in (False, True):
        for _ in range(2):
            with oh.Lazy(jit_compile=jit, chunk_ops=3):
                got = model(x).numpy()
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    h = tf.random.stateless_normal([32, 32], seed=[2, 2])

    def chain(h):
        for _ in range(30):
            h = tf.tanh(h) * 1.01
        return h

    xla = tf.function(chain, jit_compile=True)(h)
    for _ in range(2):
        lazy = oh.Lazy(jit_compile=True, chunk_ops=16)
        with lazy:
            got = chain(h).numpy()
    assert lazy.chunks == 3 and lazy.compiled == 0
    assert lazy.last_function.function_def.attr["_XlaMustCompile"].b
    np.testing.assert_allclose(got, xla, rtol=1e-5, atol=1e-6)


def test_a_tape_below_sees_the_ops_one_by_one():
    x = tf.random.stateless_normal([3, 3], seed=[4, 4])

    def f(x):
        h = x
        for _ in range(8):
            h = tf.sin(h) * 1.1
        return tf.reduce_sum(h)

    with tf.GradientTape() as ref_tape:
        ref_tape.watch(x)
        ref = f(x)
    with oh.GradientTape() as tape:
        tape.watch(x)
        lazy = oh.Lazy(chunk_ops=3)
        with lazy:
            y = f(x)
    assert lazy.chunks == 0  # not on the physical devices: no compiled chunk
    assert_close(y, ref)
    assert_close(tape.gradient(y, x), ref_tape.gradient(ref, x))


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_chunk_ops_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="oh.Lazy: chunk_ops"):
        oh.Lazy(chunk_ops=bad)


def test_chunks_leave_the_threads_executor_as_it_was():
    # A chunk runs on the handler's asynchronous executor; the thread's own executor (the
    # synchronous default, or one the program chose) is current again after each launch:
    # ops the program runs between launches, and after the scope, run on it.
    from tensorflow.python.eager import context, executor  # pylint: disable=import-outside-toplevel
    x = tf.random.stateless_normal([4, 4], seed=[3, 5])

    def chain(h):
        for _ in range(12):
            h = tf.tanh(h) * 1.25
        return h

    want = chain(x).numpy()
    seen = []
    own = executor.new_executor(enable_async=True)
    for scope in (None, own):
        if scope is not None:
            cm = context.executor_scope(scope)
            cm.__enter__()
        try:
            lazy = oh.Lazy(chunk_ops=4)
            with lazy:
                h = chain(x)
                seen.append(context.context().executor.is_async())  # between launches
                got = h.numpy()
            seen.append(context.context().executor.is_async())  # after the scope
            assert lazy.chunks >= 2
            assert_close(got, want, 1e-6)
        finally:
            if scope is not None:
                cm.__exit__(None, None, None)
        seen.append(context.context().executor.is_async())
    own.wait()
    assert seen == [False, False, False, True, True, False]
