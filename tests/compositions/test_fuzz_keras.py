"""Differential fuzzing of Keras training under the handlers that must be transparent.

Seeded random small Keras models (Conv2D, Dense, BatchNormalization in training mode,
Dropout called with training=False, Embedding, LayerNormalization, MultiHeadAttention, in
random compositions on image, sequence or vector inputs; also Dropout in training
mode, seeded, so that the twins draw the same masks) are trained for two steps (a
batch of 4, then a partial last batch of 3) under a handler and, as the reference, with
plain TensorFlow on a twin model (same seed, same initial weights):

- `model.fit` with the handler opened around it (compiled, or `run_eagerly=True`);
- a custom loop, eager, the handler opened per step around the step or inside the tape;
- a custom loop whose step is a fresh `tf.function` with a None batch dim, the handler
  opened per step around the call;
- `oh.GradientTape` in place of `tf.GradientTape` (eager and in the traced step);
- `oh.ParallelHandler` over two logical CPUs, the batch split per replica (the reference:
  one `tf.GradientTape` per replica, gradients summed); no BatchNormalization there (its
  batch statistics are per replica).

Compared: the losses of each step, every weight after the steps (non-trainable ones such
as BatchNormalization's moving statistics included) and, in custom loops, every gradient
(dense vs tf.IndexedSlices, dtype, shape, values). Cases are interleaved in one seeded
random order in the process (ours or TensorFlow's first), so a cache filled by one case
and reused by another shows.

`make test` runs a smaller draw whose seed changes from run to run (tests/fuzz_seed.py);
the fixed draw of the default seed is marked slow. Reproduce a failure with the command it
prints, e.g.
    OH_FUZZ_SEED=<seed> pytest tests/compositions/test_fuzz_keras.py
"""
import contextlib
import os
import random

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

from fuzz_seed import replay, run_seed
from test_differential import _same  # values, dtypes, shapes, IndexedSlices, None

SEED = int(os.environ.get("OH_FUZZ_SEED", "31"))
FAST_CASES = 6  # in `make test` (the run's rotating draw): handlers from a rotating first
DEFAULT_CASES = 11  # every handler at least once, the default seed's draw (marked slow)
SLOW_CASES = 12  # each case trains two models (~10 s): bounded by make test's 20 minutes
BATCHES = (4, 3)  # two steps: a full batch, then a partial last batch

# Handlers that must not change a model's training (DataFormat on channels-last data is
# the identity).
TRANSPARENT = {
    "OpHandler": oh.OpHandler, "OpLogHandler": oh.OpLogHandler,
    "CheckNumerics": oh.CheckNumericsHandler, "Lazy": oh.Lazy, "Async": oh.Async,
    "Recompute": oh.Recompute, "DataFormat": oh.DataFormat,
}
HANDLERS = sorted(TRANSPARENT) + ["GradientTape", "ParallelHandler"]
MODES = {  # which training modes each handler is run in
    "GradientTape": ["loop", "loop_function"],
    "ParallelHandler": ["loop"],
}
ALL_MODES = ["fit", "fit_eager", "loop", "loop_function"]


# -- models ------------------------------------------------------------------------------

class _InferenceDropout(keras.layers.Dropout):
    """Dropout called with training=False (a functional model passes its own `training`
    to its layers, whatever the layer was called with when the model was built)."""

    def call(self, inputs, training=None):
        return super().call(inputs, training=False)


