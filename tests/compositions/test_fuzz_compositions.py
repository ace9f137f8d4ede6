"""Differential fuzzing of handler compositions: seeded random op programs run under each
handler alone and under pairs of handlers, compared with TensorFlow's counterpart on the
same inputs (values, dtypes, shapes, dense vs tf.IndexedSlices, None patterns).

A program works on a batch: inputs x [B, 4] and z [B, 4] (float), y [4] (float, often
unconnected: a None gradient) and ids [B] (int32, gathered from the variable V [6, 4]: an
IndexedSlices gradient), and the variable W [4, 4]. Its steps are elementwise and
broadcasting binary ops, where, matmul, reductions with and without keepdims (also over
the batch axis), reshape and transpose, concat then split, gathers (of V by ids, of a
tensor on its last axis), casts (through float64; to int32 and integer ops and back,
which cut the gradient), softmax, a mean over the dynamic batch size, and NHWC
convolutions and pools (on which oh.DataFormat must be the identity).

Each case runs eagerly, in a fresh `tf.function`, or in a fresh `tf.function` with an
`input_signature` whose batch dims are None (then for two batch sizes, a partial last
batch, with a fresh handler per step). All cases are interleaved in one seeded random
order in the process, so a cache filled by one case and reused by another shows.

`make test` runs a smaller draw whose seed changes from run to run (tests/fuzz_seed.py);
the fixed draw of the default seed is marked slow. Reproduce a failure with the command it
prints, e.g.
    OH_FUZZ_SEED=<seed> pytest tests/compositions/test_fuzz_compositions.py
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

SEED = int(os.environ.get("OH_FUZZ_SEED", "24"))
FAST_CASES = 32  # one per composition, in `make test` (the run's rotating draw)
DEFAULT_CASES = 64  # two per composition, the default seed's draw (marked slow)
SLOW_CASES = 100  # longer programs (4 to 10 steps), marked slow

# -- programs --------------------------------------------------------------------------

UNARY = {
    "sin": tf.sin, "tanh": tf.tanh, "sigmoid": tf.sigmoid, "relu": tf.nn.relu,
    "square": tf.square, "neg": tf.negative, "exp_tanh": lambda a: tf.exp(tf.tanh(a)),
    "softplus": tf.nn.softplus, "abs": tf.abs,
    "via_float64": lambda a: tf.cast(tf.sin(tf.cast(a, tf.float64)) * 2.0, tf.float32),
    # Integer ops: no gradient flows through the int32 part (None unless a also flows).
    "int_ops": lambda a: tf.cast(
        tf.math.floormod(tf.cast(tf.round(a * 3.0), tf.int32) * 7 + 11, 5)
        + tf.math.floordiv(tf.cast(tf.round(a * 3.0), tf.int32), 2), tf.float32) * 0.25,
    "int_times": lambda a: a * tf.cast(tf.cast(a > 0.0, tf.int32) + 1, tf.float32),
}

BINARY = {
    "add": tf.add, "sub": tf.subtract, "mul": tf.multiply, "maximum": tf.maximum,
    "div": lambda a, b: a / (b * b + 1.0), "where": lambda a, b: tf.where(a > 0.0, a, b),
}


_KERNEL = np.linspace(-1.0, 1.0, 8).astype(np.float32).reshape(2, 2, 1, 2)


def _broadcast(a, b):
    """The broadcast of symbolic shapes ('B' is the batch dim), or None."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        da = a[-i] if i <= len(a) else 1
        db = b[-i] if i <= len(b) else 1
        if da == db or db == 1:
            out.append(da)
        elif da == 1:
            out.append(db)
        else:
            return None
    return tuple(reversed(out))


