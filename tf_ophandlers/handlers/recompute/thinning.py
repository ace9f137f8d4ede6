"""Checkpoint thinning: segment inputs (checkpoints) the backward pass recomputes instead
of keeping (`oh.Recompute`'s second level of recomputation).

The records of a segment keep its inputs until its gradient runs, and the backward pass
runs last segment first: a checkpoint early in the forward pass is kept through almost
the whole backward pass, while the gradients of the weights accumulate. In a network
whose activations shrink while its weights grow (a CNN: ResNet's first stage has the
largest activations, its last stages most weights), the step's peak is where the two
meet: the first stages' backward, with every weight gradient and every checkpoint of
those stages alive. A checkpoint the plan *drops* is held by no record: the record of
each segment using it holds a `Recipe` instead (the segment computing it, which node),
and that segment's gradient function gets it computed again, from that segment's own
inputs (kept by its own record until its backward, which comes later), when it runs.
This is a second level of checkpointing (Chen et al., 2016) applied where it pays.

The plan (`plan`) simulates the backward pass over the segments recorded together (their
order is the forward pass's): at each segment's backward the bytes alive are the
gradients of the weights read by it and every later segment, the checkpoints still kept
(those used by it or an earlier segment), its inputs that were dropped (computed again),
its output gradients and its working values. It drops, one at a time, the checkpoint
that lowers the simulated peak most, while the extra forward computation (bytes computed
again, each dropped checkpoint once per segment using it) stays within `budget` times
the bytes the segments computed. A dropped checkpoint's producer reads kept checkpoints
only (no chains: measured on a residual CNN, a chain's recomputation at the backward
pass's peak cost more than the checkpoints it dropped).

A dropped value the program still holds (a weak reference to it resolves) is used as it
is: dropping it costs nothing then, and saves nothing.
"""
import weakref

import tensorflow as tf
from tensorflow.python.eager import record as _record
from tensorflow.python.framework import ops as _ops

from tf_ophandlers.extend import CompiledCall, current_stack, graph_builder, LRUCache, PHYSICAL

_forwards = LRUCache("recompute.checkpoint_forwards", 256)  # structure -> _Forward
_MAX_SEGMENTS = 256  # larger batches are not planned (the greedy plan is cubic)
_WORK = 0.75  # share of a segment's computed bytes its gradient function holds at once


def nbytes(tensor):
    """Bytes of a tensor's value (0 if its shape is unknown). (The package's one
    definition: segments.py, which imports this module, re-exports it.)"""
    n = tensor.shape.num_elements()
    return 0 if n is None else n * tensor.dtype.size


class Recipe:
    """A dropped checkpoint: output `index` of node `node` of `producer` (a recorded
    segment, which keeps its inputs or their recipes)."""

    __slots__ = ("producer", "node", "index", "shape", "dtype", "ref", "_plan")

    def __init__(self, producer, node, index, tensor):
        self.producer, self.node, self.index = producer, node, index
        self.shape, self.dtype = tensor.shape, tensor.dtype  # (gradient functions' specs)
        try:
            self.ref = weakref.ref(tensor)
        except TypeError:  # (a tensor type without weak references: always recomputed)
            self.ref = None
        self._plan = None

    def tensor(self):
        """The value: the original if something still holds it, else computed again."""
        t = self.ref() if self.ref is not None else None
        if t is not None:
            return t
        if self._plan is None:
            self._plan = _sub_program(self.producer, self.node, self.index)
        nodes, ext, target = self._plan
        inputs = [materialized(self.producer.externals[i]) for i in ext]
        key = graph_builder.program_key(nodes, [target], inputs)
        fn = _forwards.get(key)
        if fn is None:
            fn = _forwards[key] = _Forward(nodes, target, inputs)
        return fn.run(inputs)


def materialized(value):
    """`value`, or the tensor of a `Recipe`."""
    return value.tensor() if type(value) is Recipe else value


def materialized_all(values):
    """`values` with recipes computed (the list itself when it holds none)."""
    if not any(type(v) is Recipe for v in values):
        return values
    return [materialized(v) for v in values]


def _sub_program(segment, node, index):
    """(nodes computing output `index` of `node` of `segment` from the segment's inputs,
    renumbered; the indices of the inputs they read; the target ref)."""
    needed, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(p for p, _ in segment.nodes[n][1] if p >= 0)
    local, ext, ext_local, nodes = {}, [], {}, []
    for n in sorted(needed):
        op, refs = segment.nodes[n]
        new_refs = []
        for p, i in refs:
            if p < 0:
                if i not in ext_local:
                    ext_local[i] = len(ext)
                    ext.append(i)
                new_refs.append((-1, ext_local[i]))
            else:
                new_refs.append((local[p], i))
        local[n] = len(nodes)
        nodes.append((op, tuple(new_refs), None))
    return nodes, ext, (local[node], index)


class _Forward:
    """A function of a segment's inputs computing one of its values (a dropped
    checkpoint), run on the current stack."""

    def __init__(self, nodes, target, inputs):
        specs = [tf.TensorSpec(t.shape, t.dtype) for t in inputs]

        def build(*args):
            results = graph_builder.replay(tf.compat.v1.get_default_graph(), nodes,
                                           list(args))
            return results[target[0]][target[1]]

        with _ops.init_scope():
            self.function = tf.function(build, input_signature=specs,
                                        autograph=False).get_concrete_function()
        self.call = CompiledCall(self.function, op_by_op=True)

    def run(self, inputs):
        stack = current_stack()
        if stack is PHYSICAL and _record.could_possibly_record():
            # A tape records the backward pass (higher order): the recomputation is
            # recorded too, so the value stays connected to the segment's inputs.
            out = self.function._call_flat(list(inputs), self.function.captured_inputs)  # pylint: disable=protected-access
        else:
            out = self.call.run(stack, list(inputs))
        return out[0] if isinstance(out, (list, tuple)) else out


