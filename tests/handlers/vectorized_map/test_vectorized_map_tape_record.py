"""oh.GradientTape inside oh.vectorized_map records in C: the tape's level runs over the
map's Python execute hook from C (cc/fast/fast_record.cc RunAfterExecute over RunHook),
with inputs from elsewhere copied on through the tape's copy_on as the Python path does.
Checked against tf.vectorized_map with tf.GradientTape (values, dtypes, dense vs
IndexedSlices), against the same tape on the Python path, for a Keras model with a partial
batch, and for errors of a copy_on hook on the new path."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
import tf_ophandlers._C as _C
from tf_ophandlers.core import stack as _stack
from conftest import assert_close, assert_same_tensors


class PythonPathTape(oh.GradientTape):
    """The tape on the Python path: `returns_off_stack` makes the C++ decision FAST_PYTHON
    for every op type (HandlerStack._oh_fast), so every op of its stack is executed by
    HandlerStack.execute in Python (the reference of the C path)."""

    returns_off_stack = True


def _weights():
    w1 = tf.Variable(tf.random.stateless_normal([6, 5], seed=[1, 1]))
    b1 = tf.Variable(tf.random.stateless_normal([5], seed=[1, 2]))
    w2 = tf.Variable(tf.random.stateless_normal([5, 3], seed=[1, 3]))
    emb = tf.Variable(tf.random.stateless_normal([7, 3], seed=[1, 4]))
    return [w1, b1, w2, emb]


def _per_example(tape_cls, variables, extra):
    w1, b1, w2, emb = variables

    def fn(ex):
        e, y, i = ex
        with tape_cls() as t:
            t.watch(extra)  # a physical capture: copied on through the tape, recorded
            h = tf.nn.relu(tf.matmul(e[None], w1) + b1) * extra
            logits = tf.matmul(h, w2) + tf.gather(emb, i)[None]
            loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
                y[None], logits))
        return t.gradient(loss, variables + [extra])

    return fn


def _data(n):
    x = tf.random.stateless_normal([n, 6], seed=[2, 1])
    y = tf.random.stateless_uniform([n], seed=[2, 2], maxval=3, dtype=tf.int32)
    i = tf.random.stateless_uniform([n], seed=[2, 3], maxval=7, dtype=tf.int32)
    return x, y, i


def _count_python_executes(fn):
    """(fn(), {handler class name: HandlerStack.execute calls})."""
    counts = {}
    original = _stack.HandlerStack.execute

    def counting(self, op, inputs):
        name = type(self.handler).__name__
        counts[name] = counts.get(name, 0) + 1
        return original(self, op, inputs)

    _stack.HandlerStack.execute = counting
    try:
        return fn(), counts
    finally:
        _stack.HandlerStack.execute = original


def _per_example_grads():
    """(tf.vectorized_map's, oh.vectorized_map's per-example gradients, HandlerStack.execute
    calls per handler, fast-path ops counted, data, variables, extra), after a warm-up."""
    variables = _weights()
    extra = tf.constant(1.5)
    data = _data(8)
    want = tf.vectorized_map(_per_example(tf.GradientTape, variables, extra), data)
    fn = _per_example(oh.GradientTape, variables, extra)
    oh.vectorized_map(fn, data)  # decisions and plans made
    before = _C.fast_stats()["fast_ops"]
    got, python = _count_python_executes(lambda: oh.vectorized_map(fn, data))
    ran_fast = _C.fast_stats()["fast_ops"] - before
    return want, got, python, ran_fast, data, variables, extra


def test_per_example_grads_match_tf_vectorized_map_and_the_python_path():
    want, got, _, _, data, variables, extra = _per_example_grads()
    assert_same_tensors(want, got)
    # The same tape on the Python path gives the same tensors, bit for bit, and the same
    # types (the map's outputs are dense per-example tensors, as tf.vectorized_map's; the
    # gather's gradient inside is IndexedSlices on both paths).
    ref, python_ref = _count_python_executes(
        lambda: oh.vectorized_map(_per_example(PythonPathTape, variables, extra), data))
    assert python_ref.get("PythonPathTape", 0) > 0  # the reference did take Python
    assert [type(g) for g in got] == [type(g) for g in ref]
    for a, b in zip(tf.nest.flatten(ref), tf.nest.flatten(got)):
        assert_close(tf.convert_to_tensor(b), tf.convert_to_tensor(a), tol=0)


@pytest.mark.requires_c_paths("the tape records in C")
def test_per_example_grads_record_in_c():
    _, _, python, ran_fast, _, _, _ = _per_example_grads()
    # Only copy ops (their own rules) take the Python path: no forward op of the tape.
    assert python.get("GradientTape", 0) == 0, python
    assert ran_fast >= 14


def test_other_batch_sizes_reuse_decisions():
    variables = _weights()
    extra = tf.constant(0.5)
    for n in (5, 3):  # a full batch, then a partial last one
        data = _data(n)
        want = tf.vectorized_map(_per_example(tf.GradientTape, variables, extra), data)
        got = oh.vectorized_map(_per_example(oh.GradientTape, variables, extra), data)
        assert_same_tensors(want, got)


def test_keras_model_per_example_grads_and_a_fresh_function():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)])
    x = tf.random.stateless_normal([5, 4], seed=[5, 6])  # a partial batch (5)
    model(x)

    def per_example(tape_cls):
        def fn(e):
            with tape_cls() as tape:
                loss = tf.reduce_mean(tf.square(model(e[None])))
            return tape.gradient(loss, model.trainable_variables)
        return fn

    want = tf.vectorized_map(per_example(tf.GradientTape), x)
    assert_same_tensors(want, oh.vectorized_map(per_example(oh.GradientTape), x))
    assert_same_tensors(want, oh.vectorized_map(per_example(PythonPathTape), x))
    # A fresh tf.function as the mapped function: replayed through the map.
    replayed = oh.vectorized_map(tf.function(per_example(oh.GradientTape)), x)
    assert_same_tensors(want, replayed)


def test_second_order_through_the_map():
    x = tf.random.stateless_normal([4, 3], seed=[3, 3])
    c = tf.constant([0.5, -1.0, 2.0])

    def fn(tape_cls):
        def per(e):
            with tape_cls() as outer:
                outer.watch(e)
                with tape_cls() as inner:
                    inner.watch(e)
                    y = tf.reduce_sum(tf.sin(e * c) * tf.exp(e))
                g = inner.gradient(y, e)
            return outer.gradient(tf.reduce_sum(g * g), e)
        return per

    want = tf.vectorized_map(fn(tf.GradientTape), x)
    assert_same_tensors(want, oh.vectorized_map(fn(oh.GradientTape), x))


class RefusingTape(oh.GradientTape):
    """A tape whose copy_on refuses float64 tensors from elsewhere."""

    def copy_on(self, tensor):
        if tensor.dtype == tf.float64:
            raise ValueError("RefusingTape refuses a float64 input")
        return super().copy_on(tensor)


def test_a_copy_on_error_reaches_the_user_unchanged():
    x = tf.random.stateless_normal([4, 3], seed=[3, 4])
    d = tf.constant(2.0, tf.float64)

    def fn(e):
        with RefusingTape() as t:
            t.watch(e)
            y = tf.cast(e, tf.float64) * d
        return y

    with pytest.raises(ValueError, match=r"^RefusingTape refuses a float64 input$"):
        oh.vectorized_map(fn, x)

    def ok(e):
        with RefusingTape() as t:
            t.watch(e)
            y = tf.reduce_sum(tf.sin(e) * 2.0)
        return t.gradient(y, e)

    assert_close(oh.vectorized_map(ok, x), 2.0 * np.cos(x.numpy()))


class NotATensor(oh.OpHandler):
    """A recording handler (after_execute) whose copy_on breaks its contract."""

    transparent = True

    def after_execute(self, op, inputs, outputs):
        pass

    def copy_on(self, tensor):
        return "not a tensor"


def test_a_copy_on_that_is_not_a_tensor_is_a_clear_error():
    x = tf.random.stateless_normal([4, 3], seed=[3, 5])

    def fn(e):
        with NotATensor():
            return tf.sin(e) * 2.0

    with pytest.raises(TypeError, match=r"copy_on hook of .*NotATensor.* returned a str for input 0 of op Sin"):
        oh.vectorized_map(fn, x)
