"""Targeted differential fuzz of autodiff nestings: layers {oh.ForwardAccumulator,
oh.GradientTape, tf.GradientTape, oh.vectorized_map, oh.Recompute} nested two and three
deep around a workload {eager ops, a called tf.function, a Keras model, a Hessian-vector
product (an accumulator over a tape)}, compared with the same nesting of TensorFlow's
counterparts (tf.autodiff.ForwardAccumulator, tf.GradientTape, tf.vectorized_map, no
handler) on values, dtypes, shapes, dense vs tf.IndexedSlices and None patterns.

Written to chase a reported crash (`oh.ForwardAccumulator` around `oh.GradientTape`
around a called `tf.function`: `InternalError.__init__() missing ... 'op'`, see
tests/core/test_error_reraise.py); that nesting always runs, and gives TensorFlow's
values. A nesting TensorFlow's own counterparts fail on is skipped (counted): e.g.
tf.autodiff.ForwardAccumulator around tf.GradientTape around a called tf.function raises
TypeError ('NoneType' object cannot be interpreted as an integer) inside TensorFlow, and
around an HVP of a variable ValueError (a variable without handle data).
`make test` runs a smaller draw whose seed changes from run to run (tests/fuzz_seed.py);
the fixed draw of the default seed is marked slow. A failure prints the command that
replays it (`OH_FUZZ_SEED`).
"""
import itertools
import os
import random

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

from fuzz_seed import replay, run_seed
from test_differential import _same  # values, dtypes, shapes, IndexedSlices, None

SEED = int(os.environ.get("OH_FUZZ_SEED", "7"))
LAYERS = ("ForwardAccumulator", "GradientTape", "tf.GradientTape", "vectorized_map",
          "Recompute")
WORKLOADS = ("eager", "function", "keras", "hvp")
_TANGENT_SEED = 5


class Case:
    """Inputs x [B, 3], a variable W [3, 2] and a table V [5, 3] gathered by ids [B]."""

    def __init__(self, workload, seed, batch=3):
        r = np.random.default_rng(seed)
        self.workload = workload
        self.x = tf.constant(r.standard_normal((batch, 3)).astype(np.float32))
        self.ids = tf.constant(r.integers(0, 5, batch).astype(np.int32))
        self.w = tf.Variable(r.standard_normal((3, 2)).astype(np.float32) * 0.5, name="W")
        self.v = tf.Variable(r.standard_normal((5, 3)).astype(np.float32) * 0.5, name="V")
        if workload == "keras":
            keras.utils.set_random_seed(seed % 1000)
            self.model = keras.Sequential([keras.layers.Input((3,)),
                                           keras.layers.Dense(2, activation="tanh")])
        self.fn = tf.function(self._body, autograph=False)

    def _body(self, x, ids):
        h = x * tf.gather(self.v, ids)
        if self.workload == "keras":
            return tf.reduce_sum(self.model(h) ** 2, -1)
        return tf.reduce_sum(tf.tanh(h @ self.w) ** 2, -1)

    def variables(self):
        extra = list(self.model.trainable_variables) if self.workload == "keras" else []
        return [self.w, self.v] + extra

    def compute(self, x, ids, ours):
        if self.workload == "function":
            return [self.fn(x, ids)]
        if self.workload == "hvp":  # forward over reverse: H(loss, W) @ tangent
            Acc = oh.ForwardAccumulator if ours else tf.autodiff.ForwardAccumulator
            Tape = oh.GradientTape if ours else tf.GradientTape
            with Acc(self.w, tf.ones_like(self.w)) as acc:
                with Tape() as t:
                    loss = tf.reduce_sum(self._body(x, ids))
                g = t.gradient(loss, self.w)
            return [loss, g, acc.jvp(g)]
        return [self._body(x, ids)]


def _dense(outs):
    """A map's outputs must be tensors: None -> 0, IndexedSlices -> dense (both sides)."""
    return [tf.zeros([]) if o is None else tf.convert_to_tensor(o) for o in outs]


def _layer(name, inner, case, ours):
    """`inner(x, ids) -> list` wrapped in layer `name` (ours or TensorFlow's)."""
    def run(x, ids):
        if name in ("GradientTape", "tf.GradientTape"):
            Tape = oh.GradientTape if ours and name == "GradientTape" else tf.GradientTape
            with Tape(persistent=True) as t:
                t.watch(x)
                outs = inner(x, ids)
            grads = t.gradient(outs[0], [x] + case.variables())
            if getattr(case, "dense_gradients", False):  # as a called function's
                grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                         for g in grads]
            return outs + list(grads)
        if name == "ForwardAccumulator":
            Acc = oh.ForwardAccumulator if ours else tf.autodiff.ForwardAccumulator
            primals = [x, case.w]
            r = np.random.default_rng(_TANGENT_SEED)
            tangents = [tf.constant(r.standard_normal(p.shape).astype(np.float32))
                        for p in primals]
            with Acc(primals, tangents) as acc:
                outs = inner(x, ids)
                # A gather's gradient (tf.IndexedSlices): the JVP of its values.
                outs = [o.values if isinstance(o, tf.IndexedSlices) else o for o in outs]
            jvps = [acc.jvp(o) for o in outs]
            if getattr(case, "dense_gradients", False):  # (a dense primal's tangent)
                jvps = [tf.convert_to_tensor(j) if isinstance(j, tf.IndexedSlices) else j
                        for j in jvps]
            return outs + jvps
        if name == "Recompute":
            if not ours:
                return inner(x, ids)
            with oh.Recompute():
                return inner(x, ids)
        if name == "vectorized_map":  # per example (a batch of one)
            vmap = oh.vectorized_map if ours else tf.vectorized_map
            return vmap(lambda e: _dense(inner(e[0][None], e[1][None])), (x, ids))
        raise AssertionError(name)
    return run


