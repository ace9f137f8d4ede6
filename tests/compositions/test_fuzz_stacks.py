"""Differential fuzz of random handler stacks: the random op programs of
test_fuzz_compositions.py run under a seeded random stack of layers, outermost first,
against the same stack of TensorFlow's counterparts.

A stack has one or two autodiff layers (oh.GradientTape, tf.GradientTape,
oh.ForwardAccumulator), at most one oh.vectorized_map (per-example programs) and one to
three transparent handlers at random depths, above or below the autodiff layers: Python
ones (OpHandler, OpLogHandler, CheckNumerics, Lazy, Async, DataFormat, Recompute with its
three policies) and the C++ ones (oh.native.PassThrough, oh.native.OpCounter). The
reference replaces each autodiff layer by TensorFlow's (tf.GradientTape,
tf.autodiff.ForwardAccumulator, tf.vectorized_map) and each handler by nothing. A tape
differentiates everything its inner layers returned (program outputs and inner
gradients: second order), an accumulator gives the JVP of each.

Modes: the program eager; in a fresh `tf.function`; in a fresh `tf.function` with None
batch dims run for two batch sizes (a partial last batch) with fresh handlers per step;
and "warm": the same stack run first on a different program (caches filled by it), then
on this one with fresh handlers. Compared: values, gradients, None pattern, dtype, shape,
dense vs tf.IndexedSlices (test_differential._same). A stack TensorFlow's own nesting
fails on is skipped (counted).

`make test` runs a smaller draw whose seed changes from run to run (tests/fuzz_seed.py);
the fixed draw of the default seed is marked slow. Reproduce a failure with the command it
prints, e.g.
    OH_FUZZ_SEED=<seed> pytest tests/compositions/test_fuzz_stacks.py
"""
import contextlib
import os
import random

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

from fuzz_seed import replay, run_seed
from test_differential import _same  # values, dtypes, shapes, IndexedSlices, None
from test_fuzz_compositions import Program, _data, _fn, _variables

SEED = int(os.environ.get("OH_FUZZ_SEED", "5"))
FAST_CASES = 4  # in `make test` (the run's rotating draw)
DEFAULT_CASES = 10  # the default seed's draw (marked slow)
SLOW_CASES = int(os.environ.get("OH_FUZZ_STACK_CASES", "40"))  # marked slow

HANDLERS = {
    "OpHandler": oh.OpHandler, "OpLogHandler": oh.OpLogHandler,
    "CheckNumerics": oh.CheckNumericsHandler, "Lazy": oh.Lazy, "Async": oh.Async,
    "DataFormat": oh.DataFormat, "Recompute": oh.Recompute,
    "Recompute(save)": lambda: oh.Recompute(save=("MatMul", "Conv2D")),
    "Recompute(budget)": lambda: oh.Recompute(memory_budget=1 << 20),
    "PassThrough": lambda: oh.native.PassThrough(),
    "OpCounter": lambda: oh.native.OpCounter(),
}
AUTODIFF = ("GradientTape", "tf.GradientTape", "ForwardAccumulator")


def _tensors(outs):
    """The dense tensors among `outs` (what a tape can differentiate)."""
    return [o for o in outs if isinstance(o, tf.Tensor)]


def _dense(outs):
    """A map's outputs must be tensors: None -> 0, IndexedSlices -> dense (both sides)."""
    return [tf.zeros([]) if o is None else tf.convert_to_tensor(o) for o in outs]


def _layer(name, inner, variables, ours, seed, map_loop=False):
    """`inner(args) -> list` in layer `name`: ours, or TensorFlow's (map_loop: see
    _known_limitation; the map's reference is then a loop over the examples)."""
    def run(args):
        if name in HANDLERS:
            with (HANDLERS[name]() if ours else contextlib.nullcontext()):
                return inner(args)
        if name in ("GradientTape", "tf.GradientTape"):
            Tape = oh.GradientTape if ours and name == "GradientTape" else tf.GradientTape
            with Tape(persistent=True) as t:
                t.watch(args[:3])
                outs = inner(args)
            targets = _tensors(outs)
            grads = t.gradient(targets, list(args[:3]) + list(variables))
            return outs + list(grads)
        if name == "ForwardAccumulator":
            Acc = oh.ForwardAccumulator if ours else tf.autodiff.ForwardAccumulator
            primals = list(args[:3]) + list(variables)
            r = np.random.default_rng(seed)
            tangents = [tf.constant(r.standard_normal(p.shape).astype(np.float32))
                        for p in primals]
            with Acc(primals, tangents) as acc:
                outs = inner(args)
            outs = [o.values if isinstance(o, tf.IndexedSlices) else o for o in outs]
            return outs + [acc.jvp(o) for o in outs if o is not None]
        if name == "vectorized_map":
            if map_loop and not ours:
                rows = [_dense(inner([a[k] for a in args])) for k in range(args[0].shape[0])]
                return [tf.stack(col) for col in zip(*rows)]
            vmap = oh.vectorized_map if ours else tf.vectorized_map
            return vmap(lambda e: _dense(inner(e)), tuple(args))
        raise AssertionError(name)
    return run