class Program:
    """A random program: a list of steps (name, argument slots, params) over the slots
    x, y, z (then one slot per step); ids and the variables are read by name."""

    def __init__(self, seed, lengths=(2, 6)):
        self.seed = seed
        rng = random.Random(seed)
        self.steps = []
        shapes = [("B", 4), (4,), ("B", 4)]
        for _ in range(rng.randint(*lengths)):
            while True:
                found = self._draw(rng, shapes)
                if found is not None:
                    break
            self.steps.append(found[0])
            shapes.append(tuple(found[1]))
        self.shapes = shapes
        n = len(shapes)
        self.outputs = [n - 1]
        if n > 4 and rng.random() < 0.5:
            self.outputs.append(rng.randrange(3, n - 1))

    @staticmethod
    def _pick(rng, shapes, ok=lambda s: True):
        slots = [i for i, s in enumerate(shapes) if ok(s)]
        if not slots:
            return None
        return slots[-1] if slots[-1] == len(shapes) - 1 and rng.random() < 0.6 else (
            rng.choice(slots))

    def _draw(self, rng, shapes):
        kind = rng.choice(["unary", "unary", "binary", "binary", "matmul_var", "matmul_pair",
                           "reduce", "reshape", "transpose", "concat_split", "gather_var",
                           "gather_last", "softmax", "dyn_mean", "conv_nhwc", "pool_nhwc"])
        if kind == "unary":
            a = self._pick(rng, shapes)
            return ("unary", [a], {"fn": rng.choice(sorted(UNARY))}), shapes[a]
        if kind == "binary":
            a = self._pick(rng, shapes)
            cands = [i for i, s in enumerate(shapes) if _broadcast(shapes[a], s) is not None]
            b = rng.choice(cands)
            if rng.random() < 0.3:
                a, b = b, a
            return ("binary", [a, b], {"fn": rng.choice(sorted(BINARY))}), _broadcast(
                shapes[a], shapes[b])
        if kind == "matmul_var":
            a = self._pick(rng, shapes, lambda s: len(s) == 2 and s[1] == 4)
            return None if a is None else (("matmul_var", [a], {}), (shapes[a][0], 4))
        if kind == "matmul_pair":
            a = self._pick(rng, shapes, lambda s: len(s) == 2)
            if a is None:
                return None
            cands = [i for i, s in enumerate(shapes) if len(s) == 2 and s[1] == shapes[a][1]]
            b = rng.choice(cands)
            return ("matmul_pair", [a, b], {}), (shapes[a][0], shapes[b][0])
        if kind == "reduce":
            a = self._pick(rng, shapes, lambda s: len(s) >= 1)
            if a is None:
                return None
            s = list(shapes[a])
            axis = rng.randrange(len(s))
            keepdims = rng.random() < 0.5
            out = s[:axis] + ([1] if keepdims else []) + s[axis + 1:]
            return ("reduce", [a], {"kind": rng.choice(["sum", "mean", "max", "min"]),
                                    "axis": axis, "keepdims": keepdims}), out
        if kind == "reshape":
            a = self._pick(rng, shapes, lambda s: s in (("B", 4), ("B", 2, 2), (4,)))
            if a is None:
                return None
            target = {("B", 4): ("B", 2, 2), ("B", 2, 2): ("B", 4), (4,): (2, 2)}[shapes[a]]
            return ("reshape", [a], {"shape": [-1 if d == "B" else d for d in target]}), target
        if kind == "transpose":
            a = self._pick(rng, shapes, lambda s: len(s) >= 2)
            if a is None:
                return None
            perm = list(range(len(shapes[a])))
            rng.shuffle(perm)
            return ("transpose", [a], {"perm": perm}), [shapes[a][p] for p in perm]
        if kind == "concat_split":
            a = self._pick(rng, shapes, lambda s: len(s) >= 1 and s[-1] != "B")
            if a is None:
                return None
            cands = [i for i, s in enumerate(shapes) if s[:-1] == shapes[a][:-1] and len(s)
                     and s[-1] != "B"]
            b = rng.choice(cands)
            n = shapes[a][-1] + shapes[b][-1]
            if n < 2:
                return None
            first = rng.randint(1, n - 1)
            part = rng.randrange(2)
            return ("concat_split", [a, b], {"sizes": [first, n - first], "part": part}), (
                tuple(shapes[a][:-1]) + ([first, n - first][part],))
        if kind == "gather_var":
            return ("gather_var", [], {}), ("B", 4)
        if kind == "gather_last":
            a = self._pick(rng, shapes, lambda s: len(s) >= 1 and s[-1] != "B" and s[-1] >= 2)
            if a is None:
                return None
            idx = [rng.randrange(shapes[a][-1]) for _ in range(rng.randint(1, 3))]
            return ("gather_last", [a], {"idx": idx}), tuple(shapes[a][:-1]) + (len(idx),)
        if kind == "softmax":
            a = self._pick(rng, shapes, lambda s: len(s) >= 1)
            return None if a is None else (("softmax", [a], {}), shapes[a])
        if kind == "dyn_mean":
            a = self._pick(rng, shapes, lambda s: len(s) >= 1 and s[0] == "B")
            return None if a is None else (("dyn_mean", [a], {}), shapes[a][1:])
        if kind in ("conv_nhwc", "pool_nhwc"):  # NHWC images [B, 2, 2, 1] (DataFormat)
            a = self._pick(rng, shapes, lambda s: s == ("B", 4))
            if a is None:
                return None
            return (kind, [a], {}), ("B", 8) if kind == "conv_nhwc" else ("B", 4)
        raise AssertionError(kind)

    def run(self, x, y, z, ids, V, W):
        slots = [x, y, z]
        for name, idx, p in self.steps:
            a = [slots[i] for i in idx]
            if name == "unary":
                out = UNARY[p["fn"]](a[0])
            elif name == "binary":
                out = BINARY[p["fn"]](a[0], a[1])
            elif name == "matmul_var":
                out = tf.matmul(a[0], W)
            elif name == "matmul_pair":
                out = tf.matmul(a[0], a[1], transpose_b=True)
            elif name == "reduce":
                fn = {"sum": tf.reduce_sum, "mean": tf.reduce_mean, "max": tf.reduce_max,
                      "min": tf.reduce_min}[p["kind"]]
                out = fn(a[0], axis=p["axis"], keepdims=p["keepdims"])
            elif name == "reshape":
                out = tf.reshape(a[0], p["shape"])
            elif name == "transpose":
                out = tf.transpose(a[0], p["perm"])
            elif name == "concat_split":
                out = tf.split(tf.concat([a[0], a[1]], -1), p["sizes"], axis=-1)[p["part"]]
            elif name == "gather_var":
                out = tf.gather(V, ids)
            elif name == "gather_last":
                out = tf.gather(a[0], p["idx"], axis=-1)
            elif name == "softmax":
                out = tf.nn.softmax(a[0])
            elif name == "dyn_mean":
                out = tf.reduce_sum(a[0], 0) / tf.cast(tf.shape(a[0])[0], tf.float32)
            elif name == "conv_nhwc":
                img = tf.reshape(a[0], [-1, 2, 2, 1])
                out = tf.reshape(tf.nn.conv2d(img, _KERNEL, 1, "SAME"), [-1, 8])
            elif name == "pool_nhwc":
                img = tf.reshape(a[0], [-1, 2, 2, 1])
                out = tf.reshape(tf.nn.max_pool2d(img, 2, 1, "SAME") + tf.nn.avg_pool2d(
                    img, 2, 1, "SAME"), [-1, 4])
            else:
                raise AssertionError(name)
            slots.append(out)
        return [slots[i] for i in self.outputs]

    def describe(self):
        names = ["x", "y", "z"]
        lines = ["program seed %d: x [B, 4], y [4], z [B, 4], ids [B] int32; variables "
                 "V [6, 4] (gathered by ids), W [4, 4]" % self.seed]
        for k, (name, idx, p) in enumerate(self.steps):
            names.append("t%d" % (k + 3))
            params = {key: v for key, v in p.items() if key != "fn"}
            lines.append("  t%d = %s(%s)%s  # %s" % (
                k + 3, p.get("fn", name), ", ".join(names[i] for i in idx),
                " " + str(params) if params else "", list(self.shapes[k + 3])))
        lines.append("  outputs: %s" % ", ".join(names[i] for i in self.outputs))
        return "\n".join(lines)


