"""The replay cache never serves a stale function: its key holds everything a
replay depends on (the called function, the arguments' dtypes and shapes, the handlers'
declarations and cache keys), and a fresh handler of a shared declaration per call still
hits the one replay. Every result is compared with plain TensorFlow on the same inputs.
"""
import gc
import weakref

import numpy as np
import tensorflow as tf

import tf_ophandlers as oh
from tf_ophandlers.core import functions as replay

from conftest import assert_close


class _Shared(oh.OpHandler):
    """A pass-through handler whose replays are shared between instances."""

    def function_cache_key(self):
        return "shared"


class _AddOne(_Shared):
    """Same cache key value as _Shared, but its replay differs (Mul results plus one)."""

    def execute(self, op, inputs):
        outputs = self.next.execute(op, inputs)
        if op.type == "Mul":
            outputs = [tf.add(o, tf.ones_like(o)) for o in outputs]
        return outputs


class _AddStaticLength(_Shared):
    """A replay that bakes the static length of Mul's input into the function."""

    def execute(self, op, inputs):
        outputs = self.next.execute(op, inputs)
        if op.type == "Mul":
            n = inputs[0].shape[0]
            outputs = [o + tf.constant(-1.0 if n is None else float(n)) for o in outputs]
        return outputs


class _Scaled(oh.OpHandler):
    """A replay that depends on the instance's `scale`, which its cache key includes."""

    def __init__(self, scale):
        self.scale = scale

    def execute(self, op, inputs):
        outputs = self.next.execute(op, inputs)
        if op.type == "Sin":
            outputs = [o * self.scale for o in outputs]
        return outputs

    def function_cache_key(self):
        return ("_Scaled", self.scale)


def test_same_function_different_dtypes_are_different_replays():
    f = tf.function(lambda t: t * 3.0 + tf.ones_like(t))
    for dtype in (tf.float32, tf.float64, tf.float16, tf.float32):
        x = tf.constant([1.5, -2.0], dtype)
        with _Shared():
            got = f(x)
        want = f(x)
        assert got.dtype == want.dtype == dtype
        assert_close(got, want, 1e-3)


def test_one_concrete_function_for_several_shapes_replays_per_shape():
    # With reduce_retracing TensorFlow calls one concrete function (shape [None]) for
    # every length: the replay, which may specialize shapes, is keyed by the shape.
    f = tf.function(lambda t: tf.cast(tf.shape(t)[0], tf.float32) * tf.reduce_sum(t),
                    reduce_retracing=True)
    for n in (2, 3, 4, 5, 3, 2):
        x = tf.range(n, dtype=tf.float32)
        with _Shared():
            got = f(x)
        assert_close(got, f(x))
        assert_close(got, n * np.arange(n).sum())
    g = tf.function(lambda t: t * 2.0, reduce_retracing=True)
    for n in (2, 3, 4, 3, 2):
        x = tf.range(n, dtype=tf.float32)
        with _AddStaticLength():
            got = g(x)
        assert_close(got, g(x) + n)
    x = tf.range(4, dtype=tf.float32)
    gc.collect()  # (earlier tests' dropped functions release their replays now)
    before = replay.cache_info()
    with _Shared():
        f(x)  # seen before: no new replay
    assert replay.cache_info() == before


def test_same_python_function_different_captured_variables():
    class Model(tf.Module):
        def __init__(self, value):
            super().__init__()
            self.w = tf.Variable(value)

        @tf.function
        def __call__(self, x):
            return tf.sin(x) * self.w

    models = [Model([1.0, 2.0]), Model([-3.0, 0.5]), Model(tf.constant([4.0, 5.0, 6.0]))]
    x2, x3 = tf.constant([0.3, 0.7]), tf.constant([0.1, 0.2, 0.3])
    for m in models + models:
        x = x3 if m.w.shape[0] == 3 else x2
        with _Shared():
            got = m(x)
        assert_close(got, m(x))
    # A variable's new value is read at call time, not baked into the cached replay.
    m = models[0]
    with _Shared():
        m(x2)
    m.w.assign([10.0, 20.0])
    with _Shared():
        got = m(x2)
    assert_close(got, np.sin([0.3, 0.7]) * [10.0, 20.0])


def test_equal_cache_keys_of_different_handler_types_are_different_replays():
    f = tf.function(lambda t: t * 2.0)
    x = tf.constant([1.0, 2.0])
    with _Shared():
        plain = f(x)
    with _AddOne():
        added = f(x)
    with _Shared():
        plain_again = f(x)
    assert_close(plain, [2.0, 4.0])
    assert_close(added, [3.0, 5.0])
    assert_close(plain_again, [2.0, 4.0])


def test_instance_declarations_in_the_cache_key_give_their_own_replays():
    f = tf.function(lambda t: tf.sin(t) + 1.0)
    x = tf.constant([0.5, 1.5])
    for scale in (2.0, 3.0, 2.0, -1.0):
        with _Scaled(scale):
            got = f(x)
        assert_close(got, np.sin([0.5, 1.5]) * scale + 1.0, 1e-5)