class Stack:
    def __init__(self, seed):
        rng = random.Random(seed)
        self.seed = seed
        core = [rng.choice(AUTODIFF) for _ in range(rng.choice([1, 1, 2]))]
        if rng.random() < 0.25:
            core.insert(rng.randrange(len(core) + 1), "vectorized_map")
        layers = list(core)
        for _ in range(rng.randint(1, 3)):
            layers.insert(rng.randrange(len(layers) + 1), rng.choice(sorted(HANDLERS)))
        self.layers = layers
        self.mode = rng.choice(["eager", "eager", "function", "unknown_batch", "warm"])
        self.batches = [rng.choice([1, 2, 3])]
        if self.mode == "unknown_batch":
            self.batches = [4, rng.choice([1, 3])]
        self.ours_first = rng.random() < 0.5

    def describe(self):
        return "stack %s, %s, batches %s, %s first" % (
            " > ".join(self.layers), self.mode, self.batches,
            "oh" if self.ours_first else "tf")

    def run(self, program, batch, data_seed, ours):
        mode = "function" if self.mode == "warm" else self.mode
        outer = 2 if "vectorized_map" in self.layers else None
        args = _data(data_seed, batch, outer)
        variables = _variables(program.seed)
        fn = _fn(program, variables, mode)
        run = lambda a: list(fn(*a))  # noqa: E731
        for name in reversed(self.layers):
            run = _layer(name, run, variables, ours, self.seed,
                         getattr(self, "map_loop", False))
        return run(args)


