"""`model.fit` in an oh.ParallelHandler scope trains data-parallel: each batch split over
the components as tf.distribute.MirroredStrategy splits it, with MirroredStrategy's
losses, metrics and weights on the same two logical CPUs (conftest.py), in the same
process, partial last batches included (10 examples in batches of 4: a last batch of 2,
1 + 1; 11: 3, split 2 + 1; 9: 1, split 1 + 0)."""
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from parallel_mirrored import mirrored_strategy

DEVICES = ["CPU:0", "CPU:1"]


def _dense():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def _conv():
    return keras.Sequential([keras.Input((6, 6, 2)), keras.layers.Conv2D(3, 3, activation="relu"),
                             keras.layers.Flatten(), keras.layers.Dense(1)])


def _data(n, model):
    rng = np.random.RandomState(0)
    shape = (n,) + tuple(model.input_shape[1:])
    x = rng.randn(*shape).astype(np.float32)
    return x, (x.reshape(n, -1).sum(1, keepdims=True) * 0.5).astype(np.float32)


def _train(make, n, run_eagerly, scope):
    keras.utils.set_random_seed(0)
    with scope:
        model = make()
        model.compile(keras.optimizers.Adam(0.05), "mse", metrics=["mae"],
                      run_eagerly=run_eagerly)
        x, y = _data(n, model)
        history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False).history
        weights = model.get_weights()  # equal components: copied off
    return history, weights, model


@pytest.fixture(scope="module")
def strategy():
    return mirrored_strategy()  # one per process (collective keys)


@pytest.mark.parametrize("make,n,run_eagerly", [
    (_dense, 11, False), (_dense, 9, False), (_conv, 11, False), (_dense, 10, True),
    (_conv, 10, True)])
def test_fit_matches_mirrored_strategy(strategy, make, n, run_eagerly):
    want, want_w, _ = _train(make, n, run_eagerly, strategy.scope())
    parallel = oh.ParallelHandler(DEVICES)
    got, got_w, model = _train(make, n, run_eagerly, parallel)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(got[key], want[key], rtol=2e-6, err_msg=key)
    for g, w in zip(got_w, want_w):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    for v in model.weights:  # one buffer per device, equal after each all-reduced step
        parts = parallel.unpack(tf.convert_to_tensor(v))
        assert parts[0].device != parts[1].device
        np.testing.assert_array_equal(parts[0].numpy(), parts[1].numpy())


def test_compiled_step_runs_as_one_call_without_component_threads(strategy, monkeypatch):
    """The compiled step of every component, its collectives included, runs as one
    multi-device function call, as MirroredStrategy runs its replicas: no component is
    handed to a thread of its own, and losses and weights stay MirroredStrategy's."""
    from tf_ophandlers.handlers.parallel import collectives

    def no_thread(fn, arg, done):
        raise AssertionError("component %r handed to a worker thread" % (arg,))

    monkeypatch.setattr(collectives, "_submit", no_thread)
    want, want_w, _ = _train(_dense, 11, False, strategy.scope())
    got, got_w, _ = _train(_dense, 11, False, oh.ParallelHandler(DEVICES))
    for key in ("loss", "mae"):
        np.testing.assert_allclose(got[key], want[key], rtol=2e-6, err_msg=key)
    for g, w in zip(got_w, want_w):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def _bounded(fn, seconds=300):
    """`fn()` on a thread of its own, failing the test if it has not returned within
    `seconds` (a hang in a collective would otherwise stop the test run)."""
    result = []

    def run():
        try:
            result.append(("ok", fn()))
        except BaseException as e:  # pylint: disable=broad-except
            result.append(("error", e))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if not result:
        pytest.fail("no result in %d s (a collective hung)" % seconds)
    kind, value = result[0]
    if kind == "error":
        raise value
    return value