class _Checkpoint:
    __slots__ = ("tensor", "bytes", "producer", "node", "index", "consumers", "holders")

    def __init__(self, tensor, producer, node, index):
        self.tensor, self.bytes = tensor, nbytes(tensor)
        self.producer, self.node, self.index = producer, node, index
        self.consumers = set()  # positions (forward order) of the segments using it
        self.holders = []  # (segment, input index)


def checkpoints(segments, min_bytes):
    """The checkpoints among the recorded `segments` (forward order): inputs a segment
    took from an earlier one of them (its `sources`), tracked, of at least `min_bytes`."""
    position = {id(s): k for k, s in enumerate(segments)}
    # Values their own segment uses too (cuts): the producer's record holds them anyway.
    inside = {id(s): {r for _, refs in s.nodes for r in refs if r[0] >= 0}
              for s in segments}
    found = {}
    for k, s in enumerate(segments):
        for i, source in (s.sources or {}).items():
            producer = source[0]
            t = s.externals[i]
            if id(producer) not in position or not s.ext_tracked[i] \
                    or type(t) is Recipe or nbytes(t) < min_bytes \
                    or (source[1], source[2]) in inside[id(producer)]:
                continue
            c = found.get(id(t))
            if c is None:
                c = found[id(t)] = _Checkpoint(t, position[id(producer)], source[1],
                                                source[2])
            c.consumers.add(k)
            c.holders.append((s, i))
    return list(found.values())


def plan(fwd, weights, outs, cks, budget):
    """The checkpoints to drop (indices into `cks`), by the simulation described in the
    module docstring. Per segment (forward order): `fwd` bytes computed, `weights` bytes
    of the gradients its backward adds (its inputs no segment computed: weights), `outs`
    bytes of its output gradients; `cks` the checkpoints; `budget` bytes computed again
    at most."""
    n = len(fwd)
    first = [min(c.consumers) for c in cks]
    # bytes of checkpoints kept at each segment's backward: those used by it or earlier

    def peak(dropped):
        kept = [0] * (n + 1)
        for j, c in enumerate(cks):
            if j not in dropped:
                kept[first[j]] += c.bytes
        again = [0] * n
        for j in dropped:
            for k in cks[j].consumers:
                again[k] += cks[j].bytes
        best, w, held = 0, 0, sum(kept)
        for k in range(n - 1, -1, -1):  # the backward pass, last segment first
            w += weights[k]
            best = max(best, w + held + again[k] + _WORK * fwd[k] + outs[k])
            held -= kept[k]
        return best

    def cost(dropped):
        # chain[k]: bytes computed to get segment k's values, its dropped inputs included
        # (producers come first in forward order)
        chain = list(fwd)
        for k in range(n):
            chain[k] += sum(chain[cks[j].producer] for j in dropped
                            if k in cks[j].consumers)
        return sum(len(cks[j].consumers) * chain[cks[j].producer] for j in dropped)

    dropped = set()
    current = peak(dropped)
    while True:
        best = None
        for j in range(len(cks)):
            if j in dropped or any(
                    cks[d].producer in cks[j].consumers or cks[j].producer in cks[d].consumers
                    for d in dropped):
                continue  # (no chains: a recomputation reads kept checkpoints only)
            trial = dropped | {j}
            spent = cost(trial)
            if spent > budget:
                continue
            p = peak(trial)
            if p < current and (best is None or (p, spent) < best[:2]):
                best = (p, spent, j)
        if best is None:
            return dropped
        current = best[0]
        dropped.add(best[2])


def thin(segments, budget_share, min_bytes):
    """Plans and applies checkpoint thinning over `segments` (recorded together, in
    forward order, each with `pieces`: its recorded pieces). Returns (checkpoints
    dropped, their bytes)."""
    segments = [s for s in segments if s.pieces]
    if len(segments) < 3 or len(segments) > _MAX_SEGMENTS or budget_share <= 0:
        return 0, 0
    cks = checkpoints(segments, min_bytes)
    if not cks:
        return 0, 0
    produced = {id(c.tensor) for c in cks}
    fwd = [s.bytes for s in segments]
    weights, outs = [], []
    for s in segments:
        w = 0
        for i, t in enumerate(s.externals):
            if s.ext_tracked[i] and not (s.sources and i in s.sources) \
                    and id(t) not in produced and type(t) is not Recipe:
                w += nbytes(t)
        weights.append(w)
        outs.append(s.out_bytes)
    dropped = plan(fwd, weights, outs, cks, budget_share * sum(fwd))
    freed = 0
    for j in dropped:
        c = cks[j]
        producer = segments[c.producer]
        recipe = Recipe(producer, c.node, c.index, c.tensor)
        for s, i in c.holders:
            s.externals[i] = recipe
            for piece in s.pieces:
                _replace(piece.externals, c.tensor, recipe)
                if piece.xs is not None:
                    _replace(piece.xs, c.tensor, recipe)
        freed += c.bytes
    for c in cks:
        c.tensor = c.holders = None  # (nothing here may outlive the call)
    return len(dropped), freed


def _replace(values, tensor, recipe):
    for i, v in enumerate(values):
        if v is tensor:
            values[i] = recipe
