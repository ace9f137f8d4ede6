"""Layout rules of `oh.DataFormat`: the representation `Permuted`, the helpers that move a
value between physical layouts, and per op type a rule
``rule(handler, nxt, op, inputs) -> outputs`` for the layout-agnostic ops (elementwise
ops, reductions, concatenation, splits, pads, slices, transposes, reshapes, shapes) that
run on permuted data without transposing it back. handler.py converts the
layout-sensitive ops (those with a `data_format` attribute) and falls back to the
logical layout for every op without a rule.

A representation is either a tensor of the next stack (its physical layout is its
logical one) or a `Permuted(value, perm)`: the logical tensor is
``tf.transpose(value, perm)``, i.e. logical axis i is physical axis ``perm[i]``. A
logical NCHW tensor stored as NHWC has ``perm == (0, 3, 1, 2)``.
"""
import math

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import ops as _ops

from tf_ophandlers.extend import BoundedCache, move_axis, Op, op_kinds, stack_of


class Permuted:
    """A next-stack tensor `value` holding the logical tensor ``transpose(value, perm)``."""

    __slots__ = ("value", "perm")

    def __init__(self, value, perm):
        self.value = value
        self.perm = perm

    @property
    def dtype(self):
        return self.value.dtype

    @property
    def device(self):
        return self.value.device

    @property
    def shape(self):
        """The logical shape."""
        dims = self.value.shape.as_list()
        return tf.TensorShape([dims[i] for i in self.perm])

    def __repr__(self):
        return "Permuted(perm=%s, physical shape %s)" % (self.perm, self.value.shape)


def permuted(value, perm):
    """The representation of `value` stored with `perm` (the plain tensor for identity)."""
    if perm is None or all(i == k for i, k in enumerate(perm)):
        return value
    return Permuted(value, tuple(perm))


def perm_of(x):
    return x.perm if type(x) is Permuted else None


def physical(x):
    return x.value if type(x) is Permuted else x


def inverse(perm):
    inv = [0] * len(perm)
    for i, k in enumerate(perm):
        inv[k] = i
    return tuple(inv)


def channels_first_perm(rank):
    """The perm of a channels-first logical tensor (NCHW) stored channels-last (NHWC)."""
    return (0, rank - 1) + tuple(range(1, rank - 1))


def dropped_perm(perm, removed):
    """The perm left when the logical axes `removed` are reduced away (each keeps its
    physical position among the physical axes that remain)."""
    remaining = [i for i in range(len(perm)) if i not in removed]
    kept = sorted(perm[i] for i in remaining)
    return tuple(kept.index(perm[i]) for i in remaining)


def moves_no_data(dims, q):
    """Whether ``transpose(t, q)`` of a tensor of shape `dims` keeps its elements in
    memory order (the axes longer than 1, unknown ones included, keep their order): then
    it is a reshape."""
    last = -1
    for k in q:
        if dims[k] == 1:
            continue
        if k < last:
            return False
        last = k
    return True


_EagerTensor = _ops.EagerTensor


def static(t):
    """The value of `t` (numpy; callers copy what they give away) if known without
    running anything, else None (a tensor of a stack below answers through its handler,
    also a symbolic one while a function is replayed: core/tensor.py)."""
    if type(t) is _EagerTensor and stack_of(t) is None:
        # A physical eager tensor (a perm, axes, a shape: several per call): its value
        # without tf.get_static_value's dispatch or the copy `.numpy()` makes.
        try:
            return t._numpy()  # pylint: disable=protected-access
        except tf.errors.UnimplementedError:  # resource and variant tensors
            return None
    v = tf.get_static_value(t)
    return None if v is None else np.asarray(v)


def dims_of(t):
    """The axis lengths of a next-stack tensor of known rank (None: unknown), as a list
    built from its shape tuple (no TensorShape: this runs several times per op)."""
    dims = t._shape_tuple()  # pylint: disable=protected-access
    return t.shape.as_list() if dims is None else list(dims)  # (unknown rank: TF's error)