def _run(nesting, case, ours):
    fn = lambda x, ids: case.compute(x, ids, ours)  # noqa: E731
    for name in reversed(nesting):  # nesting[0] is outermost
        fn = _layer(name, fn, case, ours)
    return fn(case.x, case.ids)


def _nestings():
    pairs = [(a, b) for a, b in itertools.product(LAYERS, LAYERS)
             if not (a == b == "vectorized_map")]
    triples = [t for t in itertools.product(LAYERS, repeat=3)
               if t.count("vectorized_map") <= 1]
    return pairs, triples


def _cases(count, seed, depth3=0.4):
    rng = random.Random(seed)
    pairs, triples = _nestings()
    cases = []
    while len(cases) < count:
        nesting = rng.choice(triples) if rng.random() < depth3 else rng.choice(pairs)
        if _known_limitation(nesting):
            continue
        workload = rng.choice(WORKLOADS)
        if _too_slow_in_tensorflow(nesting, workload):
            continue
        cases.append((nesting, workload))
    return cases


def _too_slow_in_tensorflow(nesting, workload):
    """A tape around two forward accumulators around a called tf.function: TensorFlow's
    own nesting (the reference) ran for minutes and gigabytes without finishing (it
    builds the call's forward and backward functions for each level, recursively:
    concrete_function forward -> record -> backward function -> forward ...), beyond
    this test's time. Was the first case of the default slow draw (OH_FUZZ_SEED=7)."""
    return workload == "function" and nesting[0] in ("GradientTape", "tf.GradientTape") \
        and nesting[1:] == ("ForwardAccumulator", "ForwardAccumulator")


def _known_limitation(nesting):
    """Nestings left out of the random draw: none now. Fixed, with regression tests
    below, and back in the draw: oh.Recompute right inside oh.ForwardAccumulator
    (HandlerError when the accumulator traced a JVP function inside the eager scope), a
    tf.GradientTape inside oh.Recompute around a called tf.function (InvalidArgumentError:
    its backward read the rewrite's empty stand-ins) and oh.Recompute > tf.GradientTape >
    oh.vectorized_map around an HVP (HandlerError: Recompute windows on the tapes of the
    function vectorized_map traces)."""
    del nesting
    return False


def _check(cases, seed, command):
    """Returns how many cases TensorFlow's own nesting could not run (skipped); a failure
    names `command`, which replays them."""
    failures, skipped = [], 0
    for k, (nesting, workload) in enumerate(cases):
        what = "%s around %s" % (" > ".join(nesting), workload)
        try:
            ref = _run(nesting, Case(workload, seed * 100 + k), False)
        except Exception:  # pylint: disable=broad-except
            skipped += 1  # TensorFlow itself fails on this nesting
            continue
        try:
            got = _run(nesting, Case(workload, seed * 100 + k), True)
            _same(ref, got, what)
        except Exception as e:  # pylint: disable=broad-except
            failures.append("%s: %s: %s" % (what, type(e).__name__, str(e)[:600]))
    assert not failures, "%d of %d nestings differ from TensorFlow (replay: %s):\n%s" % (
        len(failures), len(cases), command, "\n".join(failures[:10]))
    assert skipped < len(cases), "TensorFlow ran none of the nestings"
    return skipped


_QUIET = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@_QUIET
def test_random_autodiff_nestings_match_tensorflow(request):
    # Pairs (triples: the slow variant), drawn from the run's seed: ~5 s a nesting.
    seed = run_seed()
    _check(_cases(4, seed, depth3=0.0), seed, replay(request.node.nodeid, seed))


@_QUIET
@pytest.mark.slow
def test_default_autodiff_nestings_match_tensorflow(request):
    _check(_cases(8, SEED, depth3=0.0), SEED, replay(request.node.nodeid, SEED))


@_QUIET
@pytest.mark.parametrize("inner", [(), ("Recompute",)])
def test_reported_nesting_around_a_called_function_matches_tensorflow_eagerly(inner):
    # The reported crash: oh.ForwardAccumulator > oh.GradientTape (> oh.Recompute) > a
    # called tf.function. TensorFlow's own nesting raises around the call (TypeError
    # inside TensorFlow), so ours is compared with TensorFlow's nesting run eagerly.
    # Gradients of the call are dense, as TensorFlow's for a call its tangents reach
    # (tests/compositions/test_autodiff_function_calls.py): the eager reference's too.
    nesting = ("ForwardAccumulator", "GradientTape") + inner
    got = _run(nesting, Case("function", SEED), True)
    eager = Case("eager", SEED)
    eager.dense_gradients = True
    ref = _run(nesting, eager, False)
    _same(ref, got, "oh nesting around a called tf.function, tf nesting eagerly")


