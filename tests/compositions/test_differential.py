"""Randomized differential tests: random op programs under
oh.GradientTape, oh.ForwardAccumulator and oh.vectorized_map against tf.GradientTape,
tf.autodiff.ForwardAccumulator and tf.vectorized_map.

Each program is a random composition of common ops (elementwise unary and binary ops with
broadcasting, matmul, reductions, reshapes, transposes, concatenations, gathers from
variables — sparse gradients —, where, softmax, small convolutions and pools, erf, top-k,
cumsum, tf.TensorArray writes and reads, ...). It runs eagerly or inside a fresh `tf.function`, the handler's run and
TensorFlow's in a random order, and all cases of the three handlers are interleaved in one
random order in the process, so a cache filled by one case and reused by another shows.
Values are compared with a tolerance; gradient types (dense or tf.IndexedSlices, or
None), dtypes and shapes exactly.

`make test` runs a smaller draw whose seed changes from run to run (tests/fuzz_seed.py);
the fixed draw of the default seed is marked slow. A failure prints the command that
replays it: OH_FUZZ_SEED=<seed> for the rotating draw, OH_DIFFERENTIAL_SEED=<seed> for the
fixed ones, e.g.
    OH_DIFFERENTIAL_SEED=<seed> pytest tests/compositions/test_differential.py
"""
import os
import random

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from fuzz_seed import replay, run_seed

SEED = int(os.environ.get("OH_DIFFERENTIAL_SEED", "16"))
FAST_PROGRAMS = 50  # per handler, in `make test` (the run's rotating draw), as DEFAULT_PROGRAMS
DEFAULT_PROGRAMS = 200  # per handler, the default seed's draw: 2 to 5 ops, a quarter in functions (marked slow)
SLOW_PROGRAMS = 60  # per handler, longer (3 to 9 ops), 40% in functions (marked slow)


# -- the ops: name -> (applicable(shapes of the pool) -> candidates, build) ----------------
# A step is (op name, argument slots, params); params are drawn when the program is made.

def _rank(s):
    return len(s)


def _size(s):
    return int(np.prod(s)) if s else 1


UNARY = {
    "sin": tf.sin, "cos": tf.cos, "tanh": tf.tanh, "sigmoid": tf.sigmoid,
    "relu": tf.nn.relu, "softplus": tf.nn.softplus, "erf": tf.math.erf,
    "square": tf.square, "neg": tf.negative, "abs": tf.abs, "elu": tf.nn.elu,
    "leaky_relu": tf.nn.leaky_relu,
    "exp_tanh": lambda a: tf.exp(tf.tanh(a)),
    "log1p_sq": lambda a: tf.math.log1p(a * a),
    "sqrt_sq1": lambda a: tf.sqrt(a * a + 1.0),
    "rsqrt_sq1": lambda a: tf.math.rsqrt(a * a + 1.0),
    "reciprocal_sq1": lambda a: tf.math.reciprocal(a * a + 1.0),
    "clip": lambda a: tf.clip_by_value(a, -0.7, 0.7),
    "via_float64": lambda a: tf.cast(tf.sin(tf.cast(a, tf.float64)), tf.float32),
    "stop_gradient_mix": lambda a: tf.stop_gradient(a) * a,
}

BINARY = {
    "add": tf.add, "sub": tf.subtract, "mul": tf.multiply,
    "div": lambda a, b: a / (b * b + 1.0),
    "maximum": tf.maximum, "minimum": tf.minimum,
    "squared_difference": tf.math.squared_difference,
    "where": lambda a, b: tf.where(a > 0.0, a, b),
}


def _reduce(kind):
    fn = {"sum": tf.reduce_sum, "mean": tf.reduce_mean, "max": tf.reduce_max,
          "logsumexp": tf.reduce_logsumexp}[kind]
    return lambda a, axis, keepdims: fn(a, axis=axis, keepdims=keepdims)


def _gather_var(var):
    return lambda ids: tf.gather(var, ids)