# -- ops on the next stack ------------------------------------------------------------

_constants = BoundedCache("data_format.constants", 1024)  # (dtype, shape, values) -> tensor


def constant(values, dtype):
    """An integer constant (a shape, axes, a perm); cached eagerly, a graph constant
    while a function is replayed."""
    if not tf.executing_eagerly():
        return tf.constant(np.asarray(values, dtype=dtype.as_numpy_dtype))
    # Keyed by the Python values when they are a flat sequence of ints or an int (what
    # the rules pass, several times per op): no numpy conversion on a hit.
    kind = type(values)
    try:  # (a numpy value, a permuted static vector: keyed by its bytes)
        if kind is not list and kind is not tuple and kind is not int:
            raise TypeError
        key = (dtype, tuple(values) if kind is not int else values)
        t = _constants.get(key)
    except TypeError:  # (also nested lists: unhashable)
        arr = np.asarray(values, dtype=dtype.as_numpy_dtype)
        key = (dtype, arr.shape, arr.tobytes())
        t = _constants.get(key)
    if t is None:
        t = _constants[key] = tf.constant(np.asarray(values, dtype=dtype.as_numpy_dtype))
    return t


# Below this many elements a transpose is cheaper than the two reshapes that would
# lower its rank (eagerly each is an op call); unknown sizes (a replay) always lower it.
_COLLAPSE_MIN_ELEMENTS = 1 << 14
# Whether eager transposes are lowered too: not by default (eagerly the two reshapes are
# two more op calls, which cost more than the lower rank saved where it was measured).
_COLLAPSE_EAGERLY = False


def collapsed_transpose(dims, q):
    """``transpose(t, q)`` of a tensor of shape `dims` (None: unknown) as a transpose of
    lower rank: axes that stay adjacent and in order (length-1 axes between them
    ignored) merge into one. Returns ``(shape, perm, out_shape)`` (reshape to `shape`,
    transpose by `perm`, reshape to `out_shape`; -1 for the one unknown length), or None
    when no axes merge, more than one length is unknown, or the tensor is small (a large
    lowered transpose is faster than the 4-D Transpose on some CPUs, as fast on
    others)."""
    if sum(d is None for d in dims) > 1:
        return None
    if None not in dims and math.prod(dims) < _COLLAPSE_MIN_ELEMENTS:
        return None
    groups = []  # in output order: runs of input axes, each run ascending and adjacent
    for a in q:
        if dims[a] == 1:
            continue
        last = groups[-1][-1] if groups else None
        if last is not None and a > last and all(dims[k] == 1 for k in range(last + 1, a)):
            groups[-1].append(a)
        else:
            groups.append([a])
    if len(groups) == len(q):
        return None  # nothing merges, no length-1 axis to drop
    order = sorted(range(len(groups)), key=lambda g: groups[g][0])

    def length(axes):
        ds = [dims[a] for a in axes]
        return -1 if None in ds else math.prod(ds)

    shape = [length(groups[g]) for g in order]
    perm = tuple(order.index(g) for g in range(len(groups)))
    out_shape = [-1 if dims[a] is None else dims[a] for a in q]
    return shape, perm, out_shape


def transpose(nxt, value, q):
    """``transpose(value, q)`` on the next stack: a channels move in a replayed function
    is one OhMoveAxis (core/move_axis.py), another transpose there (eagerly if
    _COLLAPSE_EAGERLY) runs at the lowest rank moving the same data (collapsed_transpose)."""
    if not _COLLAPSE_EAGERLY and tf.executing_eagerly():
        return _transpose(nxt, value, q)
    moved = move_axis.in_replay(nxt, value, q)
    if moved is not None:
        return moved
    plan = collapsed_transpose(dims_of(value), q)
    if plan is not None:
        shape, perm, out_shape = plan
        value = reshape(nxt, value, shape)
        if len(perm) > 1:  # else the data is in order already: the reshapes suffice
            value = _transpose(nxt, value, perm)
        return reshape(nxt, value, out_shape)
    return _transpose(nxt, value, q)