# -- data ------------------------------------------------------------------------------

def _data(seed, batch, outer=None):
    """Inputs (x, y, z, ids) for a batch; `outer`: a leading dim of examples (vmap)."""
    r = np.random.default_rng(seed)
    lead = (outer,) if outer else ()
    return [tf.constant(r.standard_normal(lead + (batch, 4)).astype(np.float32)),
            tf.constant(r.standard_normal(lead + (4,)).astype(np.float32)),
            tf.constant(r.standard_normal(lead + (batch, 4)).astype(np.float32)),
            tf.constant(r.integers(0, 6, lead + (batch,)).astype(np.int32))]


def _variables(seed):
    r = np.random.default_rng(seed + 7)
    return (tf.Variable(r.standard_normal((6, 4)).astype(np.float32), name="V"),
            tf.Variable(r.standard_normal((4, 4)).astype(np.float32) * 0.5, name="W"))


def _tangents(seed, args, variables):
    r = np.random.default_rng(seed + 13)
    return [tf.constant(r.standard_normal(t.shape).astype(np.float32))
            for t in list(args[:3]) + list(variables)]


def _fn(program, variables, mode, outer=False):
    """The program as fn(x, y, z, ids): eager, a fresh tf.function, or a fresh
    tf.function with None batch dims (`outer`: per-example inputs of a map)."""
    V, W = variables

    def fn(x, y, z, ids):
        return program.run(x, y, z, ids, V, W)
    if mode == "eager":
        return fn
    if mode == "function":
        return tf.function(fn, autograph=False)
    spec = [tf.TensorSpec([None, 4]), tf.TensorSpec([4]), tf.TensorSpec([None, 4]),
            tf.TensorSpec([None], tf.int32)]
    return tf.function(fn, input_signature=spec, autograph=False)