class Program:
    """A random op program over the inputs x [3, 4], y [4], img [1, 5, 5, 2] and the
    captured variables V [6, 4] (gathered: sparse gradients) and W [4, 4], kernel [3, 3, 2, 3]."""

    INPUTS = ("x", "y", "img")

    def __init__(self, seed, lengths=(2, 5)):
        self.seed = seed
        rng = random.Random(seed)
        nrng = np.random.default_rng(seed)
        self.values = {
            "x": nrng.standard_normal((3, 4)).astype(np.float32),
            "y": nrng.standard_normal((4,)).astype(np.float32),
            "img": nrng.standard_normal((1, 5, 5, 2)).astype(np.float32),
        }
        self.var_values = {
            "V": nrng.standard_normal((6, 4)).astype(np.float32),
            "W": nrng.standard_normal((4, 4)).astype(np.float32) * 0.5,
            "kernel": nrng.standard_normal((3, 3, 2, 3)).astype(np.float32) * 0.3,
        }
        self.tangents = {k: nrng.standard_normal(v.shape).astype(np.float32)
                         for k, v in list(self.values.items()) + list(self.var_values.items())}
        self.batch = {k: nrng.standard_normal((3,) + v.shape).astype(np.float32)
                      for k, v in self.values.items()}
        self.steps = []
        shapes = [v.shape for v in self.values.values()]
        for _ in range(rng.randint(*lengths)):
            step, shape = self._draw(rng, shapes)
            self.steps.append(step)
            shapes.append(shape)
        n = len(shapes)
        others = [i for i in range(3, n - 1)]
        self.outputs = [n - 1] + ([rng.choice(others)] if others and rng.random() < 0.6 else [])
        self.shapes = shapes

    # -- drawing steps ------------------------------------------------------------------

    def _draw(self, rng, shapes):
        """One step (name, args, params) applicable to the pool, and its output shape."""
        while True:
            kind = rng.choice([
                "unary", "unary", "unary", "binary", "binary", "binary", "matmul", "reduce",
                "reshape", "transpose", "concat", "gather_var", "gather_var", "gather_var",
                "gather", "softmax",
                "log_softmax", "conv2d", "max_pool", "avg_pool", "top_k", "cumsum", "slice",
                "tile", "pad", "expand_squeeze", "matmul_var", "tensor_array"])
            found = getattr(self, "_draw_" + kind)(rng, shapes)
            if found is not None:
                step, shape = found
                return step, tuple(int(d) for d in shape)

    @staticmethod
    def _pick(rng, shapes, ok=lambda s: True, recent=True):
        """A slot whose shape satisfies `ok`, preferring recent ones (deeper programs)."""
        slots = [i for i, s in enumerate(shapes) if ok(s)]
        if not slots:
            return None
        if recent and rng.random() < 0.6:
            return slots[-1]
        return rng.choice(slots)

    def _draw_unary(self, rng, shapes):
        name = rng.choice(sorted(UNARY))
        a = self._pick(rng, shapes)
        return ("unary", [a], {"fn": name}), shapes[a]

    def _draw_binary(self, rng, shapes):
        name = rng.choice(sorted(BINARY))
        a = self._pick(rng, shapes)
        sa = shapes[a]
        cands = []
        for i, s in enumerate(shapes):
            try:
                if i != a and np.broadcast_shapes(sa, s) == tuple(sa):
                    cands.append(i)
            except ValueError:
                pass
        if cands and rng.random() < 0.8:
            b = rng.choice(cands)
            if rng.random() < 0.3:
                a, b = b, a  # broadcasting on the left
                out = np.broadcast_shapes(shapes[a], shapes[b])
            else:
                out = sa
            return ("binary", [a, b], {"fn": name}), out
        return ("binary", [a, a], {"fn": name}), sa

    def _draw_matmul(self, rng, shapes):
        a = self._pick(rng, shapes, lambda s: _rank(s) == 2)
        if a is None:
            return None
        m, k = shapes[a]
        b = self._pick(rng, shapes, lambda s: _rank(s) == 2 and s[0] == k, recent=False)
        if b is None:
            return ("matmul_self", [a], {}), (m, m)
        return ("matmul", [a, b], {}), (m, shapes[b][1])

    def _draw_matmul_var(self, rng, shapes):
        a = self._pick(rng, shapes, lambda s: _rank(s) >= 1 and s[-1] == 4)
        if a is None:
            return None
        return ("matmul_var", [a], {}), shapes[a]

    def _draw_reduce(self, rng, shapes):
        a = self._pick(rng, shapes, lambda s: _rank(s) >= 1)
        if a is None:
            return None
        s = shapes[a]
        axis = rng.randrange(_rank(s))
        keepdims = rng.random() < 0.4 or _rank(s) == 1
        kind = rng.choice(["sum", "mean", "max", "logsumexp"])
        out = list(s)
        if keepdims:
            out[axis] = 1
        else:
            del out[axis]
        return ("reduce", [a], {"kind": kind, "axis": axis, "keepdims": keepdims}), out

    def _draw_reshape(self, rng, shapes):
        a = self._pick(rng, shapes, lambda s: _size(s) > 1)
        if a is None:
            return None
        n = _size(shapes[a])
        divisors = [d for d in range(2, n) if n % d == 0]
        if divisors and rng.random() < 0.7:
            d = rng.choice(divisors)
            return ("reshape", [a], {"shape": [n // d, d]}), (n // d, d)
        return ("reshape", [a], {"shape": [n]}), (n,)

    def _draw_transpose(self, rng, shapes):
        a = self._pick(rng, shapes, lambda s: _rank(s) >= 2)
        if a is None:
            return None
        perm = list(range(_rank(shapes[a])))
        rng.shuffle(perm)
        return ("transpose", [a], {"perm": perm}), [shapes[a][p] for p in perm]

    def _draw_concat(self, rng, shapes):
        a = self._pick(rng, shapes, lambda s: _rank(s) >= 1)
        if a is None:
            return None
        s = shapes[a]
        axis = rng.randrange(_rank(s))
        cands = [i for i, t in enumerate(shapes) if _rank(t) == _rank(s) and all(
            t[j] == s[j] for j in range(_rank(s)) if j != axis)]
        b = rng.choice(cands)
        out = list(s)
        out[axis] += shapes[b][axis]
        return ("concat", [a, b], {"axis": axis}), out

    def _draw_gather_var(self, rng, shapes):
        ids = [rng.randrange(6) for _ in range(rng.randint(1, 4))]
        return ("gather_var", [], {"ids": ids}), (len(ids), 4)

    def _draw_gather(self, rng, shapes):
        a = self._pick(rng, shapes, lambda s: _rank(s) >= 1)
        if a is None:
            return None
        s = shapes[a]
        ids = [rng.randrange(s[0]) for _ in range(rng.randint(1, 3))]
        return ("gather", [a], {"ids": ids}), [len(ids)] + list(s[1:])

    def _draw_softmax(self, rng, shapes):
        a = self._pick(rng, shapes, lambda s: _rank(s) >= 1)
        return None if a is None else (("softmax", [a], {}), shapes[a])

    def _draw_log_softmax(self, rng, shapes):
        a = self._pick(rng, shapes, lambda s: _rank(s) >= 1)
        return None if a is None else (("log_softmax", [a], {}), shapes[a])

    def _draw_conv2d(self, rng, shapes):
        a = self._pick(rng, shapes, lambda s: _rank(s) == 4 and s[-1] == 2 and s[0] == 1)
        if a is None:
            return None
        s = shapes[a]
        padding = rng.choice(["SAME", "VALID"])
        if padding == "VALID" and (s[1] < 3 or s[2] < 3):
            padding = "SAME"
        out = (1, s[1], s[2], 3) if padding == "SAME" else (1, s[1] - 2, s[2] - 2, 3)
        return ("conv2d", [a], {"padding": padding}), out

    def _pool(self, name, rng, shapes):
        a = self._pick(rng, shapes, lambda s: _rank(s) == 4 and s[1] >= 2 and s[2] >= 2)
        if a is None:
            return None
        s = shapes[a]
        stride = rng.choice([1, 2])
        out = (s[0], s[1] - 1, s[2] - 1, s[3]) if stride == 1 else (
            s[0], -(-s[1] // 2), -(-s[2] // 2), s[3])
        return (name, [a], {"stride": stride}), out

    def _draw_max_pool(self, rng, shapes):
        return self._pool("max_pool", rng, shapes)

    def _draw_avg_pool(self, rng, shapes):
        return self._pool("avg_pool", rng, shapes)

    def _draw_top_k(self, rng, shapes):
        a = self._pick(rng, shapes, lambda s: _rank(s) >= 1 and s[-1] >= 2)
        if a is None:
            return None
        k = rng.randint(1, min(3, shapes[a][-1]))
        return ("top_k", [a], {"k": k}), tuple(shapes[a][:-1]) + (k,)

    def _draw_cumsum(self, rng, shapes):
        a = self._pick(rng, shapes, lambda s: _rank(s) >= 1)
        if a is None:
            return None
        return ("cumsum", [a], {"axis": rng.randrange(_rank(shapes[a])),
                                "exclusive": rng.random() < 0.3,
                                "reverse": rng.random() < 0.3}), shapes[a]

    def _draw_slice(self, rng, shapes):
        a = self._pick(rng, shapes, lambda s: _rank(s) >= 1 and s[-1] >= 2)
        if a is None:
            return None
        n = rng.randint(1, shapes[a][-1] - 1)
        return ("slice", [a], {"n": n}), tuple(shapes[a][:-1]) + (n,)

    def _draw_tile(self, rng, shapes):
        a = self._pick(rng, shapes, lambda s: 1 <= _rank(s) and _size(s) <= 64)
        if a is None:
            return None
        return ("tile", [a], {}), (2 * shapes[a][0],) + tuple(shapes[a][1:])

    def _draw_pad(self, rng, shapes):
        a = self._pick(rng, shapes, lambda s: _rank(s) >= 1)
        if a is None:
            return None
        return ("pad", [a], {}), tuple(shapes[a][:-1]) + (shapes[a][-1] + 2,)

    def _draw_tensor_array(self, rng, shapes):
        # Two values of one shape written into a tf.TensorArray (TensorList ops in a
        # function; a Python list eagerly), stacked and one read back.
        a = self._pick(rng, shapes, lambda s: 1 <= _rank(s) <= 3 and _size(s) <= 64)
        if a is None:
            return None
        b = self._pick(rng, shapes, lambda s: s == shapes[a])
        return ("tensor_array", [a, b], {"read": rng.randrange(2)}), (2,) + tuple(shapes[a])

    def _draw_expand_squeeze(self, rng, shapes):
        a = self._pick(rng, shapes)
        return ("expand_squeeze", [a], {}), shapes[a]

    # -- running -------------------------------------------------------------------------

    def run(self, args, variables):
        """The outputs of the program on `args` (x, y, img)."""
        slots = list(args)
        V, W, kernel = variables
        for name, idx, p in self.steps:
            a = [slots[i] for i in idx]
            if name == "unary":
                out = UNARY[p["fn"]](a[0])
            elif name == "binary":
                out = BINARY[p["fn"]](a[0], a[1])
            elif name == "matmul":
                out = tf.matmul(a[0], a[1])
            elif name == "matmul_self":
                out = tf.matmul(a[0], a[0], transpose_b=True)
            elif name == "matmul_var":
                out = tf.tensordot(a[0], W, 1) if len(a[0].shape) != 2 else tf.matmul(a[0], W)
            elif name == "reduce":
                out = _reduce(p["kind"])(a[0], p["axis"], p["keepdims"])
            elif name == "reshape":
                out = tf.reshape(a[0], p["shape"])
            elif name == "transpose":
                out = tf.transpose(a[0], p["perm"])
            elif name == "concat":
                out = tf.concat([a[0], a[1]], p["axis"])
            elif name == "gather_var":
                out = tf.gather(V, p["ids"])
            elif name == "gather":
                out = tf.gather(a[0], p["ids"])
            elif name == "softmax":
                out = tf.nn.softmax(a[0])
            elif name == "log_softmax":
                out = tf.nn.log_softmax(a[0])
            elif name == "conv2d":
                out = tf.nn.conv2d(a[0], kernel, 1, p["padding"])
            elif name == "max_pool":
                out = tf.nn.max_pool2d(a[0], 2, p["stride"], "VALID" if p["stride"] == 1
                                       else "SAME")
            elif name == "avg_pool":
                out = tf.nn.avg_pool2d(a[0], 2, p["stride"], "VALID" if p["stride"] == 1
                                       else "SAME")
            elif name == "top_k":
                out = tf.math.top_k(a[0], p["k"]).values
            elif name == "cumsum":
                out = tf.cumsum(a[0], p["axis"], exclusive=p["exclusive"],
                                reverse=p["reverse"])
            elif name == "slice":
                out = a[0][..., :p["n"]]
            elif name == "tile":
                out = tf.tile(a[0], [2] + [1] * (len(a[0].shape) - 1))
            elif name == "pad":
                out = tf.pad(a[0], [[0, 0]] * (len(a[0].shape) - 1) + [[1, 1]])
            elif name == "tensor_array":
                ta = tf.TensorArray(tf.float32, size=2, element_shape=a[0].shape)
                ta = ta.write(0, a[0]).write(1, tf.tanh(a[1]))
                stacked = ta.stack()  # (before the read: an eager TensorArray clears it)
                out = stacked * 0.5 + ta.read(p["read"])[None]
            elif name == "expand_squeeze":
                out = tf.squeeze(tf.expand_dims(a[0], 0) * 1.5, [0])
            else:
                raise AssertionError(name)
            slots.append(out)
        return [slots[i] for i in self.outputs]

    def describe(self):
        names = list(self.INPUTS)
        lines = ["program seed %d: inputs x %s, y %s, img %s; variables V [6, 4] (gathered), "
                 "W [4, 4], kernel [3, 3, 2, 3]" % (self.seed, self.shapes[0], self.shapes[1],
                                                    self.shapes[2])]
        for k, (name, idx, p) in enumerate(self.steps):
            slot = "t%d" % (k + 3)
            names.append(slot)
            label = p.get("fn", name)
            params = {key: v for key, v in p.items() if key != "fn"}
            lines.append("  %s = %s(%s)%s  # %s" % (
                slot, label, ", ".join(names[i] for i in idx),
                " " + str(params) if params else "", list(self.shapes[k + 3])))
        lines.append("  outputs: %s" % ", ".join(names[i] for i in self.outputs))
        return "\n".join(lines)

    # -- fresh inputs (variables are new for every run: their state is not shared) ----

    def make_args(self, batched=False):
        src = self.batch if batched else self.values
        return [tf.constant(src[k]) for k in self.INPUTS]

    def make_variables(self):
        return [tf.Variable(self.var_values[k], name=k) for k in ("V", "W", "kernel")]


# -- comparisons -------------------------------------------------------------------------

def _close(ref, got, what):
    ref, got = np.asarray(ref), np.asarray(got)
    assert ref.dtype == got.dtype, "%s: dtype %s, expected %s" % (what, got.dtype, ref.dtype)
    assert ref.shape == got.shape, "%s: shape %s, expected %s" % (what, got.shape, ref.shape)
    finite = np.isfinite(ref)
    scale = 1.0 + (np.max(np.abs(ref[finite])) if finite.any() else 0.0)
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4 * scale, err_msg=what)


def _same(ref, got, what):
    """Same structure, None pattern, type (dense or IndexedSlices), dtype, shape, values."""
    ref_flat = tf.nest.flatten(ref, expand_composites=False)
    got_flat = tf.nest.flatten(got, expand_composites=False)
    assert len(ref_flat) == len(got_flat), "%s: %d results, expected %d" % (
        what, len(got_flat), len(ref_flat))
    for i, (r, g) in enumerate(zip(ref_flat, got_flat)):
        w = "%s[%d]" % (what, i)
        if r is None:
            assert g is None, "%s: %r, expected None" % (w, g)
            continue
        assert g is not None, "%s: None, expected %s" % (w, type(r).__name__)
        assert isinstance(g, tf.IndexedSlices) == isinstance(r, tf.IndexedSlices), (
            "%s: %s, expected %s" % (w, type(g).__name__, type(r).__name__))
        if isinstance(r, tf.IndexedSlices):
            assert g.values.dtype == r.values.dtype and g.indices.dtype == r.indices.dtype, w
            assert sorted(g.indices.numpy().tolist()) == sorted(r.indices.numpy().tolist()), (
                "%s: indices %s, expected %s" % (w, g.indices.numpy(), r.indices.numpy()))
        _close(tf.convert_to_tensor(r), tf.convert_to_tensor(g), w)


# -- one case per handler ----------------------------------------------------------------

def _maybe_function(fn, mode):
    return tf.function(fn, autograph=False) if mode == "function" else fn


def _gradients(program, tape_type, mode):
    args = program.make_args()
    variables = program.make_variables()
    fn = _maybe_function(lambda *a: program.run(a, variables), mode)
    with tape_type(persistent=True) as tape:
        tape.watch(args)
        outs = fn(*args)
    sources = args + [variables[0], variables[1], variables[2]]
    grads = tape.gradient(outs, sources)
    # A second target alone: gradients of one output only.
    first = tape.gradient(outs[0], sources)
    return outs, grads, first


def _jvps(program, acc_type, mode):
    args = program.make_args()
    variables = program.make_variables()
    fn = _maybe_function(lambda *a: program.run(a, variables), mode)
    primals = args + variables
    tangents = [tf.constant(program.tangents[k]) for k in
                ("x", "y", "img", "V", "W", "kernel")]
    with acc_type(primals, tangents) as acc:
        outs = fn(*args)
    return outs, acc.jvp(outs)


def _vmapped(program, vmap, mode):
    args = program.make_args(batched=True)
    variables = program.make_variables()
    fn = _maybe_function(lambda x, y, img: program.run((x, y, img), variables), mode)
    if vmap is tf.vectorized_map:
        return tf.vectorized_map(lambda e: program.run(e, variables), tuple(args))
    return oh.vectorized_map(lambda e: fn(*e), tuple(args))


HANDLERS = {
    "GradientTape": (_gradients, tf.GradientTape, oh.GradientTape),
    "ForwardAccumulator": (_jvps, tf.autodiff.ForwardAccumulator, oh.ForwardAccumulator),
    "vectorized_map": (_vmapped, tf.vectorized_map, oh.vectorized_map),
}


def _run_case(handler, program, mode, ours_first, around=None):
    """`around`: None, or ("outside"|"inside", handler factory): our run also has that
    handler open, around or inside the handler tested."""
    run, ref_type, our_type = HANDLERS[handler]
    order = [(our_type, "oh"), (ref_type, "tf")]
    if not ours_first:
        order.reverse()
    results = {}
    for kind, label in order:
        if label == "oh" and around is not None:
            results[label] = _run_with(around, lambda: run(program, kind, mode), kind)
        elif label == "tf":
            try:
                results[label] = run(program, kind, mode)
            except TypeError as e:
                if not _tensorflow_cannot(handler, program, mode, e):
                    raise
                results[label] = None
        else:
            results[label] = run(program, kind, mode)
    if results["tf"] is None:  # nothing to compare with: ours must at least run
        return "TensorFlow fails"
    _same(results["tf"], results["oh"], "%s %s" % (handler, mode))
    return None


def _tensorflow_cannot(handler, program, mode, error):
    """TensorFlow's own tf.autodiff.ForwardAccumulator fails to trace some tf.functions
    writing a TensorArray (`TypeError: dtype <dtype: 'variant'> is not compatible with 1
    of dtype int64`, e.g. OH_DIFFERENTIAL_SEED=16, program seed 16050092, in the slow
    test); oh.ForwardAccumulator runs them. Only that known failure is excused."""
    return (handler == "ForwardAccumulator" and mode == "function"
            and any(step[0] == "tensor_array" for step in program.steps)
            and "variant" in str(error))


AROUND = {"OpHandler": oh.OpHandler, "OpLogHandler": oh.OpLogHandler,
          "CheckNumericsHandler": lambda: oh.CheckNumericsHandler(
              op_types_to_skip=("Exp", "Softplus", "Elu", "Square", "Mul", "Cumsum"))}


def _run_with(around, call, kind):
    place, name = around
    if place == "outside":
        with AROUND[name]():
            return call()
    # Inside: the other handler is opened within the handler tested (its scope opens in
    # `call`), by wrapping the program's run.
    original = Program.run

    def run(self, args, variables):
        with AROUND[name]():
            return original(self, args, variables)
    Program.run = run
    try:
        return call()
    finally:
        Program.run = original


def _cases(count, first_seed, rng, function_share):
    cases = []
    for h, handler in enumerate(sorted(HANDLERS)):
        for i in range(count):
            seed = first_seed + 100000 * h + i
            mode = "function" if rng.random() < function_share else "eager"
            around = None
            if rng.random() < 0.3:  # another handler open too, in either nesting order
                around = (rng.choice(["outside", "inside"]), rng.choice(sorted(AROUND)))
            cases.append((handler, seed, mode, rng.random() < 0.5, around))
    rng.shuffle(cases)
    return cases


def _run_all(cases, lengths, command):
    """Runs `cases`; a failure names `command`, which replays them."""
    failures = []
    excused = 0
    for handler, seed, mode, ours_first, around in cases:
        program = Program(seed, lengths)
        try:
            if _run_case(handler, program, mode, ours_first, around) is not None:
                excused += 1
        except Exception as e:  # pylint: disable=broad-except
            failures.append(
                "%s, %s, %s first%s:\n%s\n%s: %s" % (
                    handler, mode, "oh" if ours_first else "tf",
                    "" if around is None else ", %s %s" % (around[1], around[0]),
                    program.describe(), type(e).__name__, str(e)[:2000]))
    assert not failures, "%d of %d cases differ from TensorFlow (replay: %s):\n\n%s" % (
        len(failures), len(cases), command, "\n\n".join(failures[:10]))
    # The excuse must stay rare: a change that made TensorFlow's reference fail often
    # would otherwise pass unnoticed.
    assert excused <= max(1, len(cases) // 50), (excused, len(cases))


def test_random_programs_match_tensorflow(request):
    """FAST_PROGRAMS programs per handler, all handlers interleaved in one random order,
    drawn from the run's seed."""
    seed = run_seed()
    _run_all(_cases(FAST_PROGRAMS, seed * 1000003, random.Random(seed), 0.25), (2, 5),
             replay(request.node.nodeid, seed))


@pytest.mark.slow
def test_default_random_programs_match_tensorflow(request):
    """The default seed's draw: DEFAULT_PROGRAMS programs per handler."""
    _run_all(_cases(DEFAULT_PROGRAMS, SEED * 1000003, random.Random(SEED), 0.25), (2, 5),
             "OH_DIFFERENTIAL_SEED=%d python -m pytest %s" % (SEED, request.node.nodeid))


@pytest.mark.slow
def test_more_random_programs_match_tensorflow(request):
    _run_all(_cases(SLOW_PROGRAMS, SEED * 1000003 + 50000, random.Random(SEED + 1), 0.4),
             (3, 9), "OH_DIFFERENTIAL_SEED=%d python -m pytest %s" % (SEED, request.node.nodeid))