# (op type, dtype) -> the Transpose, Reshape, BiasAdd NHWC the rules run (Op.cached's
# key costs more).
_dtype_ops = BoundedCache("data_format.dtype_ops", 256)
_INT_ATTRS = {"Transpose": {"Tperm": tf.int32}, "Reshape": {"Tshape": tf.int32},
              "BiasAdd": {"data_format": b"NHWC"}}


def _shape_op(op_type, dtype):
    op = _dtype_ops.get((op_type, dtype))
    if op is None:
        op = _dtype_ops[(op_type, dtype)] = Op.cached(op_type, T=dtype, **_INT_ATTRS[op_type])
    return op


def _transpose(nxt, value, q):
    return nxt.execute(_shape_op("Transpose", value.dtype), [value, constant(q, tf.int32)])[0]


def reshape(nxt, value, dims):
    return nxt.execute(_shape_op("Reshape", value.dtype), [value, constant(dims, tf.int32)])[0]


def gather(nxt, value, indices):
    """``value[indices]`` along axis 0 (a shape vector or paddings permuted)."""
    op = Op.cached("GatherV2", Tparams=value.dtype, Tindices=tf.int32, Taxis=tf.int32,
                   batch_dims=0)
    return nxt.execute(op, [value, constant(indices, tf.int32), constant(0, tf.int32)])[0]


def move_axes(nxt, value, q):
    """``transpose(value, q)``: a Reshape when that moves no data and at most one length
    is unknown, else a Transpose."""
    dims = dims_of(value)
    if moves_no_data(dims, q) and sum(d is None for d in dims) <= 1:
        return reshape(nxt, value, [-1 if dims[k] is None else dims[k] for k in q])
    return transpose(nxt, value, q)


def _axes_to_move(x, target):
    """The perm taking `x`'s physical tensor to layout `target`, or None if it is there."""
    p = perm_of(x)
    if p == target:
        return None
    rank = len(p) if p is not None else len(target)
    inv_t = inverse(target) if target is not None else tuple(range(rank))
    q = tuple(p[i] for i in inv_t) if p is not None else inv_t
    return None if all(i == k for i, k in enumerate(q)) else q


def relayout(nxt, x, target):
    """The physical tensor of `x` (either representation, of rank ``len(target)``) in
    layout `target` (a perm, None for the logical layout)."""
    q = _axes_to_move(x, target)
    return physical(x) if q is None else move_axes(nxt, physical(x), q)


def relayout_transposes(x, target):
    """Whether `relayout(nxt, x, target)` runs a Transpose (not nothing or a Reshape)."""
    q = _axes_to_move(x, target)
    if q is None:
        return False
    dims = dims_of(physical(x))
    return not (moves_no_data(dims, q) and sum(d is None for d in dims) <= 1)


def logical(nxt, x):
    return relayout(nxt, x, None) if type(x) is Permuted else x


def rank_of(x):
    dims = physical(x)._shape_tuple()  # pylint: disable=protected-access
    return None if dims is None else len(dims)


def fallback(handler, nxt, op, inputs):
    """Runs `op` on the logical layout of its inputs (each permuted one transposed back)."""
    args = [logical(nxt, x) for x in inputs]
    if any(type(x) is Permuted for x in inputs):
        handler.note_transpose_back(op.type)
    return nxt.execute(op, args)


def vector_to_physical(nxt, v, perm):
    """A vector (or the rows of a matrix) in logical axis order, reordered to the
    physical axes of `perm`: ``result[k] = v[inverse(perm)[k]]``."""
    idx = inverse(perm)
    known = static(v)
    if known is not None:
        return constant(known[list(idx)], v.dtype)
    return gather(nxt, v, idx)


# -- rules ----------------------------------------------------------------------------

def _first_perm(inputs):
    for x in inputs:
        if type(x) is Permuted:
            return x.perm
    return None


