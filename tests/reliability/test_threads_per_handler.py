"""Every shipped handler under two threads.

For each handler: two threads each running the same program on their own inputs, with
one shared instance and with one instance each, must give what the program gives on a
single thread (values and, for the differentiating handlers, gradients) computed by plain
TensorFlow. A handler that keeps its scope's state on the instance
(`one_thread_at_a_time`: oh.Lazy, oh.Recompute, oh.TraceAndExecute) refuses a second
thread with a clear oh.HandlerError instead of mixing the threads' ops, and serves them
one after the other. A tape or accumulator shared by two threads raises TensorFlow's
ValueError, as tf.GradientTape and tf.autodiff.ForwardAccumulator do.
"""
import threading

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import run_threads

ROUNDS = 12


def _inputs(seed):
    x = tf.random.stateless_normal([4, 3], seed=[seed, 1])
    w = tf.random.stateless_normal([3, 3], seed=[seed, 2])
    return x, w


def program(x, w):
    h = tf.tanh(tf.matmul(x, w)) * tf.sin(x)
    return tf.reduce_sum(h * h, axis=1)


def plain(seed):
    return program(*_inputs(seed)).numpy()


def plain_grads(seed):
    x, w = _inputs(seed)
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        y = tf.reduce_sum(program(x, w))
    return [g.numpy() for g in tape.gradient(y, [x, w])]


def _values(h, seed):
    with h:
        y = program(*_inputs(seed))
        return np.asarray(y.numpy())


def _tape_grads(seed, make_inner=None):
    x, w = _inputs(seed)
    with oh.GradientTape() as tape:
        tape.watch([x, w])
        if make_inner is None:
            y = tf.reduce_sum(program(x, w))
        else:
            with make_inner():
                y = tf.reduce_sum(program(x, w))
    return [g.numpy() for g in tape.gradient(y, [x, w])]


def _check(results, want):
    for seed, got in results:
        np.testing.assert_allclose(got, want[seed], rtol=1e-5, atol=1e-6)


def _run_two_threads(make_for_thread, run, rounds=ROUNDS, warm_both=False):
    """Two threads, each running `run(handler, seed)` `rounds` times on its own seed with
    the handler `make_for_thread(i)` gives it; returns [(seed, result)] and errors."""
    results, errors = [], []
    lock = threading.Lock()

    def worker(i):
        h = make_for_thread(i)
        for _ in range(rounds):
            try:
                r = run(h, 10 + i)
            except Exception as e:  # pylint: disable=broad-except
                with lock:
                    errors.append(e)
                return
            with lock:
                results.append((10 + i, r))

    # One run on this thread first: a program's first run traces its functions, and
    # autograph parses their source with `ast`, whose constructor in CPython 3.11 is not
    # thread-safe (SystemError "AST constructor recursion depth mismatch", seen once in
    # 12 runs of this file). The threads then test the handlers, not CPython.
    run(make_for_thread(0), 10)
    if warm_both:  # (programs whose shapes differ per seed trace per seed)
        run(make_for_thread(1), 11)
    run_threads([lambda i=i: worker(i) for i in range(2)])
    return results, errors


@pytest.mark.parametrize("sharing", ["shared", "each"])
@pytest.mark.parametrize("name", ["OpLogHandler", "CheckNumericsHandler", "Async",
                                  "DataFormat"])
def test_values_under_two_threads(name, sharing):
    want = {s: plain(s) for s in (10, 11)}
    make = getattr(oh, name)
    one = make()
    results, errors = _run_two_threads(lambda i: one if sharing == "shared" else make(),
                                       _values)
    assert not errors, errors
    assert len(results) == 2 * ROUNDS
    _check(results, want)


def _executed_op_types(root):
    from tensorflow.python.debug.lib import debug_events_reader  # pylint: disable=import-outside-toplevel
    with debug_events_reader.DebugDataReader(root) as reader:
        reader.update()
        return sorted(e.op_type for e in reader.executions())


@pytest.mark.parametrize("sharing", ["shared", "each"])
def test_debugger_handler_under_two_threads(sharing, tmp_path):
    # Values as on one thread, and the dump holds every op of every run once (a
    # TensorFlow DebugDataReader reads it back): what one run on one thread dumps,
    # times the runs.
    single = str(tmp_path / "single")
    _values(oh.DebuggerHandler(single, circular_buffer_size=-1), 10)
    one_run = _executed_op_types(single)
    assert one_run, "nothing was dumped"
    roots = [str(tmp_path / ("thread%d" % i)) for i in range(2)]
    one = oh.DebuggerHandler(roots[0], circular_buffer_size=-1)
    handlers = {}

    def make(i):
        if sharing == "shared":
            return one
        return handlers.setdefault(i, oh.DebuggerHandler(roots[i], circular_buffer_size=-1))
    results, errors = _run_two_threads(make, _values)
    assert not errors, errors
    _check(results, {s: plain(s) for s in (10, 11)})
    runs = 2 * ROUNDS + 1  # (and _run_two_threads' first run, on this thread)
    dumped = sum((_executed_op_types(r) for r in roots[:1 if sharing == "shared" else 2]), [])
    assert sorted(dumped) == sorted(one_run * runs)