# -- the compositions: kind -> run(program, args, variables, mode, ours) ------------------
# `ours` True: the handlers under test; False: TensorFlow's counterpart.

def _tape(ours):
    return oh.GradientTape if ours else tf.GradientTape


def _sources(args, variables):
    return list(args[:3]) + list(variables)


def run_tape(program, args, variables, mode, ours, inner=None, tape=None):
    """Gradients of every output; `inner`: a handler factory opened inside the tape (its
    own run: the reference has none); `tape`: the tape type, if not the pair's own."""
    fn = _fn(program, variables, mode)
    Tape = tape or _tape(ours)
    with Tape(persistent=True) as t:
        t.watch(args[:3])
        with (inner() if ours and inner else contextlib.nullcontext()):
            outs = fn(*args)
    return outs, t.gradient(outs, _sources(args, variables))


def run_forward(program, args, variables, mode, ours, inner=None):
    fn = _fn(program, variables, mode)
    Acc = oh.ForwardAccumulator if ours else tf.autodiff.ForwardAccumulator
    seed = program.seed
    with Acc(_sources(args, variables), _tangents(seed, args, variables)) as acc:
        with (inner() if ours and inner else contextlib.nullcontext()):
            outs = fn(*args)
    return outs, acc.jvp(outs)


def run_vmap(program, args, variables, mode, ours):
    fn = _fn(program, variables, mode)
    vmap = oh.vectorized_map if ours else tf.vectorized_map
    return vmap(lambda e: fn(*e), tuple(args))


def run_tape_over_vmap(program, args, variables, mode, ours):
    fn = _fn(program, variables, mode)
    vmap = oh.vectorized_map if ours else tf.vectorized_map
    with _tape(ours)() as t:
        t.watch(args[:3])
        outs = vmap(lambda e: fn(*e), tuple(args))
    return outs, t.gradient(outs, _sources(args, variables))


def run_tf_tape_over_vmap(program, args, variables, mode, ours):
    """A tf.GradientTape around the map (ours: oh.vectorized_map, which then is
    tf.vectorized_map: TensorFlow's tapes would not see the handler's ops)."""
    fn = _fn(program, variables, mode)
    vmap = oh.vectorized_map if ours else tf.vectorized_map
    with tf.GradientTape() as t:
        t.watch(args[:3])
        outs = vmap(lambda e: fn(*e), tuple(args))
    return outs, t.gradient(outs, _sources(args, variables))