def _broadcast_operand(nxt, x, perm):
    """A lower-rank operand of a broadcasting op whose other operand has `perm`: aligned
    to the trailing logical axes, reordered to the physical axes (a Reshape when that
    moves no data, else a Reshape and a Transpose); None if its shape is too unknown."""
    value = logical(nxt, x)
    dims = dims_of(value)
    if not dims:
        return value
    full = [1] * (len(perm) - len(dims)) + dims
    q = inverse(perm)
    if sum(d is None for d in full) > 1:
        return None
    if moves_no_data(full, q):
        return reshape(nxt, value, [-1 if full[k] is None else full[k] for k in q])
    expanded = reshape(nxt, value, [-1 if d is None else d for d in full])
    return transpose(nxt, expanded, q)


def elementwise(handler, nxt, op, inputs):
    """Elementwise and broadcasting ops: on the physical data when the 4-D inputs share
    a layout; other operands are brought to it (small broadcast operands by a Reshape)."""
    perm = _first_perm(inputs)
    if perm is None:
        return nxt.execute(op, inputs)
    rank = len(perm)
    args = []
    for x in inputs:
        if type(x) is Permuted and x.perm == perm:
            args.append(x.value)
            continue
        r = rank_of(x)
        if r is None or r > rank:
            return fallback(handler, nxt, op, inputs)
        if r == rank:
            args.append(relayout(nxt, x, perm))
        else:
            a = _broadcast_operand(nxt, x, perm)
            if a is None:
                return fallback(handler, nxt, op, inputs)
            args.append(a)
    return [Permuted(o, perm) for o in nxt.execute(op, args)]


def identity_n(handler, nxt, op, inputs):
    outs = nxt.execute(op, [physical(x) for x in inputs])
    return [permuted(o, perm_of(x)) for o, x in zip(outs, inputs)]


def _reduction(handler, nxt, op, inputs, keep):
    x, axes = inputs
    if type(x) is not Permuted:
        return nxt.execute(op, inputs)
    known = static(axes)
    if known is None:
        return fallback(handler, nxt, op, inputs)
    perm = x.perm
    rank = len(perm)
    logical_axes = sorted({a % rank for a in known.reshape(-1).tolist()})
    phys = [perm[a] for a in logical_axes]
    phys_axes = constant(phys if known.ndim else phys[0], axes.dtype)
    outs = nxt.execute(op, [x.value, phys_axes])
    out_perm = perm if keep else dropped_perm(perm, logical_axes)
    return [permuted(o, out_perm) for o in outs]


def reduction(handler, nxt, op, inputs):
    """Sum, Mean, Max, ...: the axes remapped to the physical ones."""
    return _reduction(handler, nxt, op, inputs, op.attrs.get("keep_dims", False))


def arg_reduction(handler, nxt, op, inputs):
    """ArgMax/ArgMin: one axis, dropped."""
    return _reduction(handler, nxt, op, inputs, False)


def transpose_rule(handler, nxt, op, inputs):
    """A transpose of a permuted tensor only composes perms (no data moves); one that
    makes a channels-last tensor channels-first is kept lazily the same way."""
    x, perm_t = inputs
    known = static(perm_t)
    if known is None:
        return fallback(handler, nxt, op, inputs)
    q = tuple(known.tolist())
    p = perm_of(x)
    if p is None:
        if len(q) >= 4 and q == channels_first_perm(len(q)):
            return [Permuted(x, q)]
        return nxt.execute(op, inputs)
    return [permuted(x.value, tuple(p[i] for i in q))]


def shape_rule(handler, nxt, op, inputs):
    """Shape (ShapeN): the logical shape."""
    outs = nxt.execute(op, [physical(x) for x in inputs])
    result = []
    for o, x in zip(outs, inputs):
        if type(x) is not Permuted:
            result.append(o)
            continue
        dims = x.value.shape.as_list()
        if None not in dims:
            result.append(nxt.copy_on(constant([dims[i] for i in x.perm], o.dtype)))
        else:
            result.append(gather(nxt, o, x.perm))
    return result


def physical_only(handler, nxt, op, inputs):
    """Size, Rank: the same on the physical data."""
    return nxt.execute(op, [physical(x) for x in inputs])