def _known_limitation(stack, program):
    """Stacks left out of the draw: fuzz findings not fixed yet (see the module's end).
    - oh.vectorized_map together with oh.ForwardAccumulator on a program with a max
      pool: tf.vectorized_map traces, and TensorFlow's MaxPool JVP in a graph is zeros
      (its MaxPoolGradGrad kernel; oh.ForwardAccumulator has its own rule, checked
      against TensorFlow eagerly in test_forward_accumulator_compose).
    - tf.GradientTape outside an oh autodiff layer (oh.GradientTape or
      oh.ForwardAccumulator) over the variable gather: the gathered variable's gradient
      can be tf.IndexedSlices with each index twice where TensorFlow's has it once
      (Async > tf.GradientTape > ForwardAccumulator, eager, OH_FUZZ_SEED=11 case 28;
      OpCounter > Recompute(save) > tf.GradientTape > GradientTape > OpHandler, eager,
      OH_FUZZ_SEED=9 case 0). The values agree (summed per index): TensorFlow's tape
      records the gather on the user's objects and the oh layer's bridge records it again
      on the objects its own rules use (TensorFlow's tapes know tensors by Python object),
      so the two uses reach the variable through two gathers. Compared with
      IndexedSlices summed into dense values (the type is still checked).
    - tf.GradientTape outside oh.vectorized_map with Async inside the map (HandlerError
      while the map traces: tf.GradientTape > GradientTape > vectorized_map > Async,
      unknown_batch, OH_FUZZ_SEED=42 case 12). Unfixed.
    - vectorized_map outside two tapes over Recompute (any policy) on a program with the
      variable gather, in a function (vectorized_map > GradientTape > GradientTape >
      Recompute, warm, OH_FUZZ_SEED=35 slow case 34; > Recompute(budget), OH_FUZZ_SEED=89
      slow case 18): was ValueError "variable without handle data" (fixed: Recompute's
      rewrite gives its resource placeholders handle data; the minimal form passes,
      test below). The two cases now give zeros where TensorFlow gives None (gradients
      of V and z, unconnected: the map's outputs are None -> 0 there); case 18 also has
      second-order values of 4e-8 where TensorFlow's are 1e-14 (a max pool; within the
      tolerance). Unfixed, still left out.
    - Lazy inside vectorized_map (pfor traces the mapped function): Lazy refuses with a
      clear HandlerError.
    - two accumulators over the variable gather: TensorFlow's nesting always raises
      ("variable without handle data") and the failure leaves state that changes its
      later nested JVPs (OH_FUZZ_SEED=152 slow case 7 was wrong after case 1): not run.
    Run eagerly instead (TensorFlow's reference is wrong in a function):
    - two accumulators: which of the outer's JVPs of the inner's JVPs are None and which
      zeros depends in a function on TensorFlow's per-op JVP graphs (inlined there; each
      a call eagerly, which oh.ForwardAccumulator matches: zeros wherever the outer has
      a tangent for the op), e.g. None for a reshape, zeros for a matmul by a constant or
      concat_split(y, y) (Recompute > OpHandler > OpCounter > ForwardAccumulator >
      ForwardAccumulator, OH_FUZZ_SEED=5 case 21); values agree. (Inside
      oh.vectorized_map oh.ForwardAccumulator takes the in-function pattern, as
      tf.vectorized_map traces: OH_FUZZ_SEED=28 slow case 7.)
    - oh.vectorized_map with oh.ForwardAccumulator: TensorFlow's accumulator inside
      tf.vectorized_map over a called tf.function gives no tangent to a captured
      variable (None, or the other tangents only), and over a gathered variable raises
      (IndexedSlices has no _id) or, after other cases, differs;
    - an accumulator over a max pool: TensorFlow's graph JVP of MaxPool is wrong
      (test_fuzz_compositions' xfail);
    - a tape around an accumulator: tf.GradientTape > tf.autodiff.ForwardAccumulator
      around a called tf.function gives other second-order values than the same
      nesting eagerly (ours gives the eager ones; OH_FUZZ_SEED=5, case 11). With
      vectorized_map under the accumulator tf.vectorized_map calls a traced function
      even eagerly: its JVPs' gradient is None (oh.GradientTape above gives the eager
      values, OH_FUZZ_SEED=89 slow case 39), so the reference map is then a loop over
      the examples (its IndexedSlices densified, as tf.vectorized_map's); under a
      tf.GradientTape ours has TensorFlow's None too, and tf.vectorized_map stays.
    Spot-checked (TensorFlow's reference eager against in a function, seeds
    5-6, both draws): still wrong in a function for a tape around an accumulator
    (OH_FUZZ_SEED=5 case 11: second-order values) and an accumulator over a max pool
    (case 71: JVPs); two accumulators in a function mostly fail in TensorFlow itself
    ("variable without handle data", 6 of 6 drawn), so eager keeps them covered.
    Fixed and back in the draw (tests below): Async inside vectorized_map, DataFormat
    with vectorized_map in a function, an HVP with Lazy in a function; tf.GradientTape
    outside an oh autodiff layer (a tf.function replayed by a handler above
    oh.GradientTape: None second-order gradients, OH_FUZZ_SEED=2 case 16 and
    OH_FUZZ_SEED=57 case 18, test_tf_tape_outside.py; earlier tf.GradientTape > Async >
    GradientTape > Recompute(save), OH_FUZZ_SEED=102 case 1); vectorized_map outside
    two tapes over a max pool in a function (OH_FUZZ_SEED=64 case 34: MaxPoolGradGrad's
    kernel zeros in the map's replayed graphs, test_vectorized_map_max_pool.py);
    tf.GradientTape outside oh.vectorized_map with Recompute inside the map (the map
    traces: nested scopes, an accumulator or a tape's gradient inside a scope, slow draw
    OH_FUZZ_SEED=34 case 5, 19 case 17, 40 case 38; test_recompute_windows.py)."""
    layers = stack.layers
    if "vectorized_map" in layers and "ForwardAccumulator" in layers:
        if any(name == "pool_nhwc" for name, _, _ in program.steps):
            return True  # TensorFlow's map traces: its MaxPool JVP is wrong (see above)
        stack.mode, stack.batches = "eager", stack.batches[:1]
    if layers.count("ForwardAccumulator") > 1:
        if any(name == "gather_var" for name, _, _ in program.steps):
            return True  # TensorFlow fails, and then differs (see above)
        stack.mode, stack.batches = "eager", stack.batches[:1]
    acc = layers.index("ForwardAccumulator") if "ForwardAccumulator" in layers else None
    if acc is not None and (any(name == "pool_nhwc" for name, _, _ in program.steps) or any(
            name in ("GradientTape", "tf.GradientTape") for name in layers[:acc])):
        stack.mode, stack.batches = "eager", stack.batches[:1]
        stack.map_loop = "vectorized_map" in layers[acc + 1:] and (
            "GradientTape" in layers[:acc] or _tracing_between_tf_tape(layers, acc))
    if "vectorized_map" in layers and "Lazy" in layers[layers.index("vectorized_map") + 1:]:
        return True
    tf_tape = layers.index("tf.GradientTape") if "tf.GradientTape" in layers else None
    if tf_tape is not None and any(
            name in ("GradientTape", "ForwardAccumulator")
            for name in layers[tf_tape + 1:]) and any(
                name == "gather_var" for name, _, _ in program.steps):
        stack.slices_summed = True  # duplicated indices, same values (see above)
    if tf_tape is not None and "vectorized_map" in layers[tf_tape + 1:] and \
            "Async" in layers[layers.index("vectorized_map") + 1:]:
        return True  # a tf.GradientTape outside the map (see above)
    if "vectorized_map" in layers and stack.mode != "eager" and any(
            name == "gather_var" for name, _, _ in program.steps):
        below = layers[layers.index("vectorized_map") + 1:]
        tapes = [i for i, name in enumerate(below) if name in ("GradientTape", "tf.GradientTape")]
        if len(tapes) > 1 and any(name.startswith("Recompute") for name in below[tapes[1]:]):
            return True  # two tapes over Recompute under the map, a gathered variable
    return False


