"""SPMD rules of `oh.Mesh` (tf_ophandlers/handlers/mesh/handler.py), one table entry per op type.

A rule is `rule(mesh, op, inputs) -> outputs or None`: `inputs` are `MeshValue`s (local
shards + a layout), the rule relayouts what it must (`mesh.relayout_value`), runs the op
on every device's shards (`mesh.run`), adds the communication the layouts need
(`mesh.all_reduce`) and returns `MeshValue`s with the output layouts. `None` sends the op
to the mesh's fallback (gather to full, run once, replicate), which is always correct.

>>> RULES["Relu"] is elementwise
True
"""
import string

import numpy as np
import tensorflow as tf

from tf_ophandlers.extend import BoundedCache, Op, op_kinds

# Contraction plans (layout decisions), per (letters, input layouts, input shapes): they
# depend on nothing else (the mesh's dimension names appear in the layouts).
_plans = BoundedCache("mesh.contraction_plans", 4096)
# Reduction plans, per (op type, input layout and shape, axes, keep_dims, dtype, mesh dims).
_reduction_plans = BoundedCache("mesh.reduction_plans", 4096)
# Elementwise broadcasting plans, per ((layout, shape) of each input): the op type and
# attributes do not enter (every elementwise op broadcasts the same way).
_broadcast_plans = BoundedCache("mesh.broadcast_plans", 4096)
_MISSING = object()


class MeshValue:
    """`oh.Mesh`'s representation: one next-stack tensor per mesh device (`shards`, in
    the mesh's device order), the `layout` (one mesh dimension name or None per tensor
    axis) and the global `shape` (a tuple of ints). Resource handles (variables) carry a
    `var` (`VarInfo`: the layout, shape and dtype of the variable's value). `relayouts`:
    the value's relayouts made so far ({layout: MeshValue}, `Mesh.relayout_value`), so
    that the ops of one value used twice in a new layout (a gradient's two terms) slice or
    gather it once."""

    __slots__ = ("shards", "layout", "shape", "var", "relayouts")

    def __init__(self, shards, layout, shape, var=None):
        self.shards = tuple(shards)
        self.layout = tuple(layout)
        self.shape = tuple(shape)
        self.var = var
        self.relayouts = None

    @property
    def dtype(self):
        return self.shards[0].dtype

    @property
    def replicated(self):
        return not any(self.layout)

    def __repr__(self):
        return "MeshValue(layout=%s, shape=%s)" % (self.layout, self.shape)


class VarInfo:
    """What a mesh resource handle knows about its variable's value (mutable). `chosen`:
    the layout was chosen (a sharded initial value, `shard_variable`, or adopted from
    the first sharded value written, as an optimizer's slot variables do); a replicated
    layout not chosen follows the first sharded write. `adopt`: (layout, dtype) of such a
    write seen while a function was replayed, applied eagerly before the next call
    (`mesh_variables.adopt_var_layout`)."""

    __slots__ = ("layout", "shape", "broadcast", "chosen", "adopt", "__weakref__")

    def __init__(self, layout=None, shape=None, broadcast=False, chosen=False):
        self.layout, self.shape, self.broadcast = layout, shape, broadcast
        self.chosen, self.adopt = chosen, None


def static_input(mesh, value, what, op):
    """The value of a replicated integer input (axes, permutations, shapes) as numpy."""
    v = tf.get_static_value(value.shards[0]) if value.replicated else None
    if v is None:
        return None
    return np.asarray(v)


def outputs(shards_per_output, layout, shape):
    return [MeshValue(s, layout, shape) for s in shards_per_output]


# -- elementwise with broadcasting ---------------------------------------------------

def _broadcast_shape(shapes):
    try:
        return tuple(np.broadcast_shapes(*[tuple(s) for s in shapes]))
    except (ValueError, TypeError):
        return None


def elementwise(mesh, op, inputs):
    """Unary/binary/n-ary elementwise ops with numpy broadcasting: every input is
    relayouted to one target layout (the first sharding found per output axis)."""
    first = inputs[0]
    if all(v.shape == first.shape and v.layout == first.layout for v in inputs[1:]) \
            and None not in first.shape:  # the common case: nothing to relayout
        return outputs(mesh.run(op, inputs), first.layout, first.shape)
    key = tuple((v.layout, v.shape) for v in inputs)
    plan = _broadcast_plans.get(key, _MISSING)
    if plan is _MISSING:
        plan = _broadcast_plans[key] = _broadcast_plan(inputs)
    if plan is None:
        return None
    wants, target, shape = plan
    args = [mesh.relayout_value(v, want) for v, want in zip(inputs, wants)]
    return outputs(mesh.run(op, args), target, shape)