def _axis_op(handler, nxt, op, inputs, values, axis_index):
    """Concat and splits: the values brought to one layout, the axis remapped."""
    perm = _first_perm([inputs[i] for i in values])
    if perm is None:
        return nxt.execute(op, inputs)
    axis = inputs[axis_index]
    known = static(axis)
    rank = len(perm)
    if known is None or any(rank_of(inputs[i]) != rank for i in values):
        return fallback(handler, nxt, op, inputs)
    args = list(inputs)
    for i in values:
        args[i] = relayout(nxt, inputs[i], perm)
    args[axis_index] = constant(perm[int(known) % rank], axis.dtype)
    return [Permuted(o, perm) for o in nxt.execute(op, args)]


def concat(handler, nxt, op, inputs):
    return _axis_op(handler, nxt, op, inputs, range(len(inputs) - 1), len(inputs) - 1)


def split(handler, nxt, op, inputs):
    return _axis_op(handler, nxt, op, inputs, [1], 0)


def split_v(handler, nxt, op, inputs):
    return _axis_op(handler, nxt, op, inputs, [0], 2)


def per_axis_vectors(handler, nxt, op, inputs):
    """Pad, PadV2, MirrorPad, Slice, Tile: the per-axis vectors (paddings rows, begin,
    size, multiples) reordered to the physical axes."""
    x = inputs[0]
    if type(x) is not Permuted:
        return nxt.execute(op, inputs)
    n = 3 if op.type == "Slice" else 2
    args = [x.value] + [vector_to_physical(nxt, v, x.perm) for v in inputs[1:n]]
    args += [physical(v) for v in inputs[n:]]
    return [Permuted(o, x.perm) for o in nxt.execute(op, args)]


def reshape_rule(handler, nxt, op, inputs):
    """Reshape of a permuted tensor runs on the physical data when transposing it back
    would move no data (its long axes are in logical order), and is the identity when it
    keeps the logical shape (a gradient's reshape to the input's shape); else it
    transposes back."""
    x, shape = inputs
    if type(x) is not Permuted:
        return nxt.execute(op, inputs)
    dims = dims_of(x.value)
    if moves_no_data(dims, x.perm):
        return nxt.execute(op, [x.value, shape])
    target = static(shape)
    if target is not None and None not in dims and target.reshape(-1).tolist() == [
            dims[i] for i in x.perm]:
        (out,) = nxt.execute(Op.cached("Identity", T=x.dtype), [x.value])
        return [Permuted(out, x.perm)]
    return fallback(handler, nxt, op, inputs)


def broadcast_to(handler, nxt, op, inputs):
    """BroadcastTo of a permuted tensor broadcasts its physical data; a plain one that
    becomes as large as the channels-first data the handler converts (a gradient's
    [N, C, 1, 1] -> [N, C, H, W]) is broadcast into the channels-last layout directly
    when moving it there is a reshape, so that no transpose follows."""
    x, shape = inputs
    rank = physical(shape).shape[0] if physical(shape).shape.rank == 1 else None
    perm = perm_of(x)
    if perm is None:
        if rank is None or rank_of(x) != rank or rank not in handler.converted_ranks:
            return nxt.execute(op, inputs)
        perm = channels_first_perm(rank)
        dims = x.shape.as_list()
        if not moves_no_data(dims, inverse(perm)) or sum(d is None for d in dims) > 1:
            return nxt.execute(op, inputs)
    elif rank != len(perm):
        return fallback(handler, nxt, op, inputs)
    value = relayout(nxt, x, perm)
    target = vector_to_physical(nxt, physical(shape), perm)
    return [Permuted(o, perm) for o in nxt.execute(op, [value, target])]