def run_vmap_over_tape(program, args, variables, mode, ours):
    """Per-example gradients (dense: a map returns tensors) of x, z and W."""
    fn = _fn(program, variables, mode)
    vmap = oh.vectorized_map if ours else tf.vectorized_map
    Tape = _tape(ours)
    W = variables[1]

    def per_example(e):
        with Tape() as t:
            t.watch([e[0], e[2]])
            outs = fn(*e)
        grads = t.gradient(outs, [e[0], e[2], W])
        return [tf.zeros_like(s) if g is None else tf.convert_to_tensor(g)
                for g, s in zip(grads, [e[0], e[2], W])]
    return vmap(per_example, tuple(args))


def run_parallel(program, args, variables, mode, ours):
    """Ours: the program under oh.ParallelHandler on two CPUs with components args and
    args * 2 (one packed input per component), an oh.GradientTape inside; the reference:
    TensorFlow once per component, gradients of the shared variables summed."""
    fn = _fn(program, variables, mode)
    comps = [args, [a * 2 if a.dtype == tf.float32 else a for a in args]]
    if not ours:
        runs = [run_tape(program, c, variables, mode, False) for c in comps]
        grads = []
        for i in range(5):
            g = [r[1][i] for r in runs]
            if g[0] is None:
                g = None
            elif i >= 3:  # variables: one gradient, summed over the components
                g = tf.add_n([tf.convert_to_tensor(e) for e in g])
            grads.append(g)
        return [[r[0] for r in runs], grads]
    parallel = oh.ParallelHandler(["CPU:0", "CPU:1"])
    with parallel:
        packed = [parallel.pack([c[i] for c in comps]) for i in range(4)]
        with oh.GradientTape(persistent=True) as t:
            t.watch(packed[:3])
            outs = fn(*packed)
        grads = t.gradient(outs, packed[:3] + list(variables))
        values = [[parallel.unpack(o)[k] for o in outs] for k in range(2)]
        out_grads = [None if g is None else list(parallel.unpack(g)) for g in grads[:3]]
        out_grads.extend(grads[3:])  # the variables': summed (off the handler)
    return [values, out_grads]


def _with(factory):
    return lambda: factory


# Handlers that must not change a program's results (a tape outside them gives
# TensorFlow's gradients); DataFormat on NHWC (here: layout-free) data is the identity.
TRANSPARENT = {
    "OpHandler": oh.OpHandler, "OpLogHandler": oh.OpLogHandler,
    "CheckNumerics": oh.CheckNumericsHandler, "Lazy": oh.Lazy, "Async": oh.Async,
    "Recompute": oh.Recompute, "DataFormat": oh.DataFormat,
}

COMPOSITIONS = {
    "GradientTape": run_tape,
    "ForwardAccumulator": run_forward,
    "vectorized_map": run_vmap,
    "GradientTape/vectorized_map": run_tape_over_vmap,
    "tf.GradientTape/vectorized_map": run_tf_tape_over_vmap,
    "vectorized_map/GradientTape": run_vmap_over_tape,
    "ParallelHandler/GradientTape": run_parallel,
}
for _name, _factory in TRANSPARENT.items():
    COMPOSITIONS["GradientTape/" + _name] = (
        lambda f: lambda p, a, v, m, ours: run_tape(p, a, v, m, ours, inner=f))(_factory)
    # TensorFlow's own tape outside our handler: it must see the same gradients.
    COMPOSITIONS["tf.GradientTape/" + _name] = (
        lambda f: lambda p, a, v, m, ours: run_tape(p, a, v, m, ours, inner=f,
                                                    tape=tf.GradientTape))(_factory)
for _name in ("Lazy", "Async", "OpLogHandler", "CheckNumerics", "DataFormat"):
    COMPOSITIONS["ForwardAccumulator/" + _name] = (
        lambda f: lambda p, a, v, m, ours: run_forward(p, a, v, m, ours, inner=f))(
            TRANSPARENT[_name])

