"""Randomized differential tests of oh.vectorized_map for what test_differential.py does
not draw: composite elements and outputs (tf.RaggedTensor, tf.SparseTensor, a
BatchableExtensionType), unit leading dimensions that broadcast between elements, and
per-example control flow (tf.cond, tf.switch_case, tf.while_loop with per-example trip
counts, nested in each other) mixed with elementwise, matmul and reduce steps.

Each program is a random per-example function over the elements x [4] and m [3, 4]
(either may have leading dimension 1 instead of the batch: it broadcasts), optionally a
ragged r [2, None] (5 values per example, row lengths differing between examples), a
sparse s [3, 4] (4 values per example) and a Masked k (values and mask [4]), and the
captured variable W [4, 4]. It runs as a plain Python function (eager control flow), as
a tf.function `fn` (replayed by the map) or with the whole map inside a fresh
tf.function. Compared with TensorFlow: the outputs (values, dtypes, shapes; composite
outputs by their components) of oh.vectorized_map with no tape, and the outputs and
gradients (None pattern, dtype, shape, values) with respect to x, m, k's values and W
of oh.GradientTape around oh.vectorized_map (ragged and sparse element values are held
constant, see `_no_gradient`; a sparse output is not differentiated, see `_loss`).

The reference is tf.vectorized_map under tf.GradientTape, except where TensorFlow 2.21's
own vectorized_map cannot run the program (`Program.loop_reason` names each failure it
sidesteps); there it is the map as a Python loop of per-example calls, stacked (what
tf.map_fn computes; tf.map_fn itself fails on some of them, see `_reference`). Against
the loop, a gradient TensorFlow leaves None (a source used only in branches no example
takes) may be zeros, as tf.vectorized_map gives it. A program tf.vectorized_map cannot run
is not run inside a fresh tf.function (there oh.vectorized_map is tf.vectorized_map).
The draw must cover every kind of element, step, mode and reference (`FEATURES`).

`make test` runs a smaller draw whose seed changes from run to run (tests/fuzz_seed.py);
the fixed draws of the default seed are marked slow (that the default draw covers
`FEATURES` is checked in `make test`, without running it). A failure prints the command
that replays it: OH_FUZZ_SEED=<seed> for the rotating draw, OH_VMAP_DIFFERENTIAL_SEED=<seed>
for the fixed ones, e.g.
    OH_VMAP_DIFFERENTIAL_SEED=<seed> pytest tests/handlers/vectorized_map/test_vectorized_map_differential.py
"""
import os
import random

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from fuzz_seed import replay, run_seed
from test_differential import BINARY, UNARY

DEFAULT_SEED = 40
SEED = int(os.environ.get("OH_VMAP_DIFFERENTIAL_SEED", DEFAULT_SEED))
BATCH = 3
FAST_PROGRAMS = 6  # in `make test` (the run's rotating draw), as DEFAULT_PROGRAMS
DEFAULT_PROGRAMS = 12  # 2 to 4 steps, the default seed's draw (marked slow)
SLOW_PROGRAMS = 60  # 3 to 8 steps, deeper nesting (marked slow)
# Unary ops whose values stay bounded and whose gradients stay finite when a loop body
# repeats them (a loop's body is followed by tanh too).
LOOP_UNARY = sorted(k for k in UNARY if k not in ("square", "exp_tanh"))


class Masked(tf.experimental.BatchableExtensionType):
    values: tf.Tensor
    mask: tf.Tensor


def _broadcasts_into(small, big):
    try:
        return np.broadcast_shapes(tuple(small), tuple(big)) == tuple(big)
    except ValueError:
        return False


def _no_gradient(values):
    """The values of a ragged or sparse element, without a gradient through the map.
    oh.GradientTape around oh.vectorized_map cannot differentiate them yet: a ragged
    element's raises InvalidArgumentError "AddN of non-scalar Tensor with
    dtype=DT_VARIANT" (the gradients of the element's batched variant are summed), a
    sparse element's LookupError "op DeserializeSparse has no registered gradient".
    Their values are still compared, and every other gradient."""
    return tf.stop_gradient(values)


# -- per-example control flow: expressions of one value, drawn recursively ----------------
# A node maps a dense value v to a value of v's shape; `captures` are the program's slots.