def test_fresh_handlers_per_call_share_one_replay_and_the_cache_is_bounded():
    replay.clear_cache()  # counted by entries: a full cache (earlier tests) would hide one
    f = tf.function(lambda t: tf.nn.relu(t) * 2.0)
    x = tf.constant([[-1.0, 2.0]])
    with _Shared():
        f(x)
    with oh.DataFormat():
        f(x)
    gc.collect()  # (earlier tests' dropped functions release their replays now)
    before = replay.cache_info()
    for _ in range(3):
        with _Shared():
            assert_close(f(x), [[0.0, 4.0]])
        with oh.DataFormat():
            assert_close(f(x), [[0.0, 4.0]])
    assert replay.cache_info() == before
    entries, maxsize = oh.caches()["functions.replays"]
    assert entries == before and 0 < maxsize <= 4096


def test_keras_model_replays_follow_the_batch_size():
    # A partial last batch (another shape) gets its own replay, with the plain result.
    keras = tf.keras
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                              keras.layers.Dense(2)])
    f = tf.function(lambda t: model(t), reduce_retracing=True)
    rng = np.random.default_rng(0)
    for n in (8, 8, 5, 8, 1):
        x = tf.constant(rng.normal(size=(n, 3)), tf.float32)
        with _Shared():
            got = f(x)
        assert got.shape == (n, 2)
        assert_close(got, model(x), 1e-5)


def _count_replays(monkeypatch):
    """A list whose length is the number of replays traced from now on."""
    from tf_ophandlers.core.functions import call as call_module
    traced, trace = [], call_module._trace

    def counted(*args, **kwargs):
        traced.append(args[3])  # (the function's name)
        return trace(*args, **kwargs)

    monkeypatch.setattr(call_module, "_trace", counted)
    return traced


def _training_steps(tape_class, handler, steps):
    """Per step: a new tape around a call of a tf.function under `handler()` (None: no
    handler); the losses and the gradients of x and the variable W."""
    W = tf.Variable(np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(4, 4))
    f = tf.function(lambda t: tf.tanh(tf.matmul(t, W)) * t)
    x = tf.constant(np.arange(12, dtype=np.float32).reshape(3, 4) / 10)
    results, tapes = [], []
    for _ in range(steps):
        with tape_class() as tape:
            tape.watch(x)
            if handler is None:
                y = f(x)
            else:
                with handler():
                    y = f(x)
            loss = tf.reduce_sum(y * y)
        results.append((loss, tape.gradient(loss, [x, W])))
        tapes.append(weakref.ref(tape))
        del tape
    return results, tapes


def test_a_new_tape_per_step_below_the_handler_reuses_the_replay(monkeypatch):
    # A training loop: the handler above a fresh tape each step replays the function
    # once; the tape (the replay's bottom) is not part of the replay, nor kept by it.
    want, _ = _training_steps(tf.GradientTape, None, 1)
    traced = _count_replays(monkeypatch)
    got, tapes = _training_steps(oh.GradientTape, _Shared, 3)
    assert len(traced) == 1, traced
    for loss, grads in got:
        assert_close(loss, want[0][0], 1e-5)
        for g, w in zip(grads, want[0][1]):
            assert_close(g, w, 1e-5)
    del got, loss, grads, g  # (the last step's results may refer to its tape)
    gc.collect()
    assert [t() for t in tapes] == [None] * len(tapes)


def test_a_new_tape_per_step_below_vectorized_map_reuses_the_replay(monkeypatch):
    # Per-example values under a tape around oh.vectorized_map over a tf.function, a new
    # tape and a new map each step; against tf.vectorized_map under tf.GradientTape.
    W = tf.Variable(np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(4, 4))
    f = tf.function(lambda e: tf.tanh(tf.linalg.matvec(W, e)) * e)
    x = tf.constant(np.arange(12, dtype=np.float32).reshape(3, 4) / 10)

    def step(tape_class, vectorized_map):
        with tape_class() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.square(vectorized_map(f, x)))
        return loss, tape.gradient(loss, [x, W])

    want, want_grads = step(tf.GradientTape, tf.vectorized_map)
    traced = _count_replays(monkeypatch)
    for _ in range(3):
        got, grads = step(oh.GradientTape, oh.vectorized_map)
        assert_close(got, want, 1e-5)
        for g, w in zip(grads, want_grads):
            assert_close(g, w, 1e-5)
    assert len(traced) == 1, traced


def test_bottoms_of_other_structures_get_their_own_replays(monkeypatch):
    # The bottom's structure stays in the key: no tape (physical) and a tape, and two
    # nested tapes, are three replays; each gives TensorFlow's values and gradients.
    f = tf.function(lambda t: tf.sin(t) * t)
    x = tf.constant([0.5, -1.5])
    traced = _count_replays(monkeypatch)
    for _ in range(2):
        with _Shared():
            assert_close(f(x), np.sin([0.5, -1.5]) * [0.5, -1.5], 1e-6)
        with oh.GradientTape() as tape:
            tape.watch(x)
            with _Shared():
                y = f(x)
        assert_close(tape.gradient(y, x), np.sin([0.5, -1.5]) + np.cos([0.5, -1.5]) * [
            0.5, -1.5], 1e-6)
        with oh.GradientTape() as outer:
            outer.watch(x)
            with oh.GradientTape() as inner:
                inner.watch(x)
                with _Shared():
                    y = f(x)
            g = inner.gradient(y, x)
        h = outer.gradient(g, x)
        c, s = np.cos([0.5, -1.5]), np.sin([0.5, -1.5])
        assert_close(h, 2 * c - s * [0.5, -1.5], 1e-5)
    assert len(traced) == 3, traced