def squeeze(handler, nxt, op, inputs):
    (x,) = inputs
    if type(x) is not Permuted:
        return nxt.execute(op, inputs)
    perm = x.perm
    rank = len(perm)
    dims = op.attrs.get("squeeze_dims") or []
    if not dims:
        shape = x.shape.as_list()
        if None in shape:
            return fallback(handler, nxt, op, inputs)
        dims = [i for i, d in enumerate(shape) if d == 1]
    logical_axes = sorted({int(a) % rank for a in dims})
    new_op = Op.cached("Squeeze", T=x.dtype, squeeze_dims=tuple(perm[a] for a in logical_axes))
    (out,) = nxt.execute(new_op, [x.value])
    return [permuted(out, dropped_perm(perm, logical_axes))]


def expand_dims(handler, nxt, op, inputs):
    x, axis = inputs
    known = static(axis)
    if type(x) is not Permuted:
        return nxt.execute(op, inputs)
    if known is None:
        return fallback(handler, nxt, op, inputs)
    perm = x.perm
    rank = len(perm)
    a = int(np.reshape(known, -1)[0])
    a = a + rank + 1 if a < 0 else a
    (out,) = nxt.execute(op, [x.value, constant(-1, axis.dtype)])  # new last physical axis
    return [permuted(out, perm[:a] + (rank,) + perm[a:])]


def last_axis(handler, nxt, op, inputs):
    """Softmax, LogSoftmax: on the physical data if the logical last axis is physically
    last."""
    (x,) = inputs
    if type(x) is not Permuted:
        return nxt.execute(op, inputs)
    if x.perm[-1] != len(x.perm) - 1:
        return fallback(handler, nxt, op, inputs)
    return [Permuted(o, x.perm) for o in nxt.execute(op, [x.value])]


def bias_add_permuted(handler, nxt, op, inputs):
    """BiasAdd (either data format) of a permuted tensor: a BiasAdd NHWC on the physical
    data when the channel axis is physically last, else an AddV2 of the bias reshaped
    to broadcast along the physical channel axis (no transpose either way)."""
    x, bias = inputs
    perm = x.perm
    rank = len(perm)
    fmt = op.attrs.get("data_format", b"NHWC")
    k = perm[1 if fmt in (b"NCHW", "NCHW") else rank - 1]
    if k == rank - 1:
        return [Permuted(o, perm) for o in nxt.execute(_shape_op("BiasAdd", x.dtype),
                                                       [x.value, physical(bias)])]
    length = physical(bias).shape[0]
    shape = [1] * rank
    shape[k] = -1 if length is None else int(length)
    b = reshape(nxt, physical(bias), shape)
    return [Permuted(o, perm) for o in nxt.execute(Op.cached("AddV2", T=x.dtype),
                                                   [x.value, b])]


def ensure_shape(handler, nxt, op, inputs):
    (x,) = inputs
    if type(x) is not Permuted:
        return nxt.execute(op, inputs)
    shape = op.attrs["shape"]
    if shape.rank != len(x.perm):
        return fallback(handler, nxt, op, inputs)
    dims = shape.as_list()
    phys = [dims[i] for i in inverse(x.perm)]
    (out,) = nxt.execute(op.replace(shape=tf.TensorShape(phys)), [x.value])
    return [Permuted(out, x.perm)]


# Every elementwise op of core's table: layout-agnostic on same-layout inputs.
RULES = {name: elementwise for name in op_kinds.ELEMENTWISE}
RULES.update({name: reduction for name in (
    "Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "EuclideanNorm")})
RULES.update({name: per_axis_vectors for name in ("Pad", "PadV2", "MirrorPad", "Slice", "Tile")})
RULES.update({
    "ArgMax": arg_reduction, "ArgMin": arg_reduction, "Transpose": transpose_rule,
    "Shape": shape_rule, "ShapeN": shape_rule, "Size": physical_only, "Rank": physical_only,
    "ConcatV2": concat, "Split": split, "SplitV": split_v, "Reshape": reshape_rule,
    "Squeeze": squeeze, "ExpandDims": expand_dims, "Softmax": last_axis,
    "LogSoftmax": last_axis, "IdentityN": identity_n, "EnsureShape": ensure_shape,
    "BroadcastTo": broadcast_to,
})