def _tracing_between_tf_tape(layers, acc):
    """A tracing handler (oh.Recompute, Lazy, Async) between a tf.GradientTape and the
    accumulator at `acc`: that tape records the handler's call, whose gradient goes
    through the JVPs too (the eager values; OH_FUZZ_SEED=106 case 29,
    test_tape_over_accumulator_over_map.py)."""
    tapes = [k for k, name in enumerate(layers[:acc]) if name == "tf.GradientTape"]
    return bool(tapes) and any(name.startswith(("Recompute", "Lazy", "Async"))
                               for name in layers[tapes[0] + 1:acc])


def _run_case(stack, program, warm_program):
    if stack.mode == "warm":  # caches filled by another program under the same stack
        stack.run(warm_program, stack.batches[0], 1, True)
    for step, batch in enumerate(stack.batches):
        order = [True, False] if stack.ours_first else [False, True]
        results = {}
        for ours in order:
            results[ours] = stack.run(program, batch, program.seed * 7 + step, ours)
        if getattr(stack, "map_loop", False):  # the loop's gathers: tf.vectorized_map's dense
            results[False] = [_dense([t])[0] if t is not None else t for t in results[False]]
        if getattr(stack, "slices_summed", False):
            for i, (r, g) in enumerate(zip(results[False], results[True])):
                assert isinstance(r, tf.IndexedSlices) == isinstance(g, tf.IndexedSlices), (
                    "batch %d[%d]: %s, expected %s" % (batch, i, type(g).__name__,
                                                       type(r).__name__))
            results = {k: [tf.convert_to_tensor(t) if isinstance(t, tf.IndexedSlices) else t
                           for t in v] for k, v in results.items()}
        _same(results[False], results[True], "batch %d" % batch)


def _check(count, seed, lengths, command):
    """Returns how many stacks TensorFlow's own nesting could not run (skipped); a
    failure names `command`, which replays them."""
    failures, skipped, drawn = [], 0, []
    i = -1
    while len(drawn) < count:
        i += 1
        stack = Stack(seed * 1000 + i)
        program = Program(seed * 1000 + 500 + i, lengths)
        warm = Program(seed * 1000 + 900 + i, lengths)
        if _known_limitation(stack, program):
            continue
        drawn.append(i)
        try:
            stack.run(program, stack.batches[0], 0, False)
        except Exception:  # pylint: disable=broad-except
            skipped += 1  # TensorFlow's own nesting fails on it
            continue
        try:
            _run_case(stack, program, warm)
        except Exception as e:  # pylint: disable=broad-except
            failures.append("%s (case %d):\n%s\n%s: %s" % (
                stack.describe(), i, program.describe(), type(e).__name__,
                str(e)[:1200]))
    assert not failures, "%d of %d stacks differ from TensorFlow (replay: %s):\n\n%s" % (
        len(failures), count, command, "\n\n".join(failures[:8]))
    assert skipped < count, "TensorFlow ran none of the stacks"
    return skipped