@pytest.mark.parametrize("sharing", ["shared", "each"])
def test_shape_inference_under_two_threads(sharing):
    # Values are not computed: shapes and dtypes are TensorFlow's.
    want = {s: (tuple(plain(s).shape), "float32") for s in (10, 11)}
    one = oh.ShapeInference()

    def run(h, seed):
        with h:
            y = program(*_inputs(seed))
            return (tuple(y.shape.as_list()), y.dtype.name)

    results, errors = _run_two_threads(
        lambda i: one if sharing == "shared" else oh.ShapeInference(), run)
    assert not errors, errors
    assert len(results) == 2 * ROUNDS
    assert all(got == want[seed] for seed, got in results)


@pytest.mark.parametrize("sharing", ["shared", "each"])
def test_mesh_under_two_threads(sharing):
    devices = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
    make = lambda: oh.Mesh({"batch": 2, "model": 2}, devices)  # noqa: E731
    one = make()

    def run(h, seed):
        x, w = _inputs(seed)
        with h:
            y = program(h.shard(x, ("batch", None)), w)
        return y.numpy()

    want = {s: plain(s) for s in (10, 11)}
    results, errors = _run_two_threads(lambda i: one if sharing == "shared" else make(), run)
    assert not errors, errors
    assert len(results) == 2 * ROUNDS
    _check(results, want)


# The multi-device handlers: TensorFlow itself mixes up the host-memory inputs (shapes) of
# two eager ops running at once on one logical CPU other than CPU:0
# (core/launch_lock.py). Each thread's tensors here have their own number of rows, so
# an op run with the other thread's shape fails or gives a wrong shape; the threads run
# more rounds than the other tests (about one op in a thousand was hit).
MULTI_DEVICE_ROUNDS = 150


def _rows_inputs(seed):
    """Inputs of `program` with 4 + (seed % 2) * 2 rows (threads 10 and 11 differ)."""
    rows = 4 + (seed % 2) * 2
    x = tf.random.stateless_normal([rows, 3], seed=[seed, 1])
    w = tf.random.stateless_normal([3, 3], seed=[seed, 2])
    return x, w


@pytest.mark.parametrize("sharing", ["shared", "each"])
def test_parallel_handler_under_two_threads(sharing):
    devices = ["CPU:0", "CPU:1"]
    one = oh.ParallelHandler(devices)

    def run(h, seed):
        with h:
            # Made in the scope: every op, the random ones with their shape inputs, runs
            # on both components (CPU:1 is where TensorFlow mixes inputs up).
            x = h.pack([_rows_inputs(seed)[0], _rows_inputs(seed + 2)[0]])
            y = program(x, _rows_inputs(seed)[1])
            return np.stack([c.numpy() for c in h.unpack(y)])

    want = {}
    for s in (10, 11):
        w = _rows_inputs(s)[1]
        want[s] = np.stack([program(_rows_inputs(s)[0], w).numpy(),
                            program(_rows_inputs(s + 2)[0], w).numpy()])
    results, errors = _run_two_threads(
        lambda i: one if sharing == "shared" else oh.ParallelHandler(devices), run,
        MULTI_DEVICE_ROUNDS, warm_both=True)
    assert not errors, errors
    assert len(results) == 2 * MULTI_DEVICE_ROUNDS
    for seed, got in results:
        assert got.shape == want[seed].shape
    _check(results, want)


@pytest.mark.parametrize("sharing", ["shared", "each"])
def test_mesh_under_two_threads_distinct_shapes(sharing):
    devices = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
    make = lambda: oh.Mesh({"batch": 2, "model": 2}, devices)  # noqa: E731
    one = make()

    def mesh_program(x, w):
        # Reshape and Tile take shape inputs; each runs on every mesh device.
        y = tf.reshape(x, [-1, 3]) @ w
        y = tf.tile(y, [1, 2]) + tf.ones_like(y[:, :1])
        return tf.reduce_sum(y * y, axis=1)

    def run(h, seed):
        x, w = _rows_inputs(seed)
        with h:
            y = mesh_program(h.shard(x, ("batch", None)), w)
        return y.numpy()

    want = {s: mesh_program(*_rows_inputs(s)).numpy() for s in (10, 11)}
    results, errors = _run_two_threads(lambda i: one if sharing == "shared" else make(), run,
                                       MULTI_DEVICE_ROUNDS, warm_both=True)
    assert not errors, errors
    assert len(results) == 2 * MULTI_DEVICE_ROUNDS
    for seed, got in results:
        assert got.shape == want[seed].shape
    _check(results, want)


