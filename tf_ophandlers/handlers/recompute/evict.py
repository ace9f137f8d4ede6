"""Dropping the values the program still holds (`oh.Recompute`'s eviction, DTR-style).

A segment frees the values the program drops, but a Keras functional model holds every
layer's output until its call returns (`_run_through_graph`'s `tensor_dict`), so in an
eager forward pass most values of a closed segment stay alive through the program's
references. They are the handler's own representations (`_Value`s behind handler
tensors), so the handler can drop the value behind one and keep its recipe: the segment
and node computing it (op, attributes, inputs). When an op later consumes it (a residual
add, a layer reading an earlier output), a value request asks for it, or the segment is
recorded while the program still holds it, the value is *rematerialized*: its node is run
again (tapes paused) from the segment's inputs, which the segment keeps, and from the
segment's values still held or recomputed on the way (the nearest kept ancestors).

The rematerialized tensor replaces the dropped one before the segment is recorded (a
segment is recorded only once its held values are back), so the tapes see one tensor per
value and gradients, with respect to weights or to a value the program kept, are those of
the segment without eviction. What is never dropped: values of a segment already
recorded, the last node's outputs (the next op usually reads them), values a later
segment uses (its inputs hold them anyway), outputs of kept ops (variable reads, stateful
and random ops: not in segments), values smaller than `min_bytes`.

Bounded: a value is dropped at most once (when its segment closes) and rematerialized at
most once per drop; a rematerialization runs at most the nodes of one segment.
"""
import collections

from tensorflow.python.eager import record as _record

from tf_ophandlers.handlers.recompute.segments import nbytes


# What a dropped value's tensor was: shape and dtype queries need no rematerialization.
Dropped = collections.namedtuple("Dropped", ("dtype", "shape", "device"))


def tensor_of(value):
    """The tensor of a representation, rematerialized if its value was dropped."""
    if type(value) is Value:
        return value.tensor if value.tensor is not None else rematerialize(value)
    return value


def described(value):
    """The tensor, or what a dropped value's tensor was (dtype, shape, device)."""
    if type(value) is Value:
        return value.tensor if value.tensor is not None else value.meta
    return value


class Value:
    """The representation: a tensor of the next stack, and the segment computing it
    while that segment is not recorded yet (`node`, `index` inside it). A value dropped
    by eviction has `tensor` None and `meta`, a `Dropped`."""

    __slots__ = ("tensor", "segment", "node", "index", "tracked", "meta", "__weakref__")

    def __init__(self, tensor, segment=None, node=0, index=0, tracked=False):
        self.tensor = tensor
        self.segment = segment
        self.node = node
        self.index = index
        self.tracked = tracked
        self.meta = None


def evict(segment, below, min_bytes):
    """Drops the values of the closed `segment` the program still holds (see the module
    docstring for what stays). Returns the bytes dropped."""
    last = len(segment.nodes) - 1
    freed = 0
    segment.below = below
    for n, refs in enumerate(segment.values):
        if n == last or (segment.saved is not None and segment.saved[n] is not None):
            continue  # (a partial segment's saved values are held by the segment)
        for k, ref in enumerate(refs):
            v = ref()
            if v is None or v.tensor is None or (n, k) in segment.used:
                continue
            t = v.tensor
            size = nbytes(t)
            if size < min_bytes:
                continue
            v.meta = Dropped(t.dtype, t.shape, t.device)
            v.tensor = None
            freed += size
    return freed


def rematerialize(v):
    """Computes the dropped value of `v` again from its segment; returns the tensor."""
    segment = v.segment
    with _record.stop_recording():
        outputs = _compute(segment, v.node)
    t = v.tensor = outputs[v.index]
    v.meta = None
    segment.remat += 1
    return t


def restore(segment):
    """Rematerializes every dropped value of `segment` the program still holds (before
    the segment is recorded: the tapes must see those values as its outputs)."""
    for refs in segment.values:
        for ref in refs:
            v = ref()
            if v is not None and v.tensor is None:
                rematerialize(v)


def _held(segment, p, i):
    """The tensor of value `(p, i)` if it exists without recomputation, else None."""
    t = segment.used.get((p, i))
    if t is not None:
        return t
    if segment.saved is not None and segment.saved[p] is not None:
        return segment.saved[p][i]  # (a partial segment's saved values)
    refs = segment.values[p]
    v = refs[i]() if i < len(refs) else None
    return None if v is None else v.tensor


def _compute(segment, target):
    """The outputs of node `target`, running the nodes it needs whose values are gone
    (iteratively: a chain inside a segment can be longer than Python's recursion)."""
    memo = {}
    todo = [target]
    while todo:
        n = todo[-1]
        if n in memo:
            todo.pop()
            continue
        op, refs = segment.nodes[n]
        missing = [p for p, i in refs
                   if p >= 0 and p not in memo and _held(segment, p, i) is None]
        if missing:
            todo.extend(missing)
            continue
        inputs = [segment.externals[i] if p < 0
                  else memo[p][i] if p in memo else _held(segment, p, i)
                  for p, i in refs]
        memo[n] = segment.below.execute(op, inputs)
        segment.remat_ops += 1
        todo.pop()
    return memo[target]