_QUIET = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@_QUIET
def test_random_stacks_match_tensorflow(request):
    seed = run_seed()
    _check(FAST_CASES, seed, (2, 5), replay(request.node.nodeid, seed))


@_QUIET
@pytest.mark.slow
def test_default_random_stacks_match_tensorflow(request):
    _check(DEFAULT_CASES, SEED, (2, 5), replay(request.node.nodeid, SEED))


@_QUIET
@pytest.mark.slow
def test_more_random_stacks_match_tensorflow(request):
    _check(SLOW_CASES, SEED + 1, (3, 8), replay(request.node.nodeid, SEED))


# -- fuzz findings, fixed -----------------------------------------------------------------

@pytest.mark.parametrize("persistent", [False, True])
def test_tape_target_from_data_format_is_connected(persistent):
    # Found by test_data_format_fuzz's gradient chains: oh.GradientTape > oh.DataFormat,
    # the target a channels-last output (a `Permuted`). The tape's view of it is a
    # transpose back made by DataFormat's copy_off at tape.gradient; after the scope (or
    # for a non-persistent tape asked inside it, once stopped) the tape did not record
    # that transpose: every gradient was None. Now the view's ops are recorded.
    x = tf.random.stateless_normal([2, 3, 6, 5], seed=[1, 2])
    w = tf.random.stateless_normal([3, 3, 3, 4], seed=[3, 4])
    with tf.GradientTape(persistent=True) as t:
        t.watch(x)
        want_y = tf.transpose(tf.nn.conv2d(tf.transpose(x, [0, 2, 3, 1]), w, 1, "SAME"),
                              [0, 3, 1, 2])
    want = t.gradient(want_y, x)
    for inside in (True, False):
        with oh.GradientTape(persistent=persistent) as t:
            t.watch(x)
            with oh.DataFormat():
                y = tf.nn.conv2d(x, w, 1, "SAME", data_format="NCHW")
            if inside:
                got = t.gradient(y, x)
        if not inside:
            got = t.gradient(y, x)
        _same([want_y, want], [y, got], "tape > DataFormat, gradient %s the scope" % (
            "inside" if inside else "after"))


@pytest.mark.parametrize("in_function", [False, True])
def test_nested_accumulators_jvp_of_an_op_given_one_tensor_twice(in_function):
    # Fuzz finding (stack ForwardAccumulator > ForwardAccumulator, t8 = maximum(t4, t4)):
    # with an accumulator below, the JVP runs TensorFlow's construction eagerly, whose
    # tape knows inputs by id: both inputs of maximum(t, t) got the whole gradient and
    # the inner JVP was twice TensorFlow's. A repeated input is copied now.
    r = np.random.default_rng(3)
    x, z, tx, tz = [tf.constant(r.standard_normal((3, 4)).astype(np.float32))
                    for _ in range(4)]

    def f(a, b):
        t = tf.matmul(a, b, transpose_b=True)
        return tf.maximum(t, t) + tf.square(t) * t
    g = tf.function(f) if in_function else f
    results = []
    for Acc in (tf.autodiff.ForwardAccumulator, oh.ForwardAccumulator):
        with Acc([x, z], [tx, tz]) as outer:
            with Acc([x, z], [tx, tz]) as inner:
                y = g(x, z)
            j = inner.jvp(y)
        results.append([y, j, outer.jvp(y), outer.jvp(j)])
    _same(results[0], results[1], "nested accumulators, maximum(t, t)")


@pytest.mark.parametrize("between", ["OpHandler", "PassThrough", "DataFormat",
                                     "DataFormat+CheckNumerics", "PassThrough+OpCounter"])