@pytest.mark.parametrize("steps", [2, 3])
def test_steps_per_execution_step_runs_as_one_call_and_matches_mirrored_strategy(
        strategy, monkeypatch, steps):
    """Keras runs `steps` train steps per compiled call in a while loop, the gradient
    all-reduce in its body: still one multi-device call (no component thread), with
    MirroredStrategy's losses and weights (MirroredStrategy with one step per call: with
    more, its own fit fails in TensorFlow 2.21 / Keras 3, see the test below; the
    steps are the same). 11 examples in batches of 4: a call of 2 steps and one of 1
    (steps=2), one call of 3 (steps=3), the last batch split 2 + 1."""
    from tf_ophandlers.handlers.parallel import collectives

    def no_thread(fn, arg, done):
        raise AssertionError("component %r handed to a worker thread" % (arg,))

    def train(scope, steps):
        keras.utils.set_random_seed(0)
        with scope:
            model = _dense()
            model.compile(keras.optimizers.Adam(0.05), "mse", metrics=["mae"],
                          steps_per_execution=steps)
            x, y = _data(11, model)
            history = model.fit(x, y, batch_size=4, epochs=2, verbose=0,
                                shuffle=False).history
            return history, model.get_weights(), model

    want, want_w, _ = train(strategy.scope(), 1)
    monkeypatch.setattr(collectives, "_submit", no_thread)
    parallel = oh.ParallelHandler(DEVICES)
    got, got_w, model = _bounded(lambda: train(parallel, steps))
    for key in ("loss", "mae"):
        np.testing.assert_allclose(got[key], want[key], rtol=2e-6, err_msg=key)
    for g, w in zip(got_w, want_w):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    for v in model.weights:
        parts = parallel.unpack(tf.convert_to_tensor(v))
        np.testing.assert_array_equal(parts[0].numpy(), parts[1].numpy())


def test_uneven_split_differs_from_one_device():
    """The batch of 3 split 2 + 1 gives (mean of 2) / 2 + (1 example) / 2, not the mean
    of 3: MirroredStrategy's loss, which the test above matches, not one device's."""
    single, _, _ = _train(_dense, 11, False, oh.ParallelHandler(["CPU:0"]))
    parallel, _, _ = _train(_dense, 11, False, oh.ParallelHandler(DEVICES))
    assert abs(single["loss"][1] - parallel["loss"][1]) > 1e-3


class _BatchSizes(keras.layers.Layer):
    """Records the batch size each eager call sees (one component's, in the scope)."""

    seen = []

    def call(self, x):
        _BatchSizes.seen.append(x.shape[0])
        return x


def test_each_component_gets_its_slice_of_the_batch():
    _BatchSizes.seen = []
    make = lambda: keras.Sequential([keras.Input((4,)), _BatchSizes(), keras.layers.Dense(1)])  # noqa: E731
    _train(make, 10, True, oh.ParallelHandler(DEVICES))
    assert _BatchSizes.seen[-3:] == [2, 2, 1]  # batches 4, 4, 2 over two components


@pytest.mark.slow
def test_steps_per_execution_validation_and_evaluate_match_mirrored_strategy(strategy):
    """Two steps per compiled call (the split step in Keras's while loop), validation
    data and `evaluate` (replicated: every component on the whole batch), against
    MirroredStrategy with one step per call (with two, MirroredStrategy's own fit fails
    in TensorFlow 2.21 / Keras 3: 'You must feed a value for placeholder tensor')."""
    def run(scope, steps):
        keras.utils.set_random_seed(0)
        with scope:
            model = _dense()
            model.compile(keras.optimizers.Adam(0.05), "mse", metrics=["mae"],
                          steps_per_execution=steps)
            x, y = _data(11, model)
            history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False,
                                validation_data=(x[:5], y[:5])).history
            return history, model.evaluate(x, y, batch_size=4, verbose=0)

    want, want_eval = run(strategy.scope(), 1)
    got, got_eval = run(oh.ParallelHandler(DEVICES), 2)
    for key in ("loss", "mae", "val_loss", "val_mae"):
        np.testing.assert_allclose(got[key], want[key], rtol=2e-6, err_msg=key)
    np.testing.assert_allclose(got_eval, want_eval, rtol=2e-6)