class Spec:
    """A random model, its loss and optimizer, drawn from `seed`."""

    def __init__(self, seed, parallel=False):
        rng = random.Random(seed)
        self.seed = seed
        self.input = rng.choice(["image", "sequence", "vector"])
        choices = {"image": ["conv", "conv", "bn", "ln", "dropout_off", "dropout", "dense"],
                   "sequence": ["mha", "mha", "ln", "dense", "dropout_off", "dropout", "bn"],
                   "vector": ["dense", "dense", "bn", "ln", "dropout_off", "dropout"]}[
                       self.input]
        if parallel:
            # Batch statistics are per replica there, and a training Dropout's seed
            # generator (a variable created outside the handler) would be written once per
            # replica: oh.ParallelHandler refuses that with a PlacementError (documented).
            choices = [c for c in choices if c not in ("bn", "dropout")]
        self.layers = [rng.choice(choices) for _ in range(rng.randint(1, 3))]
        self.loss = rng.choice(["mse", "sparse_ce"])
        self.optimizer = rng.choice(["sgd", "adam"])

    def build(self):
        keras.utils.set_random_seed(self.seed)
        if self.input == "image":
            inp = keras.Input((5, 5, 2))
        elif self.input == "sequence":
            inp = keras.Input((5,), dtype="int32")
        else:
            inp = keras.Input((6,))
        h = keras.layers.Embedding(11, 4)(inp) if self.input == "sequence" else inp
        for name in self.layers:
            if name == "conv":
                h = keras.layers.Conv2D(3, 3, padding="same", activation="relu")(h)
            elif name == "dense":
                h = keras.layers.Dense(4, activation="tanh")(h)
            elif name == "bn":
                h = keras.layers.BatchNormalization()(h)
            elif name == "ln":
                h = keras.layers.LayerNormalization()(h)
            elif name == "dropout_off":
                h = _InferenceDropout(0.5)(h)
            elif name == "dropout":  # seeded: the twins draw the same masks
                h = keras.layers.Dropout(0.3)(h)
            elif name == "mha":
                h = h + keras.layers.MultiHeadAttention(num_heads=2, key_dim=2)(h, h)
        if self.input == "image":
            h = keras.layers.Flatten()(h)
        elif self.input == "sequence":
            h = keras.layers.GlobalAveragePooling1D()(h)
        model = keras.Model(inp, keras.layers.Dense(3)(h))
        # Adam's epsilon large enough that a gradient which is zero up to rounding (the
        # first of two BatchNormalizations' beta) is not normalized into a full step.
        optimizer = (keras.optimizers.SGD(0.1) if self.optimizer == "sgd"
                     else keras.optimizers.Adam(0.02, epsilon=1e-3))
        return model, optimizer

    def loss_fn(self, reduction="sum_over_batch_size"):
        if self.loss == "mse":
            return keras.losses.MeanSquaredError(reduction=reduction)
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                          reduction=reduction)

    def data(self, n):
        r = np.random.default_rng(self.seed)
        if self.input == "image":
            x = r.standard_normal((n, 5, 5, 2)).astype(np.float32)
        elif self.input == "sequence":
            x = r.integers(0, 11, (n, 5)).astype(np.int32)
        else:
            x = r.standard_normal((n, 6)).astype(np.float32)
        y = (r.standard_normal((n, 3)).astype(np.float32) if self.loss == "mse"
             else r.integers(0, 3, (n,)).astype(np.int32))
        return x, y

    def describe(self):
        return "model seed %d: %s input -> %s -> Dense(3); loss %s, optimizer %s" % (
            self.seed, self.input, " -> ".join(self.layers), self.loss, self.optimizer)


def _batches(spec):
    x, y = spec.data(sum(BATCHES))
    out, start = [], 0
    for b in BATCHES:
        out.append((tf.constant(x[start:start + b]), tf.constant(y[start:start + b])))
        start += b
    return x, y, out


def _weights(model):
    return [tf.identity(w) for w in model.weights]


# -- the training modes: run(spec, factory, tape, nesting) -> results -------------------
# `factory`: a handler factory, or None for the reference.

def _scope(factory):
    return factory() if factory is not None else contextlib.nullcontext()


def run_fit(spec, factory, run_eagerly=False, **_):
    model, optimizer = spec.build()
    model.compile(optimizer, spec.loss_fn(), run_eagerly=run_eagerly)
    x, y, _ = _batches(spec)
    with _scope(factory):
        history = model.fit(x, y, batch_size=BATCHES[0], epochs=2, shuffle=False, verbose=0)
    return [history.history["loss"], _weights(model)]


def _step(model, optimizer, loss_fn, tape_type, factory, nesting):
    def step(x, y):
        if nesting == "inside":
            with tape_type() as tape:
                with _scope(factory):
                    loss = loss_fn(y, model(x, training=True))
        else:
            with tape_type() as tape:
                loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss, grads
    return step


def _plain(grads):
    """Gradients as ordinary tensors (a handler's tensor is read through its value)."""
    out = []
    for g in grads:
        if isinstance(g, tf.IndexedSlices):
            g = tf.IndexedSlices(tf.identity(g.values), tf.identity(g.indices), g.dense_shape)
        elif g is not None:
            g = tf.identity(g)
        out.append(g)
    return out


def run_loop(spec, factory, tape_type=tf.GradientTape, nesting="outside", function=False):
    model, optimizer = spec.build()
    loss_fn = spec.loss_fn()
    step = _step(model, optimizer, loss_fn, tape_type,
                 factory if nesting == "inside" else None, nesting)
    if function:
        x_spec = tf.TensorSpec((None,) + model.input.shape[1:], model.input.dtype)
        y_spec = tf.TensorSpec((None, 3), tf.float32) if spec.loss == "mse" else (
            tf.TensorSpec((None,), tf.int32))
        step = tf.function(step, input_signature=[x_spec, y_spec])
    _, _, batches = _batches(spec)
    losses, grads = [], []
    for x, y in batches:
        with _scope(factory if nesting == "outside" else None):  # a fresh handler per step
            loss, g = step(x, y)
            losses.append(tf.identity(loss))
            grads.append(_plain(g))
    return [losses, grads, _weights(model)]