def test_hvp_through_a_handler_between_accumulator_and_tape(between):
    # Fuzz finding (stack ForwardAccumulator > DataFormat > GradientTape): with any
    # handler (or two) between oh.ForwardAccumulator and oh.GradientTape, the JVP of
    # the tape's gradient was None. The gradient of the tape's copy of x (CopyOnGrad) ran on the
    # handler's stack, which copied it off through the accumulator (dropping its
    # tangent); it now runs on the recording accumulator's stack, as with no handler.
    x = tf.constant([[1.0, 2.0], [-0.5, 0.3]])
    v = tf.constant([[0.5, -1.0], [0.2, 0.1]])
    results = []
    for ours in (False, True):
        Acc = oh.ForwardAccumulator if ours else tf.autodiff.ForwardAccumulator
        Tape = oh.GradientTape if ours else tf.GradientTape
        with Acc(x, v) as acc, contextlib.ExitStack() as handlers:
            if ours:  # (two handlers between: the copy goes down two stacks)
                for name in between.split("+"):
                    handlers.enter_context(HANDLERS[name]())
            with Tape() as t:
                t.watch(x)
                y = tf.reduce_sum(tf.sin(x) ** 2 * x)
            g = t.gradient(y, x)
        results.append([y, g, acc.jvp(g)])
    _same(results[0], results[1], "ForwardAccumulator > %s > GradientTape" % between)



_BODIES = {  # f(x, y): results that depend on y (no tangent) or on x only through a mask
    "maximum": lambda x, y: [tf.maximum(tf.reshape(x, [-1, 4]), tf.reshape(x, [-1, 4]))],
    "scale": lambda x, y: [x * 2.0, y * 3.0, tf.cast(y > 2.0, tf.float32)],
}


@pytest.mark.parametrize("between", ["", "Lazy", "OpHandler"])
@pytest.mark.parametrize("body", sorted(_BODIES))
def test_hvp_of_a_called_function_has_zero_jvps(body, between):
    # Fuzz finding (Recompute(save) > ForwardAccumulator > GradientTape > Lazy in a
    # function, OH_FUZZ_SEED=20 slow case 23): the JVP of the gradient was None where
    # TensorFlow's is zeros. TensorFlow computes a call's JVP with zero tangents for its
    # arguments without one (the gradient call's output gradients, `y` here), so a result
    # computed from them gets zeros; the replay under oh.ForwardAccumulator gave them none.
    x = tf.constant(np.arange(8, dtype=np.float32).reshape(2, 4) - 3.0)
    y = tf.constant(np.arange(8, dtype=np.float32).reshape(2, 4) + 1.0)
    v = tf.constant(np.linspace(-1.0, 1.0, 8, dtype=np.float32).reshape(2, 4))
    f = tf.function(_BODIES[body], autograph=False,
                    input_signature=[tf.TensorSpec([None, 4])] * 2)
    results = []
    for ours in (False, True):
        Acc = oh.ForwardAccumulator if ours else tf.autodiff.ForwardAccumulator
        Tape = oh.GradientTape if ours else tf.GradientTape
        with Acc([x], [v]) as acc:
            with Tape(persistent=True) as t:
                t.watch([x, y])
                with HANDLERS[between]() if ours and between else contextlib.nullcontext():
                    outs = list(f(x, y))
            grads = t.gradient(outs, [x, y])
        results.append(outs + grads + [None if o is None else acc.jvp(o)
                                       for o in outs + grads])
    _same(results[0], results[1], "ForwardAccumulator > GradientTape > %s > %s" % (
        between or "(none)", body))


@pytest.mark.parametrize("in_function", [False, True])
def test_async_inside_vectorized_map_with_per_example_ids(in_function):
    # Fuzz finding (vectorized_map > Recompute(save) > tf.GradientTape > Async >
    # PassThrough, OH_FUZZ_SEED=6 slow case 23): oh.Async read the value of a small
    # integer input from outside it (its signature), here the map's per-example ids, and
    # the user saw vectorized_map's internal CopyOffError. Such a tensor is now described
    # by its shape only.
    V = tf.Variable(np.arange(24, dtype=np.float32).reshape(6, 4))
    x = tf.constant(np.arange(8, dtype=np.float32).reshape(2, 4))
    ids = tf.constant([[1, 2], [3, 0]])

    def f(a, i):
        return tf.reduce_sum(tf.gather(V, i), 0) * tf.reshape(a, [2, 2])[0, 0]
    g = tf.function(f, autograph=False) if in_function else f

    def mapped(args):
        with oh.Async():
            return g(*args)
    want = tf.vectorized_map(lambda args: f(*args), (x, ids))
    _same([want], [oh.vectorized_map(mapped, (x, ids))], "vectorized_map > Async")