def _draw_node(rng, shape, slots, depth):
    """A random node for a value of `shape`; control flow only while depth > 0."""
    kinds = ["unary", "unary", "binary", "binary", "seq"]
    if shape and shape[-1] == 4:
        kinds.append("matvec_var")
    if depth > 0:
        kinds += ["cond", "switch", "while"]
    kind = rng.choice(kinds)
    if kind == "unary":
        return ("unary", rng.choice(LOOP_UNARY))
    if kind == "binary":
        cands = [i for i, s in enumerate(slots)
                 if s[0] == "dense" and _broadcasts_into(s[1], shape)]
        return ("binary", rng.choice(sorted(BINARY)), rng.choice(cands) if cands else None)
    if kind == "matvec_var":
        return ("matvec_var",)
    if kind == "seq":
        return ("seq", [_draw_node(rng, shape, slots, depth) for _ in range(2)])
    threshold = rng.choice([-0.5, 0.0, 0.5])
    if kind == "cond":
        branches = [_draw_node(rng, shape, slots, depth - 1) for _ in range(2)]
        return ("cond", threshold, branches[0], branches[1])
    if kind == "switch":
        return ("switch", [_draw_node(rng, shape, slots, depth - 1)
                           for _ in range(rng.randint(2, 3))])
    # A per-example trip count (0 to 3) from the value entering the loop, or a condition
    # on the loop value itself (bounded by maximum_iterations).
    return ("while", rng.choice(["count", "value"]),
            _draw_node(rng, shape, slots, depth - 1))


def _node_has(node, kinds):
    if node[0] in kinds:
        return True
    return any(_node_has(c, kinds) for c in _children(node))


def _children(node):
    if node[0] == "seq":
        return node[1]
    if node[0] == "cond":
        return [node[2], node[3]]
    if node[0] == "switch":
        return node[1]
    if node[0] == "while":
        return [node[2]]
    return []


def _nesting(node):
    """How deep control flow nests in `node` (1: a cond, switch or while with none in it)."""
    inner = max([_nesting(c) for c in _children(node)] or [0])
    return inner + (1 if node[0] in ("cond", "switch", "while") else 0)


def _run_node(node, v, slots, W):
    kind = node[0]
    if kind == "unary":
        return UNARY[node[1]](v)
    if kind == "binary":
        other = v if node[2] is None else slots[node[2]]
        return BINARY[node[1]](v, other)
    if kind == "matvec_var":
        return tf.tanh(tf.tensordot(v, W, 1))
    if kind == "seq":
        for child in node[1]:
            v = _run_node(child, v, slots, W)
        return v
    if kind == "cond":
        return tf.cond(tf.reduce_sum(v) > node[1], lambda: _run_node(node[2], v, slots, W),
                       lambda: _run_node(node[3], v, slots, W))
    if kind == "switch":
        n = len(node[1])
        index = tf.cast(tf.clip_by_value(tf.floor(tf.reduce_mean(v) * 2. + 1.), 0., n - 1.),
                        tf.int32)
        return tf.switch_case(index, [
            (lambda c=c: _run_node(c, v, slots, W)) for c in node[1]])
    if kind == "while":
        body = lambda i, y: (i + 1, tf.tanh(_run_node(node[2], y, slots, W)))  # noqa: E731
        if node[1] == "count":
            n = tf.cast(tf.clip_by_value(tf.floor(tf.abs(tf.reduce_sum(v))), 0., 3.), tf.int32)
            return tf.while_loop(lambda i, y: i < n, body, (tf.constant(0), v))[1]
        return tf.while_loop(lambda i, y: tf.reduce_sum(y) < 0.5, body, (tf.constant(0), v),
                             maximum_iterations=3)[1]
    raise AssertionError(kind)


def _describe_node(node, names):
    kind = node[0]
    if kind == "unary":
        return node[1]
    if kind == "binary":
        return "%s(., %s)" % (node[1], "." if node[2] is None else names[node[2]])
    if kind == "matvec_var":
        return "tanh(. @ W)"
    if kind == "seq":
        return " |> ".join(_describe_node(c, names) for c in node[1])
    if kind == "cond":
        return "cond(sum > %s, [%s], [%s])" % (node[1], _describe_node(node[2], names),
                                               _describe_node(node[3], names))
    if kind == "switch":
        return "switch(%s)" % ", ".join("[%s]" % _describe_node(c, names) for c in node[1])
    return "while_%s([%s] |> tanh)" % (node[1], _describe_node(node[2], names))


# -- programs ------------------------------------------------------------------------------