_MAPPED = ("vectorized_map", "GradientTape/vectorized_map", "tf.GradientTape/vectorized_map",
           "vectorized_map/GradientTape")


def _run_case(kind, program, mode, batches, ours_first):
    """One composition on one program: for each batch size (two: a partial last batch,
    with one `tf.function` per run, a fresh handler per step), ours against TensorFlow's."""
    run = COMPOSITIONS[kind]
    if kind.startswith("ForwardAccumulator") and mode != "eager" and any(
            name == "pool_nhwc" for name, _, _ in program.steps):
        # MaxPool's JVP in a graph is wrong in TensorFlow itself (zeros: its
        # MaxPoolGradGrad kernel; oh.ForwardAccumulator has its own rule, see
        # test_forward_accumulator_compose): such cases run eagerly.
        mode, batches = "eager", batches[:1]
    for step, batch in enumerate(batches):
        outer = 3 if kind in _MAPPED else None
        data_seed = program.seed * 7 + step
        order = [True, False] if ours_first else [False, True]
        results = {}
        for ours in order:
            args = _data(data_seed, batch, outer)
            variables = _variables(program.seed)
            results[ours] = run(program, args, variables, mode, ours)
        _same(results[False], results[True], "%s %s batch %d" % (kind, mode, batch))


def _cases(count, seed):
    rng = random.Random(seed)
    kinds = sorted(COMPOSITIONS)
    cases = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        mode = rng.choice(["eager", "eager", "function", "unknown_batch"])
        batches = [rng.choice([1, 2, 3, 5])]
        if mode == "unknown_batch":
            batches = [4, rng.choice([1, 3])]  # a partial last batch
        cases.append((kind, seed * 1000 + i, mode, batches, rng.random() < 0.5))
    rng.shuffle(cases)
    return cases


def _run_all(cases, lengths, command):
    """Runs `cases`; a failure names `command`, which replays them."""
    failures = []
    for kind, pseed, mode, batches, ours_first in cases:
        program = Program(pseed, lengths)
        try:
            _run_case(kind, program, mode, batches, ours_first)
        except Exception as e:  # pylint: disable=broad-except
            failures.append("%s, %s, batches %s, %s first:\n%s\n%s: %s" % (
                kind, mode, batches, "oh" if ours_first else "tf", program.describe(),
                type(e).__name__, str(e)[:1500]))
    assert not failures, "%d of %d cases differ from TensorFlow (replay: %s):\n\n%s" % (
        len(failures), len(cases), command, "\n\n".join(failures[:8]))


# tf.GradientTape around oh.Recompute warns that nothing is saved (documented; compared).
_QUIET = pytest.mark.filterwarnings("ignore:oh.Recompute:RuntimeWarning")


@_QUIET
def test_random_compositions_match_tensorflow(request):
    seed = run_seed()
    _run_all(_cases(FAST_CASES, seed), (2, 6), replay(request.node.nodeid, seed))


@_QUIET
@pytest.mark.slow
def test_default_random_compositions_match_tensorflow(request):
    _run_all(_cases(DEFAULT_CASES, SEED), (2, 6), replay(request.node.nodeid, SEED))


@_QUIET
@pytest.mark.slow
def test_more_random_compositions_match_tensorflow(request):
    _run_all(_cases(SLOW_CASES, SEED + 1), (4, 10), replay(request.node.nodeid, SEED))