def run_parallel(spec, ours, **_):
    """Data parallelism over two replicas: a per-replica batch (the partial last batch
    splits 1 + 2), the loss summed over examples and divided by the global batch."""
    model, optimizer = spec.build()
    loss_fn = spec.loss_fn(reduction="sum")
    _, _, batches = _batches(spec)
    losses, all_grads = [], []
    for x, y in batches:
        half = x.shape[0] // 2
        parts = [(x[:half], y[:half]), (x[half:], y[half:])]
        n = float(x.shape[0])
        if ours:
            parallel = oh.ParallelHandler(["CPU:0", "CPU:1"])  # a fresh handler per step
            with parallel:
                xb = parallel.pack([p[0] for p in parts])
                yb = parallel.pack([p[1] for p in parts])
                with oh.GradientTape() as tape:
                    loss = loss_fn(yb, model(xb, training=True)) / n
                grads = tape.gradient(loss, model.trainable_variables)
                grads = [tf.convert_to_tensor(g) for g in grads]
                grads = [tf.add_n(parallel.unpack(g)) if oh.handler_of(g) is not None else g
                         for g in grads]
            loss = tf.add_n(parallel.unpack(loss))
        else:
            loss, grads = 0.0, None
            for px, py in parts:
                with tf.GradientTape() as tape:
                    part = loss_fn(py, model(px, training=True)) / n
                g = [tf.convert_to_tensor(e) for e in
                     tape.gradient(part, model.trainable_variables)]
                grads = g if grads is None else [a + b for a, b in zip(grads, g)]
                loss += part
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(tf.identity(loss))
        all_grads.append(_plain(grads))
    return [losses, all_grads, _weights(model)]


def _runner(handler, mode, nesting):
    """(ours, reference): zero-argument-spec callables."""
    if handler == "ParallelHandler":
        return (lambda s: run_parallel(s, True)), (lambda s: run_parallel(s, False))
    function = mode == "loop_function"
    if handler == "GradientTape":
        return ((lambda s: run_loop(s, None, oh.GradientTape, function=function)),
                (lambda s: run_loop(s, None, tf.GradientTape, function=function)))
    factory = TRANSPARENT[handler]
    if mode in ("fit", "fit_eager"):
        eager = mode == "fit_eager"
        return ((lambda s: run_fit(s, factory, run_eagerly=eager)),
                (lambda s: run_fit(s, None, run_eagerly=eager)))
    # An eager oh.Recompute records its segments on an oh.GradientTape (a
    # tf.GradientTape around it keeps everything and warns): the pair uses ours.
    tape = oh.GradientTape if handler == "Recompute" and not function else tf.GradientTape
    if function:
        nesting = "outside"
    return ((lambda s: run_loop(s, factory, tape, nesting, function)),
            (lambda s: run_loop(s, None, tf.GradientTape, nesting, function)))


def _cases(count, seed, first=0):
    """`count` cases, the handlers in turn from HANDLERS[first]."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        handler = HANDLERS[(first + i) % len(HANDLERS)]
        mode = rng.choice(MODES.get(handler, ALL_MODES))
        nesting = rng.choice(["outside", "inside"])
        cases.append((handler, mode, nesting, seed * 1000 + i, rng.random() < 0.5))
    rng.shuffle(cases)
    return cases


def _run_all(cases, command):
    """Runs `cases`; a failure names `command`, which replays them."""
    failures = []
    for handler, mode, nesting, mseed, ours_first in cases:
        spec = Spec(mseed, parallel=handler == "ParallelHandler")
        ours, ref = _runner(handler, mode, nesting)
        what = "%s, %s%s, %s first" % (handler, mode, ", handler " + nesting if mode == "loop"
                                       else "", "oh" if ours_first else "tf")
        try:
            results = {}
            for is_ours in ([True, False] if ours_first else [False, True]):
                results[is_ours] = (ours if is_ours else ref)(spec)
            _same(results[False], results[True], what)
        except Exception as e:  # pylint: disable=broad-except
            failures.append("%s:\n%s\n%s: %s" % (
                what, spec.describe(), type(e).__name__, str(e)[:1500]))
    assert not failures, "%d of %d cases differ from TensorFlow (replay: %s):\n\n%s" % (
        len(failures), len(cases), command, "\n\n".join(failures[:8]))


_QUIET = pytest.mark.filterwarnings("ignore:oh.Recompute:RuntimeWarning")


@_QUIET
def test_random_keras_training_matches_tensorflow(request):
    # Each run starts the handlers' turn elsewhere: a few runs cover them all.
    seed = run_seed()
    _run_all(_cases(FAST_CASES, seed, first=seed % len(HANDLERS)),
             replay(request.node.nodeid, seed))


@_QUIET
@pytest.mark.slow
def test_default_random_keras_training_matches_tensorflow(request):
    _run_all(_cases(DEFAULT_CASES, SEED), replay(request.node.nodeid, SEED))


@_QUIET
@pytest.mark.slow
def test_more_random_keras_training_matches_tensorflow(request):
    _run_all(_cases(SLOW_CASES, SEED + 1), replay(request.node.nodeid, SEED))
