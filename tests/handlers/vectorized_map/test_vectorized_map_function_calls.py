"""oh.vectorized_map over a tf.function, called again: after its first call (replayed
through the map into a cached function) a call with the same function, argument specs
and context runs that replayed function directly, without the map's handler scope
(vectorized_map.py, "call plans"). Each test checks the results against
tf.vectorized_map or a loop, on fresh data at every call, and what must make a call take
the whole path again."""
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import op_callbacks

import tf_ophandlers as oh
from tf_ophandlers.core import functions as replay
from tf_ophandlers.core import scope as scope_module
from tf_ophandlers.handlers.vectorized_map import handler as vm
from conftest import assert_close

RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _fresh_rng():
    global RNG  # pylint: disable=global-statement
    RNG = np.random.default_rng(0)


def _rand(*shape):
    return tf.constant(RNG.standard_normal(shape).astype(np.float32))


@pytest.fixture
def scopes(monkeypatch):
    """Counts the handler scopes opened (each full oh.vectorized_map call opens one)."""
    opened = []
    original = scope_module._open  # pylint: disable=protected-access

    def counting(target):
        opened.append(target)
        return original(target)

    monkeypatch.setattr(scope_module, "_open", counting)
    return opened


def _mlp():
    W1 = tf.Variable(_rand(5, 8))
    b1 = tf.Variable(_rand(8))
    W2 = tf.Variable(_rand(8, 3))
    return W1, b1, W2


def _per_example_grads(variables, tape_type):
    W1, b1, W2 = variables

    def pe(ey):
        e, y = ey
        with tape_type() as t:
            h = tf.nn.relu(tf.matmul(e[None], W1) + b1)
            logits = tf.matmul(h, W2)
            loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(y[None],
                                                                                logits))
        return t.gradient(loss, [W1, b1, W2])
    return pe


def test_later_calls_run_the_replayed_function_without_the_map_scope(scopes):
    variables = _mlp()
    pe_fn = tf.function(_per_example_grads(variables, oh.GradientTape))
    want_fn = _per_example_grads(variables, tf.GradientTape)
    for call in range(4):
        x = _rand(6, 5)
        y = tf.constant(RNG.integers(0, 3, 6).astype(np.int32))
        del scopes[:]
        got = oh.vectorized_map(pe_fn, (x, y))
        # the first call replays through the map's scope, the later ones run its result
        assert len(scopes) == (1 if call == 0 else 0)
        for g, w in zip(got, tf.vectorized_map(want_fn, (x, y))):
            assert_close(g, w)
    assert pe_fn.experimental_get_tracing_count() == 1


def test_later_calls_see_variable_updates_and_new_data():
    W = tf.Variable(_rand(3, 2))
    f = tf.function(lambda r: tf.tanh(tf.matmul(r[None], W))[0])
    for step in range(3):
        x = _rand(4, 3)
        assert_close(oh.vectorized_map(f, x), tf.tanh(tf.matmul(x, W)))
        W.assign_add(tf.ones_like(W))


def test_results_keep_their_structure_none_and_unbatched_outputs(scopes):
    W = tf.Variable(_rand(3, 2))

    @tf.function
    def f(r):
        r, = r
        return {"per_example": tf.reduce_sum(r[None] @ W), "none": None,
                "pair": (r * 2., tf.constant([1., 2.]))}

    for call in range(3):
        x = _rand(4, 3)
        del scopes[:]
        got = oh.vectorized_map(f, [x])  # (elems a list: fn gets a list)
        assert len(scopes) == (1 if call == 0 else 0)
        assert sorted(got) == ["none", "pair", "per_example"] and got["none"] is None
        assert_close(got["per_example"], tf.reduce_sum(x @ W, axis=1))
        assert_close(got["pair"][0], x * 2.)
        assert_close(got["pair"][1], tf.tile([[1., 2.]], [4, 1]))  # broadcast per example


def test_other_specs_a_retrace_and_a_cleared_replay_cache_take_the_whole_path(scopes):
    f = tf.function(lambda r: tf.reduce_sum(tf.sin(r) * r))
    a, b = _rand(4, 3), _rand(4, 5)
    oh.vectorized_map(f, a)
    del scopes[:]
    assert_close(oh.vectorized_map(f, b), tf.reduce_sum(tf.sin(b) * b, axis=1))
    assert len(scopes) == 1  # new argument specs: replayed (f traced again)
    del scopes[:]
    assert_close(oh.vectorized_map(f, a), tf.reduce_sum(tf.sin(a) * a, axis=1))
    assert len(scopes) == 1  # f traced since a's plan: its dispatch is checked again
    del scopes[:]
    oh.vectorized_map(f, a)
    assert not scopes
    replay.clear_cache()
    del scopes[:]
    assert_close(oh.vectorized_map(f, a), tf.reduce_sum(tf.sin(a) * a, axis=1))
    assert len(scopes) == 1  # its replay left the cache: replayed again