# Fuzz findings, fixed: TensorFlow's gradient of a gather of V through tf.vectorized_map is
# dense because pfor has no ResourceGather converter and runs it in a while loop (whose
# gradient of a captured input is dense); oh.vectorized_map ran it once per example
# (tf.IndexedSlices) and now uses pfor's while loop too. Concat then split: the per-op
# pfor graph had a None batch dim, so pfor gathered each input over range(B) (an
# IndexedSlices gradient) where tf.vectorized_map's static shapes make it the input
# itself. A tf.GradientTape around oh.vectorized_map got None (it saw no op).
@pytest.mark.parametrize("Tape", [oh.GradientTape, tf.GradientTape])
def test_tape_over_vmap_gather_gradient_is_dense_as_tensorflows(Tape):
    V = tf.Variable(np.arange(24, dtype=np.float32).reshape(6, 4))
    ids = tf.constant([[0, 2], [1, 1], [5, 0]])
    with tf.GradientTape() as t:
        ref = tf.vectorized_map(lambda i: tf.gather(V, i) * 2.0, ids)
    want = t.gradient(ref, V)
    with Tape() as t:
        got = oh.vectorized_map(lambda i: tf.gather(V, i) * 2.0, ids)
    _same([ref, want], [got, t.gradient(got, V)], "tape over vectorized_map, gather of V")
    assert not isinstance(want, tf.IndexedSlices)


@pytest.mark.parametrize("Tape", [oh.GradientTape, tf.GradientTape])
def test_gather_gradients_stay_sparse_where_tensorflows_are(Tape):
    # No map, or a tape inside the map: TensorFlow's gradient is tf.IndexedSlices.
    V = tf.Variable(np.arange(24, dtype=np.float32).reshape(6, 4))
    ids = tf.constant([[0, 2], [1, 1], [5, 0]])
    with tf.GradientTape() as t:
        want = t.gradient(tf.gather(V, ids) * 2.0, V)
    with Tape() as t:
        got = t.gradient(tf.gather(V, ids) * 2.0, V)
    _same(want, got, "gather of V, no map")
    assert isinstance(got, tf.IndexedSlices)

    def per_example(tape, seen):
        def fn(i):
            with tape() as t:
                y = tf.gather(V, i) * 2.0
            g = t.gradient(y, V)
            seen.append(type(g))
            return tf.convert_to_tensor(g)
        return fn
    want_types, got_types = [], []
    want = tf.vectorized_map(per_example(tf.GradientTape, want_types), ids)
    got = oh.vectorized_map(per_example(Tape, got_types), ids)
    _same(want, got, "tape inside vectorized_map, gather of V")
    assert want_types == got_types == [tf.IndexedSlices]


def test_tape_over_vmap_concat_split_gradient_is_dense_as_tensorflows():
    r = np.random.default_rng(0)
    z = tf.constant(r.standard_normal((3, 2, 4)).astype(np.float32))
    x = tf.constant(r.standard_normal((3, 2, 4)).astype(np.float32))
    f = lambda e: tf.split(tf.concat([e[0], e[1]], -1), [4, 4], axis=-1)[0]  # noqa: E731
    results = []
    for Tape, vmap in ((tf.GradientTape, tf.vectorized_map), (oh.GradientTape,
                                                              oh.vectorized_map),
                       (tf.GradientTape, oh.vectorized_map)):
        with Tape() as t:
            t.watch(z)
            out = vmap(f, (z, x))
        results.append([out, t.gradient(out, z)])
    _same(results[0], results[1], "tape over vectorized_map, concat then split")
    _same(results[0], results[2], "tf tape over oh.vectorized_map, concat then split")
    assert not isinstance(results[0][1], tf.IndexedSlices)


def test_tape_over_vmap_looped_gather_eagerly_after_a_traced_one():
    # Fuzz finding (OH_FUZZ_SEED=11, order-dependent): the per-op while-loop function of
    # a ResourceGather was cached across eager and traced use; differentiated first while
    # a tf.function was traced, its gradient functions had outputs of unknown shape, and
    # a later eager gradient through it raised ValueError ("Cannot convert a partially
    # known TensorShape"). The cache is keyed by eagerness now. Both orders.
    traced, eager = Program(12066, (4, 10)), Program(12092, (4, 10))
    _run_case("GradientTape/vectorized_map", traced, "function", [3], True)
    _run_case("GradientTape/vectorized_map", eager, "eager", [3], True)
    _run_case("GradientTape/vectorized_map", eager, "eager", [2], False)
    _run_case("GradientTape/vectorized_map", traced, "function", [2], False)