@pytest.mark.parametrize("inner", ["none", "Recompute", "Lazy", "Async"])
def test_gradient_tape_per_thread(inner):
    # A tape is opened per computation (as tf.GradientTape): one each; the handler
    # inside it one per thread too.
    want = {s: plain_grads(s) for s in (10, 11)}
    make_inner = None if inner == "none" else getattr(oh, inner)
    results, errors = _run_two_threads(lambda i: None,
                                       lambda h, seed: _tape_grads(seed, make_inner))
    assert not errors, errors
    assert len(results) == 2 * ROUNDS
    for seed, got in results:
        for g, t in zip(got, want[seed]):
            np.testing.assert_allclose(g, t, rtol=1e-5, atol=1e-6)


def test_forward_accumulator_per_thread():
    def jvp(seed):
        x, w = _inputs(seed)
        with oh.ForwardAccumulator(x, tf.ones_like(x)) as acc:
            y = program(x, w)
        return acc.jvp(y).numpy()

    want = {}
    for s in (10, 11):
        x, w = _inputs(s)
        with tf.autodiff.ForwardAccumulator(x, tf.ones_like(x)) as acc:
            y = program(x, w)
        want[s] = acc.jvp(y).numpy()
    results, errors = _run_two_threads(lambda i: None, lambda h, seed: jvp(seed))
    assert not errors, errors
    _check(results, want)


def test_vectorized_map_per_thread():
    def run(seed):
        x, w = _inputs(seed)
        return oh.vectorized_map(lambda r: program(r[None], w)[0], x).numpy()

    want = {s: tf.vectorized_map(lambda r, s=s: program(r[None], _inputs(s)[1])[0],
                                 _inputs(s)[0]).numpy() for s in (10, 11)}
    results, errors = _run_two_threads(lambda i: None, lambda h, seed: run(seed))
    assert not errors, errors
    _check(results, want)


# ---- handlers that serve one thread at a time --------------------------------------------

@pytest.mark.parametrize("make", [tf.GradientTape, oh.GradientTape,
                                  lambda: tf.autodiff.ForwardAccumulator(tf.ones([2]), tf.ones([2])),
                                  lambda: oh.ForwardAccumulator(tf.ones([2]), tf.ones([2]))],
                         ids=["tf_tape", "oh_tape", "tf_acc", "oh_acc"])
def test_shared_tape_or_accumulator_is_refused_as_tensorflow_does(make):
    h = make()
    opened, release = threading.Event(), threading.Event()
    outcome = {}

    def first():
        with h:
            opened.set()
            release.wait(60)

    def second():
        opened.wait(60)
        try:
            with h:
                pass
            outcome["second"] = None
        except Exception as e:  # pylint: disable=broad-except
            outcome["second"] = e
        finally:
            release.set()

    run_threads([first, second])
    assert type(outcome["second"]) is ValueError
    assert "recording" in str(outcome["second"])


ONE_THREAD = ["Lazy", "Recompute", "TraceAndExecute"]


@pytest.mark.parametrize("name", ONE_THREAD)
def test_one_instance_each_matches_single_thread(name):
    make = getattr(oh, name)
    want = {s: plain(s) for s in (10, 11)}
    results, errors = _run_two_threads(lambda i: make(), _values)
    assert not errors, errors
    assert len(results) == 2 * ROUNDS
    _check(results, want)


@pytest.mark.parametrize("name", ONE_THREAD)
def test_second_thread_is_refused_clearly(name):
    h = getattr(oh, name)()
    opened, release = threading.Event(), threading.Event()
    outcome = {}

    def first():
        with h:
            y = program(*_inputs(10))
            opened.set()
            release.wait(60)
            outcome["first"] = y.numpy()

    def second():
        opened.wait(60)
        try:
            with h:
                program(*_inputs(11))
            outcome["second"] = "no error"
        except oh.HandlerError as e:
            outcome["second"] = str(e)
        finally:
            release.set()

    run_threads([first, second])
    assert "another thread" in outcome["second"] and h.debug_string() in outcome["second"]
    # The first thread's computation is untouched; the instance serves the next thread
    # once the scope is closed.
    np.testing.assert_allclose(outcome["first"], plain(10), rtol=1e-5, atol=1e-6)
    result = []
    run_threads([lambda: result.append(_values(h, 11))])
    np.testing.assert_allclose(result[0], plain(11), rtol=1e-5, atol=1e-6)


def test_shared_recompute_gradients_match_single_thread():
    # The reported case: one oh.Recompute() used by two threads at once under their own
    # tapes gave some wrong or None gradients. Now the second thread is refused; with
    # one instance each every gradient is TensorFlow's.
    want = {s: plain_grads(s) for s in (10, 11)}
    results, errors = _run_two_threads(lambda i: None,
                                       lambda h, seed: _tape_grads(seed, oh.Recompute))
    assert not errors, errors
    for seed, got in results:
        for g, t in zip(got, want[seed]):
            np.testing.assert_allclose(g, t, rtol=1e-5, atol=1e-6)