def _broadcast_plan(inputs):
    """(input layouts, output layout, output shape) of an elementwise op with numpy
    broadcasting, or None (unknown or incompatible shapes)."""
    if any(None in v.shape for v in inputs):
        return None
    shape = _broadcast_shape([v.shape for v in inputs])
    if shape is None:
        return None
    rank = len(shape)
    target, used = [None] * rank, set()
    for v in inputs:
        off = rank - len(v.shape)
        for i, m in enumerate(v.layout):
            a = off + i
            if m is not None and target[a] is None and m not in used and v.shape[i] == shape[a]:
                target[a] = m
                used.add(m)
    wants = []
    for v in inputs:
        off = rank - len(v.shape)
        wants.append(tuple(target[off + i] if v.shape[i] == shape[off + i] else None
                           for i in range(len(v.shape))))
    return wants, tuple(target), shape


# -- contractions: MatMul, BatchMatMul, Einsum -----------------------------------------

def _contract(mesh, op, inputs, letters, out_letters, small_op=None):
    """Each index letter gets one mesh dimension (the first input sharding it); inputs
    are relayouted to that assignment; letters summed over and sharded give partial sums
    that are all-reduced over their mesh dimensions. The plan is cached per (letters,
    layouts, shapes, mesh dimension sizes). `small_op`: the op launched eagerly instead
    of `op` when each device's product is small (`_matmul`)."""
    if len(inputs) == 2:  # MatMul, BatchMatMul: no generator objects on the hot path
        a, b = inputs
        key = (tuple(letters), out_letters, a.layout, b.layout, a.shape, b.shape,
               mesh.dims_key)
    else:
        key = (tuple(letters), out_letters, mesh.dims_key) + tuple(
            v.layout for v in inputs) + tuple(v.shape for v in inputs)
    plan = _plans.get(key, _MISSING)
    if plan is _MISSING:
        plan = _plans[key] = _contract_plan(mesh, inputs, letters, out_letters)
    if plan is None:
        return None
    wants, summed, layout, shape, work, distinct = plan
    args = [mesh.relayout_value(v, want) for v, want in zip(inputs, wants)]
    (shards,) = mesh.run(op, args, small_op if work <= _SMALL_PRODUCT else None, distinct)
    if summed:
        shards = mesh.all_reduce(shards, summed, "sum")
    return [MeshValue(shards, layout, shape)]


def _contract_plan(mesh, inputs, letters, out_letters):
    """(input layouts, summed mesh dimensions, output layout, output shape, multiply-adds
    per device, whether every device gets distinct input shards) or None."""
    if any(None in v.shape for v in inputs):
        return None
    size = {}
    for v, ls in zip(inputs, letters):
        if len(ls) != len(v.shape) or len(set(ls)) != len(ls):
            return None  # diagonals, wrong ranks: gather
        for l, n in zip(ls, v.shape):
            if size.get(l, 1) != 1 and n not in (1, size[l]):
                return None
            size[l] = max(size.get(l, 1), n)
    assign, used = {}, set()
    for v, ls in zip(inputs, letters):
        for l, m, n in zip(ls, v.layout, v.shape):
            if m is not None and l not in assign and m not in used and n == size[l]:
                assign[l] = m
                used.add(m)
    wants = [tuple(assign.get(l) if n == size[l] else None for l, n in zip(ls, v.shape))
             for v, ls in zip(inputs, letters)]
    summed = [assign[l] for l in assign if l not in out_letters]
    work = int(np.prod([n // mesh.dim_size(assign[l]) if l in assign else n
                        for l, n in size.items()]))
    # Every mesh dimension assigned: devices differ in a slice of some input (no two
    # share all their input shards), so `run` need not look for shared ones.
    distinct = len(used) == len(mesh.dims)
    return (wants, summed, tuple(assign.get(l) for l in out_letters),
            tuple(size[l] for l in out_letters), work, distinct)