class Program:
    """A random per-example function over the elements, and how to build them."""

    def __init__(self, seed, lengths=(2, 5), depth=2):
        self.seed = seed
        rng = random.Random(seed)
        nrng = np.random.default_rng(seed)
        self.depth = depth
        # Elements. Dense ones may have a unit leading dimension (at least one keeps the
        # batch when no composite element is there).
        self.composites = [c for c in ("r", "s", "k") if rng.random() < 0.2]
        self.unit = [name for name in ("x", "m") if rng.random() < 0.3]
        if len(self.unit) == 2 and not self.composites:
            self.unit = [rng.choice(self.unit)]
        self.values = {}
        for name, shape in (("x", (4,)), ("m", (3, 4))):
            lead = 1 if name in self.unit else BATCH
            self.values[name] = nrng.standard_normal((lead,) + shape).astype(np.float32)
        # r: 5 values per example in 2 non-empty rows of lengths differing per example.
        self.row_lengths = [rng.choice([[1, 4], [2, 3], [3, 2], [4, 1]]) for _ in range(BATCH)]
        self.values["r"] = nrng.standard_normal((BATCH * 5,)).astype(np.float32)
        # s: 4 values per example at sorted positions of a [3, 4] example.
        self.sparse_indices = []
        for b in range(BATCH):
            for flat in sorted(rng.sample(range(12), 4)):
                self.sparse_indices.append([b, flat // 4, flat % 4])
        self.values["s"] = nrng.standard_normal((BATCH * 4,)).astype(np.float32)
        self.values["k"] = nrng.standard_normal((BATCH, 4)).astype(np.float32)
        self.mask = nrng.random((BATCH, 4)) < 0.6
        self.W = (nrng.standard_normal((4, 4)) * 0.5).astype(np.float32)

        # Slots: ("dense", shape), ("ragged", rows, values, uniform), ("sparse", shape),
        # ("masked",).
        self.inputs = ["x", "m"] + self.composites
        # (A ragged slot: rows, values, whether its rows have one length in every example.)
        kinds = {"x": ("dense", (4,)), "m": ("dense", (3, 4)), "r": ("ragged", 2, 5, False),
                 "s": ("sparse", (3, 4)), "k": ("masked",)}
        slots = [kinds[name] for name in self.inputs]
        self.steps = []
        for _ in range(rng.randint(*lengths)):
            step, kind = self._draw(rng, slots)
            self.steps.append(step)
            slots.append(kind)
        self.slots = slots
        dense = [i for i, s in enumerate(slots) if s[0] == "dense"]
        last_dense = dense[-1]
        self.outputs = [last_dense]
        others = [i for i in dense if i >= len(self.inputs) and i != last_dense]
        if others and rng.random() < 0.5:
            self.outputs.append(rng.choice(others))
        # A composite output: a ragged or sparse slot of the program, or a Masked built
        # from a dense one.
        composite = [i for i, s in enumerate(slots) if s[0] in ("ragged", "sparse")]
        self.masked_output = None
        if composite and rng.random() < 0.5:
            self.outputs.append(rng.choice(composite))
        elif rng.random() < 0.2:
            self.masked_output = rng.choice(dense)

    # -- drawing steps ----------------------------------------------------------------------

    def _draw(self, rng, slots):
        while True:
            kind = rng.choice(["unary", "binary", "binary", "matvec", "reduce", "matvec_var",
                               "control", "control", "control", "control", "ragged",
                               "ragged", "sparse", "sparse", "masked", "ragged_cond"])
            found = getattr(self, "_draw_" + kind)(rng, slots)
            if found is not None:
                return found

    @staticmethod
    def _pick(rng, slots, ok):
        cands = [i for i, s in enumerate(slots) if ok(s)]
        if not cands:
            return None
        return cands[-1] if rng.random() < 0.5 else rng.choice(cands)

    @staticmethod
    def _dense(ok=lambda shape: True):
        return lambda s: s[0] == "dense" and ok(s[1])

    def _draw_unary(self, rng, slots):
        a = self._pick(rng, slots, self._dense())
        return ("unary", [a], {"fn": rng.choice(sorted(UNARY))}), slots[a]

    def _draw_binary(self, rng, slots):
        a = self._pick(rng, slots, self._dense())
        shape = slots[a][1]
        b = self._pick(rng, slots, self._dense(lambda s: _broadcasts_into(s, shape)))
        if rng.random() < 0.3:  # broadcasting on the left
            a, b = b, a
        return ("binary", [a, b], {"fn": rng.choice(sorted(BINARY))}), ("dense", shape)

    def _draw_matvec(self, rng, slots):
        a = self._pick(rng, slots, self._dense(lambda s: len(s) == 2))
        if a is None:
            return None
        k = slots[a][1][1]
        b = self._pick(rng, slots, self._dense(lambda s: s == (k,)))
        if b is None:
            return ("matmul_self", [a], {}), ("dense", (slots[a][1][0],) * 2)
        return ("matvec", [a, b], {}), ("dense", (slots[a][1][0],))

    def _draw_matvec_var(self, rng, slots):
        a = self._pick(rng, slots, self._dense(lambda s: s and s[-1] == 4))
        return None if a is None else (("matvec_var", [a], {}), slots[a])

    def _draw_reduce(self, rng, slots):
        a = self._pick(rng, slots, self._dense(lambda s: len(s) >= 1))
        if a is None:
            return None
        shape = list(slots[a][1])
        axis = rng.randrange(len(shape))
        keepdims = rng.random() < 0.3
        if keepdims:
            shape[axis] = 1
        else:
            del shape[axis]
        return ("reduce", [a], {"kind": rng.choice(["sum", "mean", "max"]), "axis": axis,
                                "keepdims": keepdims}), ("dense", tuple(shape))

    def _draw_control(self, rng, slots):
        a = self._pick(rng, slots, self._dense(lambda s: len(s) >= 1))
        node = _draw_node(rng, slots[a][1], slots, self.depth)
        while not _node_has(node, ("cond", "switch", "while")):
            node = _draw_node(rng, slots[a][1], slots, self.depth)
        return ("control", [a], {"node": node}), slots[a]

    def _draw_ragged(self, rng, slots):
        r = self._pick(rng, slots, lambda s: s[0] == "ragged")
        if r is None:  # a ragged value made in the function, from a dense one
            a = self._pick(rng, slots, self._dense(lambda s: len(s) == 2))
            if a is None:
                return None
            rows, cols = slots[a][1]
            return ("ragged_from_tensor", [a], {}), ("ragged", rows, rows * cols, True)
        _, rows, nvals, uniform = slots[r]
        op = rng.choice(["reduce", "reduce", "flat_values", "map", "scale"])
        if op == "reduce" and uniform:
            # (A reduction over rows whose lengths differ between examples has results
            # of different shapes inside (Range): the map raises its ValueError naming the
            # op, as tf.vectorized_map fails.)
            return ("ragged_reduce", [r], {"kind": rng.choice(["sum", "mean", "max"])}), (
                "dense", (rows,))
        if op == "flat_values":
            return ("ragged_flat_values", [r], {}), ("dense", (nvals,))
        if op == "map":
            return ("ragged_map", [r], {"fn": rng.choice(sorted(UNARY))}), slots[r]
        d = self._pick(rng, slots, self._dense())
        return ("ragged_scale", [r, d], {}), slots[r]

    def _draw_ragged_cond(self, rng, slots):
        r = self._pick(rng, slots, lambda s: s[0] == "ragged")
        if r is None:
            return None
        a = self._pick(rng, slots, self._dense())
        return ("ragged_cond", [r, a], {"fns": (rng.choice(LOOP_UNARY),
                                                rng.choice(LOOP_UNARY))}), slots[r]

    def _draw_sparse(self, rng, slots):
        s = self._pick(rng, slots, lambda s: s[0] == "sparse")
        if s is None:  # a sparse value made in the function at fixed positions
            a = self._pick(rng, slots, self._dense(lambda s: len(s) == 2))
            if a is None:
                return None
            rows, cols = slots[a][1]
            picked = sorted(rng.sample(range(rows * cols), min(3, rows * cols)))
            return ("sparse_from_dense", [a], {"indices": [[p // cols, p % cols]
                                                          for p in picked]}), (
                "sparse", (rows, cols))
        shape = slots[s][1]
        op = rng.choice(["to_dense", "reduce", "matmul", "map"])
        if op == "to_dense":
            return ("sparse_to_dense", [s], {}), ("dense", shape)
        if op == "reduce":
            return ("sparse_reduce", [s], {}), ("dense", (shape[0],))
        if op == "matmul":
            d = self._pick(rng, slots, self._dense(lambda t: len(t) == 2 and t[0] == shape[1]))
            if d is not None:
                return ("sparse_matmul", [s, d], {}), ("dense", (shape[0], slots[d][1][1]))
        return ("sparse_map", [s], {"fn": rng.choice(LOOP_UNARY)}), slots[s]

    def _draw_masked(self, rng, slots):
        k = self._pick(rng, slots, lambda s: s[0] == "masked")
        if k is None:
            return None
        return ("masked_where", [k], {}), ("dense", (4,))

    # -- what TensorFlow's vectorized_map cannot run -------------------------------------

    def loop_reason(self, gradients):
        """Why a loop of per-example calls is the reference (None: tf.vectorized_map is).
        The failures of TensorFlow 2.21's tf.vectorized_map that each reason sidesteps:"""
        steps = [s[0] for s in self.steps]
        if "s" in self.composites:
            # TypeError "Failed to convert elements of SparseTensor to Tensor" (pfor
            # converts its elements as tensors).
            return "sparse element"
        if any(self.slots[i][0] == "ragged" for i in self.outputs):
            # ValueError "No pfor vectorization defined for RaggedTensorToVariant".
            return "ragged output"
        if "ragged_cond" in steps:
            # Under tf.GradientTape, InvalidArgumentError "ZerosLike non-scalar Tensor
            # with dtype=DT_VARIANT is not supported" (recording the converted function's
            # call: its gradient needs zeros for the tf.cond's variant outputs).
            return "tf.cond of a ragged value"
        if gradients and any(self.slots[i][0] == "sparse" for i in self.outputs):
            # LookupError "No gradient defined for operation 'pfor/DeserializeSparse'"
            # (the gradient of the converted function, even of its dense outputs).
            return "sparse output gradient"
        if gradients and any(
                s[0] == "control" and _nesting(s[2]["node"]) >= 2 for s in self.steps):
            # The gradient of pfor's converted nested control flow fails
            # (InvalidArgumentError "data.shape = [0] does not start with
            # segment_ids.shape" in the DynamicStitch gradient of a While's gradient).
            return "nested control flow gradient"
        return None

    # -- running -----------------------------------------------------------------------------

    def make_sources(self):
        """Fresh tensors for every float element component, and the variable."""
        src = {k: tf.constant(v) for k, v in self.values.items()}
        return src, tf.Variable(self.W, name="W")

    def make_elems(self, src):
        """The elements, a tuple in `self.inputs` order, built from the sources (so a tape
        watching the sources sees through them)."""
        elems = []
        for name in self.inputs:
            if name in ("x", "m"):
                elems.append(src[name])
            elif name == "r":
                lengths = [n for pair in self.row_lengths for n in pair]
                inner = tf.RaggedTensor.from_row_lengths(_no_gradient(src["r"]),
                                                         tf.constant(lengths, tf.int64))
                elems.append(tf.RaggedTensor.from_uniform_row_length(inner, 2))
            elif name == "s":
                elems.append(tf.SparseTensor(tf.constant(self.sparse_indices, tf.int64),
                                             _no_gradient(src["s"]), [BATCH, 3, 4]))
            else:
                elems.append(Masked(src["k"], tf.constant(self.mask)))
        return tuple(elems)

    def run(self, elems, W):
        """The per-example function: its outputs, a tuple."""
        slots = list(elems)
        for name, idx, p in self.steps:
            a = [slots[i] for i in idx]
            if name == "unary":
                out = UNARY[p["fn"]](a[0])
            elif name == "binary":
                out = BINARY[p["fn"]](a[0], a[1])
            elif name == "matvec":
                out = tf.linalg.matvec(a[0], a[1])
            elif name == "matmul_self":
                out = tf.matmul(a[0], a[0], transpose_b=True)
            elif name == "matvec_var":
                out = tf.tensordot(a[0], W, 1)
            elif name == "reduce":
                fn = {"sum": tf.reduce_sum, "mean": tf.reduce_mean,
                      "max": tf.reduce_max}[p["kind"]]
                out = fn(a[0], axis=p["axis"], keepdims=p["keepdims"])
            elif name == "control":
                out = _run_node(p["node"], a[0], slots, W)
            elif name == "ragged_from_tensor":
                out = tf.RaggedTensor.from_tensor(a[0])
            elif name == "ragged_reduce":
                fn = {"sum": tf.reduce_sum, "mean": tf.reduce_mean,
                      "max": tf.reduce_max}[p["kind"]]
                out = fn(a[0], axis=1)
            elif name == "ragged_flat_values":
                out = a[0].flat_values
            elif name == "ragged_map":
                out = tf.ragged.map_flat_values(UNARY[p["fn"]], a[0])
            elif name == "ragged_scale":
                out = a[0] * tf.reduce_mean(a[1])
            elif name == "ragged_cond":
                r, d = a
                f, g = UNARY[p["fns"][0]], UNARY[p["fns"][1]]
                out = tf.cond(tf.reduce_sum(d) > 0., lambda: tf.ragged.map_flat_values(f, r),
                              lambda: tf.ragged.map_flat_values(g, r) * 2.)
            elif name == "sparse_from_dense":
                indices = tf.constant(p["indices"], tf.int64)
                out = tf.SparseTensor(indices, tf.gather_nd(a[0], indices), a[0].shape)
            elif name == "sparse_to_dense":
                out = tf.sparse.to_dense(a[0])
            elif name == "sparse_reduce":
                out = tf.sparse.reduce_sum(a[0], axis=1)
            elif name == "sparse_matmul":
                out = tf.sparse.sparse_dense_matmul(a[0], a[1])
            elif name == "sparse_map":
                out = a[0].with_values(UNARY[p["fn"]](a[0].values))
            elif name == "masked_where":
                out = tf.where(a[0].mask, a[0].values, tf.sin(a[0].values))
            else:
                raise AssertionError(name)
            slots.append(out)
        outs = [slots[i] for i in self.outputs]
        if self.masked_output is not None:
            v = slots[self.masked_output]
            outs.append(Masked(v * 2., v > 0.))
        return tuple(outs)

    def describe(self):
        names = list(self.inputs)
        shapes = {"x": "[4]", "m": "[3, 4]", "r": "ragged [2, None]", "s": "sparse [3, 4]",
                  "k": "Masked [4]"}
        lines = ["program seed %d: elements %s; unit leading dimension: %s; W [4, 4]" % (
            self.seed, ", ".join("%s %s" % (n, shapes[n]) for n in self.inputs),
            ", ".join(self.unit) or "none")]
        for k, (name, idx, p) in enumerate(self.steps):
            slot = "t%d" % (k + len(self.inputs))
            args = ", ".join(names[i] for i in idx)
            if name == "control":
                text = "%s = %s  on %s" % (slot, _describe_node(p["node"], names), args)
            else:
                params = {key: v for key, v in p.items()}
                text = "%s = %s(%s)%s" % (slot, name, args, " " + str(params) if params else "")
            names.append(slot)
            lines.append("  %s  # %s" % (text, self.slots[k + len(self.inputs)]))
        outs = [names[i] for i in self.outputs]
        if self.masked_output is not None:
            outs.append("Masked(%s)" % names[self.masked_output])
        lines.append("  outputs: %s" % ", ".join(outs))
        return "\n".join(lines)


# -- one case --------------------------------------------------------------------------------

def _example(program, src, b):
    """Example b of the elements, built from the sources (unit dimensions broadcast)."""
    elems = []
    for name in program.inputs:
        if name in ("x", "m"):
            elems.append(src[name][0 if name in program.unit else b])
        elif name == "r":
            elems.append(tf.RaggedTensor.from_row_lengths(
                _no_gradient(src["r"])[5 * b:5 * b + 5],
                tf.constant(program.row_lengths[b], tf.int64)))
        elif name == "s":
            indices = [i[1:] for i in program.sparse_indices[4 * b:4 * b + 4]]
            elems.append(tf.SparseTensor(tf.constant(indices, tf.int64),
                                         _no_gradient(src["s"])[4 * b:4 * b + 4], [3, 4]))
        else:
            elems.append(Masked(src["k"][b], tf.constant(program.mask[b])))
    return tuple(elems)


def _stack(values):
    first = values[0]
    if isinstance(first, tf.RaggedTensor):
        return tf.ragged.stack(values)
    if isinstance(first, tf.SparseTensor):
        return tf.sparse.concat(0, [tf.sparse.expand_dims(v, 0) for v in values])
    if isinstance(first, Masked):
        return Masked(tf.stack([v.values for v in values]), tf.stack([v.mask for v in values]))
    return tf.stack(values)


def _reference(program, gradients):
    """TensorFlow's outputs and gradients (or None): tf.vectorized_map under
    tf.GradientTape, or where it cannot run the program, the map as a loop of
    per-example calls (what tf.map_fn computes: tf.map_fn itself fails on some of these
    programs too, e.g. the gradient of a ragged output, InvalidArgumentError "AddN of
    non-scalar Tensor with dtype=DT_VARIANT", and a sparse output's, LookupError "no
    gradient for DeserializeSparse")."""
    src, W = program.make_sources()
    reason = program.loop_reason(gradients)
    sources = [src[k] for k in program.inputs if k in src] + [W]
    fn = lambda e: program.run(e, W)  # noqa: E731
    with tf.GradientTape() as tape:
        tape.watch(sources[:-1])
        if reason is None:
            outs = tf.vectorized_map(fn, program.make_elems(src))
        else:
            per_example = [fn(_example(program, src, b)) for b in range(BATCH)]
            outs = tuple(_stack(list(o)) for o in zip(*per_example))
        loss = _loss(outs)
    return outs, (tape.gradient(loss, sources) if gradients else None)


def _loss(outs):
    parts = []
    for out in outs:
        if isinstance(out, tf.SparseTensor):
            # Not differentiated: oh.GradientTape around oh.vectorized_map cannot take the
            # gradient of a sparse output yet (LookupError "op DeserializeSparse has no
            # registered gradient"); its values are compared.
            continue
        for c in tf.nest.flatten(out, expand_composites=True):
            if c.dtype.is_floating:
                parts.append(tf.reduce_sum(c * c))
    return tf.add_n(parts)


def _ours(program, mode, gradients):
    src, W = program.make_sources()
    sources = [src[k] for k in program.inputs if k in src] + [W]
    fn = lambda e: program.run(e, W)  # noqa: E731
    if mode == "fn_function":
        fn = tf.function(fn, autograph=False)

    def call():
        if gradients:
            with oh.GradientTape() as tape:
                tape.watch(sources[:-1])
                outs = oh.vectorized_map(fn, program.make_elems(src))
                loss = _loss(outs)
            return outs, tape.gradient(loss, sources)
        return oh.vectorized_map(fn, program.make_elems(src)), None

    if mode == "in_function":
        return tf.function(call, autograph=False)()
    return call()


def _components(value):
    """A composite's comparable components: ragged by row lengths and flat values,
    sparse by indices and values (reordered), Masked by its fields."""
    if isinstance(value, tf.RaggedTensor):
        return [tf.cast(p, tf.int64) for p in value.nested_row_lengths()] + [value.flat_values]
    if isinstance(value, tf.SparseTensor):
        value = tf.sparse.reorder(value)
        return [value.indices, value.values, value.dense_shape]
    if isinstance(value, Masked):
        return [value.values, value.mask]
    return [value]


def _close(ref, got, what):
    ref, got = np.asarray(ref), np.asarray(got)
    assert ref.dtype == got.dtype, "%s: dtype %s, expected %s" % (what, got.dtype, ref.dtype)
    assert ref.shape == got.shape, "%s: shape %s, expected %s" % (what, got.shape, ref.shape)
    if ref.dtype == bool or np.issubdtype(ref.dtype, np.integer):
        np.testing.assert_array_equal(got, ref, err_msg=what)
        return
    finite = np.isfinite(ref)
    scale = 1.0 + (np.max(np.abs(ref[finite])) if finite.any() else 0.0)
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4 * scale, err_msg=what)


def _same_outputs(ref, got, what):
    assert len(ref) == len(got), "%s: %d outputs, expected %d" % (what, len(got), len(ref))
    for i, (r, g) in enumerate(zip(ref, got)):
        assert type(g) is type(r) or (isinstance(r, tf.Tensor) and isinstance(g, tf.Tensor)), (
            "%s[%d]: %s, expected %s" % (what, i, type(g).__name__, type(r).__name__))
        rc, gc = _components(r), _components(g)
        assert len(rc) == len(gc), "%s[%d]: %d components, expected %d" % (
            what, i, len(gc), len(rc))
        for j, (a, b) in enumerate(zip(rc, gc)):
            _close(a, b, "%s[%d] component %d" % (what, i, j))


def _same_gradients(ref, got, what, loop):
    """`loop`: the reference is the loop of per-example calls, where a source used only
    in branches no example takes has no gradient (None); a vectorized map (pfor's
    selects, a staged tf.cond) gives it zeros, as tf.vectorized_map does."""
    assert len(ref) == len(got)
    for i, (r, g) in enumerate(zip(ref, got)):
        w = "%s gradient %d" % (what, i)
        if r is None:
            if loop and g is not None:
                assert not np.any(tf.convert_to_tensor(g).numpy()), (
                    "%s: %r, expected None or zeros" % (w, g))
                continue
            assert g is None, "%s: %r, expected None" % (w, g)
            continue
        assert g is not None, "%s: None, expected %s" % (w, type(r).__name__)
        _close(tf.convert_to_tensor(r), tf.convert_to_tensor(g), w)


def _run_case(program, mode):
    gradients = True
    ref_outs, ref_grads = _reference(program, gradients)
    if mode != "in_function":  # the map's own path with no tape too
        _same_outputs(ref_outs, _ours(program, mode, False)[0], "outputs (%s, no tape)" % mode)
    outs, grads = _ours(program, mode, gradients)
    _same_outputs(ref_outs, outs, "outputs (%s, oh.GradientTape)" % mode)
    _same_gradients(ref_grads, grads, mode, program.loop_reason(gradients) is not None)


MODES = ("eager", "fn_function", "in_function")


def _cases(count, first_seed, rng):
    return [(first_seed + i, rng.choice(MODES)) for i in range(count)]


def _mode(program, mode):
    """Inside a function being traced oh.vectorized_map is tf.vectorized_map: a program
    that tf.vectorized_map cannot run runs eagerly instead, and so does one with a
    per-example tf.while_loop (in a tf.function the gradient of pfor's converted loop
    can fail, InvalidArgumentError in the ParallelDynamicStitch of a DynamicPartition
    gradient of the loop's gradient, where the eager tf.vectorized_map runs)."""
    has_while = any(step[0] == "control" and _node_has(step[2]["node"], ("while",))
                    for step in program.steps)
    if mode == "in_function" and (program.loop_reason(True) or has_while):
        return "eager"
    return mode


def _features(program, mode):
    """What a case exercises (the draw must cover all of FEATURES)."""
    found = {mode, "reference: " + (program.loop_reason(True) and "loop" or "tf.vectorized_map")}
    found.update("element " + c for c in program.composites)
    if program.unit:
        found.add("unit leading dimension")
    for name, _, p in program.steps:
        found.add(name.split("_")[0])
        if name == "control":
            stack = [p["node"]]
            while stack:
                node = stack.pop()
                found.add(node[0])
                stack.extend(_children(node))
            if _nesting(p["node"]) >= 2:
                found.add("nested")
    if any(program.slots[i][0] in ("ragged", "sparse") for i in program.outputs) or (
            program.masked_output is not None):
        found.add("composite output")
    return found


FEATURES = {"eager", "fn_function", "in_function", "reference: loop",
            "reference: tf.vectorized_map", "element r", "element s", "element k",
            "unit leading dimension", "cond", "switch", "while", "nested", "ragged",
            "sparse", "masked", "composite output", "matvec", "reduce", "binary"}


def _covered(cases, lengths, depth):
    """What the draw `cases` exercises (the programs are drawn, not run)."""
    covered = set()
    for seed, mode in cases:
        program = Program(seed, lengths, depth)
        covered |= _features(program, _mode(program, mode))
    return covered


def _run_all(cases, lengths, depth, command):
    """Runs `cases`; a failure names `command`, which replays them."""
    failures = []
    for seed, mode in cases:
        program = Program(seed, lengths, depth)
        mode = _mode(program, mode)
        try:
            _run_case(program, mode)
        except Exception as e:  # pylint: disable=broad-except
            failures.append("%s, reference %s:\n%s\n%s: %s" % (
                mode, program.loop_reason(True) or "tf.vectorized_map",
                program.describe(), type(e).__name__, str(e)[:2000]))
    assert not failures, "%d of %d cases differ from TensorFlow (replay: %s):\n\n%s" % (
        len(failures), len(cases), command, "\n\n".join(failures[:10]))


def _default_cases():
    return _cases(DEFAULT_PROGRAMS, SEED * 1000003, random.Random(SEED))


def _fixed(request):
    return "OH_VMAP_DIFFERENTIAL_SEED=%d python -m pytest %s" % (SEED, request.node.nodeid)


def test_random_mapped_programs_match_tensorflow(request):
    """FAST_PROGRAMS programs drawn from the run's seed."""
    seed = run_seed()
    _run_all(_cases(FAST_PROGRAMS, seed * 1000003, random.Random(seed)), (2, 4), 2,
             replay(request.node.nodeid, seed))


def test_default_draw_covers_every_feature():
    # Every kind of element, step, mode and reference (a changed generator that stopped
    # drawing one would otherwise pass unnoticed).
    if SEED != DEFAULT_SEED:
        pytest.skip("OH_VMAP_DIFFERENTIAL_SEED draws another set")
    covered = _covered(_default_cases(), (2, 4), 2)
    assert FEATURES <= covered, sorted(FEATURES - covered)


@pytest.mark.slow
def test_default_random_mapped_programs_match_tensorflow(request):
    _run_all(_default_cases(), (2, 4), 2, _fixed(request))


@pytest.mark.slow
def test_more_random_mapped_programs_match_tensorflow(request):
    _run_all(_cases(SLOW_PROGRAMS, SEED * 1000003 + 50000, random.Random(SEED + 1)), (3, 8), 3,
             _fixed(request))