@pytest.mark.parametrize("above", ["OpHandler", "DataFormat"])
def test_vectorized_map_under_a_replaying_handler_with_a_looped_op(above):
    # Fuzz finding (DataFormat > vectorized_map > OpCounter > DataFormat >
    # tf.GradientTape, OH_FUZZ_SEED=20 slow case 8): a handler above oh.vectorized_map
    # replays the mapped tf.function; an op without a batching rule (ResourceGather) runs
    # as pfor's while loop, whose function the replay interprets on the map's next stack.
    # The ops while_v2 adds itself (loop counter, control dependencies) were routed to
    # that stack too: RuntimeError "Expected a PyOperation got None".
    V = tf.Variable(np.arange(24, dtype=np.float32).reshape(6, 4))
    ids = tf.constant([[1, 2], [3, 0], [5, 4]])
    f = tf.function(lambda i: tf.sigmoid(tf.gather(V, i)), autograph=False,
                    input_signature=[tf.TensorSpec([None], tf.int32)])
    with HANDLERS[above]():
        got = oh.vectorized_map(f, ids)
    _same([tf.vectorized_map(f, ids)], [got], "%s > vectorized_map" % above)


@pytest.mark.parametrize("between", ["OpHandler", "CheckNumerics"])
@pytest.mark.parametrize("recompute", ["Recompute", "Recompute(save)"])
def test_unconnected_source_through_recompute_under_a_replaying_handler(between, recompute):
    # Fuzz finding (OH_FUZZ_SEED=40 slow cases 8 and 27: OpLogHandler > GradientTape >
    # OpHandler > Recompute, GradientTape > CheckNumerics > Recompute(save), in a
    # function): a zero gradient for x, used only by a result nothing returns, where
    # TensorFlow's is None. oh.Recompute ran the call as its segmented rewrite on the
    # replaying handler below, whose replay dropped the segments' gradient: a plain
    # IdentityN passed the zeros filled in for its unused outputs on to x. Such a call
    # is kept whole now. (Not order-dependent: each case fails alone too.)
    x = tf.constant(np.arange(16, dtype=np.float32).reshape(4, 4) - 3.0)
    z = tf.constant(np.arange(16, dtype=np.float32).reshape(4, 4) + 1.0)

    @tf.function(autograph=False, input_signature=[tf.TensorSpec([None, 4])] * 2)
    def f(a, b):
        tf.sin(tf.nn.softplus(a))  # computed, never used
        return tf.reduce_max(tf.abs(b), 0, keepdims=True) * tf.reduce_sum(b)
    results = []
    for ours in (False, True):
        Tape = oh.GradientTape if ours else tf.GradientTape
        with Tape(persistent=True) as t:
            t.watch([x, z])
            with contextlib.ExitStack() as handlers:
                if ours:
                    handlers.enter_context(HANDLERS[between]())
                    handlers.enter_context(HANDLERS[recompute]())
                y = f(x, z)
        results.append([y] + t.gradient(y, [x, z]))
    _same(results[0], results[1], "GradientTape > %s > %s" % (between, recompute))


@_QUIET
@pytest.mark.slow
@pytest.mark.parametrize("order", [(8, 27), (27, 8)])
def test_seed_40_cases_in_both_orders(order):
    # The two cases of that finding, run after each other in both orders (the finding
    # was first thought to depend on what ran before in the process).
    for i in order:
        stack, seed = Stack(41 * 1000 + i), 41 * 1000 + 500 + i
        _run_case(stack, Program(seed, (3, 8)), Program(41 * 1000 + 900 + i, (3, 8)))