_MATMUL_LETTERS = {(ta, tb): ("ki" if ta else "ik", "jk" if tb else "kj")
                   for ta in (False, True) for tb in (False, True)}


# Small real products launched eagerly as BatchMatMulV3 (2-D: the same product, the
# same sgemm, equal results): TensorFlow's eager runtime rewrites every MatMul launch to
# its oneDNN op first, which costs CPU per launch on small shards. Above 2**20
# multiply-adds per device oneDNN's MatMul is the faster kernel.
_SMALL_PRODUCT = 1 << 20
_small_matmuls = {}  # (id of the dtype, transpose_a, transpose_b) -> Op or None


def _small_matmul(dtype, ta, tb):
    key = (id(dtype), ta, tb)  # DTypes are interned; hashing one runs Python code
    op = _small_matmuls.get(key, _MISSING)
    if op is _MISSING:
        op = _small_matmuls[key] = Op.cached(  # real dtypes: adjoint == transpose
            "BatchMatMulV3", Ta=dtype, Tb=dtype, Tout=dtype, adj_x=ta, adj_y=tb
        ) if dtype in (tf.float32, tf.float64) else None
    return op


def _matmul(mesh, op, inputs):
    a, b = inputs
    if len(a.shape) != 2 or len(b.shape) != 2:
        return None
    attrs = op.attrs
    ta, tb = bool(attrs.get("transpose_a")), bool(attrs.get("transpose_b"))
    return _contract(mesh, op, inputs, _MATMUL_LETTERS[ta, tb], "ij",
                     _small_matmul(attrs.get("T"), ta, tb))


def _batch_matmul(mesh, op, inputs):
    a, b = inputs
    ra, rb = len(a.shape), len(b.shape)
    if ra < 2 or rb < 2:
        return None
    nb = max(ra, rb) - 2
    batch = string.ascii_uppercase[:nb]
    la = batch[nb - (ra - 2):] + ("ki" if op.attrs.get("adj_x") else "ik")
    lb = batch[nb - (rb - 2):] + ("jk" if op.attrs.get("adj_y") else "kj")
    return _contract(mesh, op, inputs, [la, lb], batch + "ij")


def _einsum(mesh, op, inputs):
    eq = op.attrs["equation"]
    eq = (eq.decode() if isinstance(eq, bytes) else eq).replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(inputs):
        return None
    fresh = iter("0123456789!@#$%^&*")
    ell_rank = max([len(v.shape) - (len(t) - 3) for t, v in zip(terms, inputs) if "..." in t],
                   default=0)
    ell = "".join(next(fresh) for _ in range(ell_rank))
    letters = []
    for t, v in zip(terms, inputs):
        if "..." in t:
            k = len(v.shape) - (len(t) - 3)
            t = t.replace("...", ell[ell_rank - k:] if k else "")
        letters.append(t)
    if not arrow:
        counts = {}
        for t in letters:
            for l in t:
                counts[l] = counts.get(l, 0) + 1
        out = ell + "".join(sorted(l for l, c in counts.items() if c == 1 and l not in ell))
    else:
        out = out.replace("...", ell)
    return _contract(mesh, op, inputs, letters, out)


# -- reductions ------------------------------------------------------------------------

_REDUCE_KIND = {"Sum": "sum", "Mean": "sum", "Max": "max", "Min": "min", "Prod": "prod",
                "All": "all", "Any": "any"}


def _reduction(mesh, op, inputs):
    x, axes_v = inputs
    axes = static_input(mesh, axes_v, "axes", op)
    if axes is None or None in x.shape:
        return None
    keep = bool(op.attrs.get("keep_dims"))
    key = (op.type, x.layout, x.shape, axes.tobytes(), axes.shape, keep,
           x.shards[0].dtype, mesh.dims_key)
    plan = _reduction_plans.get(key)
    if plan is None:
        plan = _reduction_plans[key] = _reduction_plan(mesh, op, x, axes, keep)
    relayout, summed, kind, k, layout, shape = plan
    if relayout is not None:
        x = mesh.relayout_value(x, relayout)
    if summed and mesh.shares_host_memory:
        # A host-memory mesh combines first: the shards of a group (devices differing
        # only in the reduced mesh dimensions; equal local shapes) are combined
        # elementwise (one AddN, Maximum, ...) and the group's shared result reduced once
        # (`run` runs an op once per distinct inputs): 2 ops per group instead of one per
        # device plus one per group. Linear (sum) or associative (max, min, prod, all,
        # any), so the values are those of reducing each shard then combining.
        combined = mesh.all_reduce(x.shards, summed, kind)
        (shards,) = mesh.run(op, [MeshValue(combined, x.layout, x.shape), axes_v])
        if k is not None:  # a Mean: the group's mean of means
            shards = mesh.all_reduce(shards, (), "sum", divide_by=k)
        return [MeshValue(shards, layout, shape)]
    (shards,) = mesh.run(op, [x, axes_v])
    if summed:
        shards = mesh.all_reduce(shards, summed, kind, divide_by=k)
    return [MeshValue(shards, layout, shape)]