def test_functions_run_eagerly_run_their_python_body_at_every_call():
    ran = []

    @tf.function
    def f(r):
        ran.append(1)
        return r * 3.

    x = _rand(4, 2)
    oh.vectorized_map(f, x)
    oh.vectorized_map(f, x)
    tf.config.run_functions_eagerly(True)
    try:
        del ran[:]
        for _ in range(2):
            assert_close(oh.vectorized_map(f, x), x * 3.)
        assert len(ran) == 2
    finally:
        tf.config.run_functions_eagerly(False)


def test_op_callbacks_see_the_call_at_every_call():
    f = tf.function(lambda r: tf.exp(r))
    x = _rand(4, 2)
    oh.vectorized_map(f, x)
    oh.vectorized_map(f, x)
    seen = []

    def callback(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        seen.append(op_type)

    op_callbacks.add_op_callback(callback)
    try:
        for _ in range(2):
            assert_close(oh.vectorized_map(f, x), tf.exp(x))
    finally:
        op_callbacks.remove_op_callback(callback)
    assert sum(t.startswith("__inference") for t in seen) >= 2


def test_a_tape_outside_the_map_gets_its_gradient_after_plans_exist():
    W = tf.Variable(_rand(3, 2))
    f = tf.function(lambda r: tf.reduce_sum(tf.matmul(r[None], W) ** 2))
    x = _rand(4, 3)
    oh.vectorized_map(f, x)
    oh.vectorized_map(f, x)
    with oh.GradientTape() as tape:
        loss = tf.reduce_sum(oh.vectorized_map(f, x))
    with tf.GradientTape() as tf_tape:
        want = tf.reduce_sum(tf.matmul(x, W) ** 2)
    assert_close(loss, want)
    assert_close(tape.gradient(loss, W), tf_tape.gradient(want, W))


def test_functions_the_map_runs_as_one_op_stay_correct_when_called_again(caplog):
    # (TensorLists: the function runs once per example as one op, no replayed call)
    f = tf.function(lambda r: tf.map_fn(lambda e: tf.sin(e) * e, r))
    for _ in range(3):
        x = _rand(4, 3)
        assert_close(oh.vectorized_map(f, x), tf.sin(x) * x)


def test_plans_are_listed_and_bounded():
    entries, maxsize = oh.caches()["vectorized_map.function_calls"]
    assert 0 <= entries <= maxsize


def test_captures_taken_at_call_time_are_read_at_every_call(scopes):
    from tensorflow.python.framework import ops  # pylint: disable=import-outside-toplevel
    scale = [tf.constant([1., 2.])]

    @tf.function
    def f(r):
        s = ops.get_default_graph().capture_call_time_value(
            lambda: scale[0], tf.TensorSpec([2], tf.float32))
        return r * s

    x = _rand(3, 2)
    for k in range(3):
        scale[0] = tf.constant([1., 2.]) * (k + 1)
        del scopes[:]
        assert_close(oh.vectorized_map(f, x), x * scale[0])
        assert len(scopes) == (1 if k == 0 else 0)


def test_a_dropped_function_releases_its_replay():
    """A plan keeps neither the function, its concrete function nor the replayed
    function: dropping `fn` removes its replay (and that function from TensorFlow's
    context) as without plans."""
    import gc  # pylint: disable=import-outside-toplevel
    import weakref  # pylint: disable=import-outside-toplevel
    from tf_ophandlers.core.functions import call as call_module  # pylint: disable=import-outside-toplevel
    W = tf.Variable(_rand(3, 2))
    f = tf.function(lambda r: tf.reduce_sum(tf.matmul(r[None], W)))
    x = _rand(4, 3)
    seen_before = {id(e) for e in call_module._cache.values()}  # pylint: disable=protected-access
    oh.vectorized_map(f, x)
    oh.vectorized_map(f, x)
    new = [e for e in call_module._cache.values() if id(e) not in seen_before]  # pylint: disable=protected-access
    assert len(new) == 1
    replayed = weakref.ref(new[0].compiled)
    function = weakref.ref(f)
    del new, f
    gc.collect()
    assert function() is None
    assert replayed() is None