@pytest.mark.parametrize("async_inside", [False, True])
def test_variable_gradient_per_example_under_two_handlers_in_vectorized_map(async_inside):
    # Fuzz finding (vectorized_map > OpCounter > PassThrough > GradientTape > Async,
    # OH_FUZZ_SEED=100 slow case 28): the CopyOnGrad of a variable's per-example
    # gradient was copied off through the handlers between the tape and the map, and
    # vectorized_map refused (CopyOffError); it ran per example only with one handler
    # between. Now the copy op runs on the map however deep it refused.
    xs = tf.constant(np.arange(12, dtype=np.float32).reshape(3, 4))
    w = tf.Variable(np.linspace(-1.0, 1.0, 4, dtype=np.float32))

    def body(ours):
        def mapped(e):
            with contextlib.ExitStack() as handlers:
                Tape = tf.GradientTape
                if ours:
                    handlers.enter_context(HANDLERS["OpCounter"]())
                    handlers.enter_context(HANDLERS["PassThrough"]())
                    Tape = oh.GradientTape
                with Tape() as t:
                    with HANDLERS["Async"]() if ours and async_inside else \
                            contextlib.nullcontext():
                        y = tf.reduce_sum(tf.sin(e * w))
                return t.gradient(y, w)
        return mapped
    _same([tf.vectorized_map(body(False), xs)], [oh.vectorized_map(body(True), xs)],
          "vectorized_map > OpCounter > PassThrough > GradientTape")


# Findings of the seed sweeps still open: CHANGELOG.md's known limitations and
# test_known_limitations.py; left out of the draw: `_known_limitation`.


def test_two_tapes_over_recompute_gathering_a_variable_in_vectorized_map():
    # Minimal form of OH_FUZZ_SEED=35 slow case 34 and OH_FUZZ_SEED=89 slow case 18
    # (found when the max-pool exclusion was narrowed): ValueError "Tried to take
    # gradients (or similar) of a variable without handle data". One tape passed. The
    # placeholders of Recompute's rewrite of the call now get the variable's handle
    # data, as a replay's do (also without the map: OH_FUZZ_SEED=79 slow case 3).
    V = tf.Variable(np.arange(24, dtype=np.float32).reshape(6, 4) / 10)
    x = tf.constant(np.linspace(-1.0, 1.0, 24, dtype=np.float32).reshape(2, 3, 4))
    ids = tf.constant([[1, 2, 3], [0, 5, 1]])
    prog = tf.function(lambda a, i: tf.reduce_sum(tf.sin(tf.gather(V, i) * a)))

    def body(Tape, ours):
        def per_example(args):
            with Tape(persistent=True) as outer:
                outer.watch(args[0])
                with Tape(persistent=True) as inner:
                    inner.watch(args[0])
                    with oh.Recompute() if ours else contextlib.nullcontext():
                        y = prog(*args)
                grads = [tf.convert_to_tensor(g) for g in inner.gradient(y, [args[0], V])]
            return [tf.convert_to_tensor(g) for g in outer.gradient(grads, [args[0], V])]
        return per_example
    _same(tf.vectorized_map(body(tf.GradientTape, False), (x, ids)),
          oh.vectorized_map(body(oh.GradientTape, True), (x, ids)),
          "vectorized_map > GradientTape > GradientTape > Recompute")


@pytest.mark.parametrize("unknown_batch", [False, True])
def test_two_tapes_over_recompute_gathering_a_variable(unknown_batch):
    # Fuzz finding (GradientTape > DataFormat > GradientTape > Recompute(budget) > Lazy,
    # OH_FUZZ_SEED=79 slow case 3): the same ValueError without a map, eagerly too.
    V = tf.Variable(np.arange(24, dtype=np.float32).reshape(6, 4) / 10)
    x, ids = tf.constant(np.linspace(-1.0, 1.0, 8, dtype=np.float32).reshape(2, 4)), [1, 4]
    sig = [tf.TensorSpec([None, 4]), tf.TensorSpec([None], tf.int32)] if unknown_batch else None
    prog = tf.function(lambda a, i: tf.reduce_sum(tf.sin(a * 2.0)) + tf.reduce_sum(
        tf.gather(V, i)), input_signature=sig, autograph=False)
    results = []
    for ours in (False, True):
        Tape = oh.GradientTape if ours else tf.GradientTape
        with Tape(persistent=True) as outer:
            outer.watch(x)
            with Tape(persistent=True) as inner:
                inner.watch(x)
                with oh.Recompute() if ours else contextlib.nullcontext():
                    y = prog(x, tf.constant(ids))
            grads = [tf.convert_to_tensor(g) for g in inner.gradient(y, [x, V])]
        results.append([y] + grads + outer.gradient(grads, [x, V]))
    _same(results[0], results[1], "GradientTape > GradientTape > Recompute")