def _reduction_plan(mesh, op, x, axes, keep):
    """(layout to relayout x to or None, summed mesh dimensions, combine kind, divisor
    of a mean or None, output layout, output shape) of a reduction."""
    rank = len(x.shape)
    axes = sorted({int(a) % rank for a in np.atleast_1d(axes)}) if rank else []
    layout = x.layout
    relayout = None
    if op.type == "Mean" and not x.dtype.is_floating:
        relayout = layout = tuple(None if a in axes else m for a, m in enumerate(layout))
    summed = tuple(layout[a] for a in axes if layout[a] is not None)
    k = int(np.prod([mesh.dim_size(m) for m in summed])) if (
        summed and op.type == "Mean") else None
    out_layout = tuple(None if a in axes else m for a, m in enumerate(layout)
                       if keep or a not in axes)
    shape = tuple(1 if a in axes else n for a, n in enumerate(x.shape) if keep or a not in axes)
    return relayout, summed, _REDUCE_KIND[op.type], k, out_layout, shape


def _argminmax(mesh, op, inputs):
    x, axis_v = inputs
    axis = static_input(mesh, axis_v, "axis", op)
    if axis is None or None in x.shape:
        return None
    axis = int(axis) % len(x.shape)
    x = mesh.relayout_value(x, tuple(None if a == axis else m for a, m in enumerate(x.layout)))
    layout = tuple(m for a, m in enumerate(x.layout) if a != axis)
    shape = tuple(n for a, n in enumerate(x.shape) if a != axis)
    return outputs(mesh.run(op, [x, axis_v]), layout, shape)


# -- shapes: Transpose, Reshape, ExpandDims, Squeeze, ConcatV2 ---------------------------

def _transpose(mesh, op, inputs):
    x, perm_v = inputs
    perm = static_input(mesh, perm_v, "perm", op)
    if perm is None:
        return None
    perm = [int(p) for p in perm]
    return outputs(mesh.run(op, [x, perm_v]), tuple(x.layout[p] for p in perm),
                tuple(x.shape[p] for p in perm))


def _reshape_groups(src, dst):
    """Pairs (input axes, output axes), size-1 axes left out, whose products match."""
    si = [a for a, n in enumerate(src) if n != 1]
    dj = [a for a, n in enumerate(dst) if n != 1]
    groups, i, j = [], 0, 0
    while i < len(si) and j < len(dj):
        gi, gj, pi, pj = [si[i]], [dj[j]], src[si[i]], dst[dj[j]]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                if i >= len(si):
                    return None
                gi.append(si[i])
                pi, i = pi * src[si[i]], i + 1
            else:
                if j >= len(dj):
                    return None
                gj.append(dj[j])
                pj, j = pj * dst[dj[j]], j + 1
        groups.append((gi, gj))
    return groups if i == len(si) and j == len(dj) else None