@_QUIET
@pytest.mark.slow
def test_more_autodiff_nestings_match_tensorflow(request):
    _check(_cases(16, SEED + 1), SEED + 1, replay(request.node.nodeid, SEED))


@_QUIET
@pytest.mark.parametrize("tape", ["GradientTape", "tf.GradientTape"])
def test_tape_around_accumulator_around_a_called_function_gives_dense_gradients(tape):
    # Fuzz finding (OH_FUZZ_SEED=7, slow test): TensorFlow densifies the tf.IndexedSlices
    # gradients of a tf.function call whose arguments carry forward-mode tangents (V's
    # gather here), so a tape around an accumulator around the call gets a dense
    # gradient for V; ours gave tf.IndexedSlices (the replay passes tangents as tensors).
    nesting = (tape, "ForwardAccumulator")
    ref = _run(nesting, Case("function", 830), False)
    got = _run(nesting, Case("function", 830), True)
    assert not isinstance(ref[4], tf.IndexedSlices)  # TensorFlow's quirk this checks
    _same(ref, got, " > ".join(nesting) + " around a called tf.function")


@_QUIET
def test_vectorized_map_around_recompute_around_hvp_matches_tensorflow():
    # Fuzz finding (OH_FUZZ_SEED=7, slow test): oh.vectorized_map > oh.Recompute > an HVP
    # (oh.ForwardAccumulator over oh.GradientTape). The accumulator's JVP function,
    # traced inside the eager Recompute scope, got a Recompute window around its own
    # tapes (HandlerError at their tape.gradient); then the tape's CopyOnGrad of W ran
    # through Recompute's copy hooks and copied a per-example gradient off the map
    # (CopyOffError) instead of running per example as without Recompute.
    nesting = ("vectorized_map", "Recompute")
    ref = _run(nesting, Case("hvp", 815), False)
    got = _run(nesting, Case("hvp", 815), True)
    _same(ref, got, "vectorized_map > Recompute around an HVP")


@_QUIET
@pytest.mark.parametrize("tape", ["GradientTape", "tf.GradientTape"])
def test_tape_inside_recompute_around_a_called_function_matches_tensorflow(tape):
    # Fuzz finding (OH_FUZZ_SEED=7, slow test): a tape opened inside oh.Recompute around
    # a called tf.function. Recompute ran the call's forward function as its rewrite
    # (extra outputs: empty stand-ins), but that tape records the original call, whose
    # backward function read the stand-ins (InvalidArgumentError, incompatible shapes
    # [3,2] vs [0,0]). tf.GradientTape: TensorFlow stops its tapes for the call, so the
    # tape set looked empty; oh.GradientTape: above the handler, it is not told.
    nesting = ("Recompute", tape)
    ref = _run(nesting, Case("function", 857), False)
    got = _run(nesting, Case("function", 857), True)
    _same(ref, got, " > ".join(nesting) + " around a called tf.function")


@_QUIET
def test_recompute_inside_accumulator_traces_jvp_functions_without_a_window():
    # Fuzz finding (OH_FUZZ_SEED=7; was a known limitation, "depending on what ran
    # before"): oh.ForwardAccumulator > oh.Recompute. The accumulator traces a JVP
    # function the first time it meets an op signature; traced inside the eager
    # Recompute scope, the function's own tapes got a Recompute window and their
    # tape.gradient raised HandlerError. Empty JVP function cache: it traces here.
    from tf_ophandlers.handlers.forward_accumulator import (  # pylint: disable=import-outside-toplevel
        handler as fa)
    fa._jvp_function_cache.clear()  # pylint: disable=protected-access
    nesting = ("tf.GradientTape", "ForwardAccumulator", "Recompute")
    ref = _run(nesting, Case("eager", 871), False)
    got = _run(nesting, Case("eager", 871), True)
    _same(ref, got, " > ".join(nesting) + " around eager ops")


@_QUIET
def test_recompute_tape_vectorized_map_hvp_matches_tensorflow():
    # Fuzz finding (OH_FUZZ_SEED=7, when the draw included oh.Recompute >
    # tf.GradientTape; was a known limitation): vectorized_map traces the mapped function
    # (pfor's) inside the eager Recompute scope; the HVP's tapes opened while tracing got
    # Recompute windows (the Keras fit rule) and its tape.gradient ran inside one
    # (HandlerError). Now a function oh.vectorized_map traces for its own use gets no
    # window, and a gradient inside a step's window makes the window's records first.
    nesting = ("Recompute", "tf.GradientTape", "vectorized_map")
    ref = _run(nesting, Case("hvp", 831), False)
    got = _run(nesting, Case("hvp", 831), True)
    _same(ref, got, " > ".join(nesting) + " around an HVP")