def _reshape(mesh, op, inputs):
    x, shape_v = inputs
    target = static_input(mesh, shape_v, "shape", op)
    if target is None or None in x.shape:
        return None
    target = [int(n) for n in np.atleast_1d(target)]
    total = int(np.prod(x.shape))
    if target.count(-1) == 1:
        rest = int(np.prod([n for n in target if n != -1]))
        if rest == 0 or total % rest:
            return None
        target[target.index(-1)] = total // rest
    if int(np.prod(target)) != total or total == 0:
        return None
    groups = _reshape_groups(list(x.shape), target)
    if groups is None:
        return None
    want, out_layout = [None] * len(x.shape), [None] * len(target)
    for gi, gj in groups:
        m = x.layout[gi[0]]
        if m is not None and target[gj[0]] % mesh.dim_size(m) == 0:
            want[gi[0]] = m
            out_layout[gj[0]] = m
    x = mesh.relayout_value(x, tuple(want))
    local = [n // mesh.dim_size(m) if m else n for n, m in zip(target, out_layout)]
    local_v = mesh.constant(np.asarray(local, dtype=shape_v.dtype.as_numpy_dtype))
    return outputs(mesh.run(op, [x, local_v]), tuple(out_layout), tuple(target))


def _expand_dims(mesh, op, inputs):
    x, axis_v = inputs
    axis = static_input(mesh, axis_v, "axis", op)
    if axis is None:
        return None
    axis = int(axis) % (len(x.shape) + 1)
    layout = x.layout[:axis] + (None,) + x.layout[axis:]
    return outputs(mesh.run(op, [x, axis_v]), layout, x.shape[:axis] + (1,) + x.shape[axis:])


def _squeeze(mesh, op, inputs):
    (x,) = inputs
    dims = op.attrs.get("squeeze_dims") or [a for a, n in enumerate(x.shape) if n == 1]
    dims = {int(d) % len(x.shape) for d in dims}
    if None in x.shape:
        return None
    keep = [a for a in range(len(x.shape)) if a not in dims]
    return outputs(mesh.run(op, [x]), tuple(x.layout[a] for a in keep),
                tuple(x.shape[a] for a in keep))


def _concat(mesh, op, inputs):
    *values, axis_v = inputs
    axis = static_input(mesh, axis_v, "axis", op)
    if axis is None or any(None in v.shape for v in values):
        return None
    rank = len(values[0].shape)
    axis = int(axis) % rank
    target, used = [None] * rank, set()
    for v in values:
        for a, m in enumerate(v.layout):
            if a != axis and m is not None and target[a] is None and m not in used:
                target[a] = m
                used.add(m)
    values = [mesh.relayout_value(v, tuple(target)) for v in values]
    shape = list(values[0].shape)
    shape[axis] = sum(v.shape[axis] for v in values)
    return outputs(mesh.run(op, values + [axis_v]), tuple(target), tuple(shape))


def _split(mesh, op, inputs):
    """Split/SplitV (a concatenation's gradient): the split axis is gathered first."""
    if op.type == "Split":
        axis_v, x = inputs
        rest = []
    else:
        x, sizes_v, axis_v = inputs
        rest = [sizes_v]
    axis = static_input(mesh, axis_v, "axis", op)
    if axis is None or None in x.shape:
        return None
    axis = int(axis) % len(x.shape)
    x = mesh.relayout_value(x, tuple(None if a == axis else m for a, m in enumerate(x.layout)))
    args = [axis_v, x] if op.type == "Split" else [x] + rest + [axis_v]
    results = []
    for shards in mesh.run(op, args):
        shape = list(x.shape)
        shape[axis] = shards[0].shape[axis]
        results.append(MeshValue(shards, x.layout, shape))
    return results


def _broadcast_to(mesh, op, inputs):
    x, shape_v = inputs
    target = static_input(mesh, shape_v, "shape", op)
    if target is None or None in x.shape:
        return None
    target = tuple(int(n) for n in np.atleast_1d(target))
    if _broadcast_shape([x.shape, target]) != target:
        return None
    off = len(target) - len(x.shape)
    layout = [None] * off + [m if n == target[off + a] else None
                             for a, (m, n) in enumerate(zip(x.layout, x.shape))]
    x = mesh.relayout_value(x, tuple(layout[off:]))
    local = [n // mesh.dim_size(m) if m else n for n, m in zip(target, layout)]
    local_v = mesh.constant(np.asarray(local, dtype=shape_v.dtype.as_numpy_dtype))
    return outputs(mesh.run(op, [x, local_v]), tuple(layout), target)


def _slice(mesh, op, inputs):
    """Slice: axes taken whole keep their sharding; sliced axes are gathered first."""
    x, begin_v, size_v = inputs
    begin, size = static_input(mesh, begin_v, "begin", op), static_input(mesh, size_v, "size", op)
    if begin is None or size is None or None in x.shape:
        return None
    begin, size = [int(b) for b in begin], [int(n) for n in size]
    size = [n - b if k == -1 else k for b, k, n in zip(begin, size, x.shape)]
    whole = [b == 0 and k == n for b, k, n in zip(begin, size, x.shape)]
    layout = tuple(m if w else None for m, w in zip(x.layout, whole))
    x = mesh.relayout_value(x, layout)
    local = [k // mesh.dim_size(m) if m else k for k, m in zip(size, layout)]
    local_v = mesh.constant(np.asarray(local, dtype=size_v.dtype.as_numpy_dtype))
    return outputs(mesh.run(op, [x, begin_v, local_v]), layout, tuple(size))


def _strided_slice(mesh, op, inputs):
    """StridedSlice without ellipsis or new axes: axes taken whole (stride 1) keep their
    sharding; others are gathered first; shrunk axes disappear."""
    x, b_v, e_v, s_v = inputs
    a = op.attrs
    if a.get("ellipsis_mask") or a.get("new_axis_mask") or None in x.shape:
        return None
    begin, end, strides = (static_input(mesh, v, "slice", op) for v in (b_v, e_v, s_v))
    if begin is None or end is None or strides is None or len(begin) != len(x.shape):
        return None
    bm, em, sm = a.get("begin_mask", 0), a.get("end_mask", 0), a.get("shrink_axis_mask", 0)
    whole = [(bm >> i & 1 or begin[i] == 0) and (em >> i & 1 or end[i] >= n)
             and strides[i] == 1 and not sm >> i & 1 for i, n in enumerate(x.shape)]
    layout = tuple(m if w else None for m, w in zip(x.layout, whole))
    x = mesh.relayout_value(x, layout)
    local_end = np.array(end)
    for i, m in enumerate(layout):
        if m is not None:
            local_end[i] = x.shape[i] // mesh.dim_size(m)
    e_local = mesh.constant(local_end.astype(e_v.dtype.as_numpy_dtype))
    outs = mesh.run(op, [x, b_v, e_local, s_v])
    kept = [i for i in range(len(x.shape)) if not sm >> i & 1]
    shape = []
    for i in kept:
        sl = slice(None if bm >> i & 1 else int(begin[i]), None if em >> i & 1 else int(end[i]),
                   int(strides[i]))
        shape.append(len(range(*sl.indices(x.shape[i]))))
    return outputs(outs, tuple(layout[i] for i in kept), tuple(shape))


# -- shape queries: computed from the global shape ------------------------------------

def _shape(mesh, op, inputs):
    dtype = op.attrs.get("out_type", tf.int32).as_numpy_dtype
    if op.type == "ShapeN":
        if any(None in v.shape for v in inputs):
            return None
        return [mesh.constant(np.asarray(v.shape, dtype)) for v in inputs]
    (x,) = inputs
    if None in x.shape:
        return None
    if op.type == "Shape":
        value = np.asarray(x.shape, dtype)
    elif op.type == "Size":
        value = np.asarray(int(np.prod(x.shape)), dtype)
    else:  # Rank
        value = np.asarray(len(x.shape), np.int32)
    return [mesh.constant(value)]


# -- the table -------------------------------------------------------------------------

def _identity_n(mesh, op, inputs):
    """IdentityN (a custom gradient's outputs): every input keeps its layout."""
    return [MeshValue(s, v.layout, v.shape) for s, v in zip(mesh.run(op, inputs), inputs)]


# Every elementwise op of core's table: sharded like its (broadcast) inputs.
RULES = {t: elementwise for t in op_kinds.ELEMENTWISE}
RULES["IdentityN"] = _identity_n
RULES.update({"MatMul": _matmul, "BatchMatMul": _batch_matmul,
              "BatchMatMulV2": _batch_matmul, "BatchMatMulV3": _batch_matmul,
              "Einsum": _einsum, "Transpose": _transpose, "Reshape": _reshape,
              "ExpandDims": _expand_dims, "Squeeze": _squeeze, "ConcatV2": _concat,
              "Shape": _shape, "ShapeN": _shape, "Size": _shape, "Rank": _shape,
              "ArgMax": _argminmax, "ArgMin": _argminmax,
              "BroadcastTo": _broadcast_to, "Slice": _slice,
              "StridedSlice": _strided_slice, "Split": _split, "SplitV": _split})
RULES.update({t: _reduction for t in _REDUCE_KIND})
