"""Batching rules of `oh.vectorized_map`: the representation `Batched` and, per op type,
a rule ``rule(handler, execute, op, inputs) -> [Batched] or None`` (None: no rule for
these inputs), as JAX's `batching.primitive_batchers` table. handler.py looks ops
up in `RULES` first, then falls back to TensorFlow's pfor converters, then to a loop.
"""
import numpy as np
import tensorflow as tf
from tensorflow.python.framework.ops import EagerTensor as _EagerTensor

from tf_ophandlers.extend import (
    BoundedCache, executing_eagerly as _executing_eagerly, Op, op_kinds)


class Batched:
    """A value and whether its leading axis is the batch (the handler's representation)."""

    __slots__ = ("value", "batched")

    def __init__(self, value, batched):
        self.value = value
        self.batched = batched

    def __repr__(self):
        return "Batched(%r, batched=%s)" % (self.value, self.batched)


def _ndim(v):
    """Rank of a tensor (None if unknown); an eager tensor's without a TensorShape (this
    runs for every input of a batched op)."""
    if type(v) is _EagerTensor:
        return len(v._shape_tuple())  # pylint: disable=protected-access
    return v.shape.rank


def _rank(b):
    """Per-example rank of a Batched."""
    v = b.value  # (_ndim, inlined: per input of a batched op)
    r = len(v._shape_tuple()) if type(v) is _EagerTensor else v.shape.rank  # pylint: disable=protected-access
    return r - 1 if b.batched and r is not None else r


# Constants for shapes, axes and permutations, by value and dtype (a few per program):
# the rule of an op signature seen before builds none.
_shape_constants = BoundedCache("vectorized_map.shape_constants", 4096)
# (op type, attributes, replaced attributes) -> Op: the rewritten ops of the rules.
_replaced = BoundedCache("vectorized_map.replaced_ops", 4096)


def _constant(values, dtype):
    """A (cached) constant tensor of `values` (an int or a flat sequence of ints) of
    `dtype` (a tf.DType or a numpy dtype: keyed as given, the entries of both spellings
    hold equal constants)."""
    value = (int(values) if isinstance(values, (int, np.integer))
             else tuple(map(int, values)))
    if not _executing_eagerly():  # replaying a function: a constant of that graph
        return tf.constant(value, dtype=dtype)
    key = (value, dtype)
    t = _shape_constants.get(key)
    if t is None:
        t = _shape_constants[key] = tf.constant(value, dtype=dtype)
    return t


def _int32(values):
    """A (cached) int32 tensor: shape arguments as tensors keep TensorFlow's op wrappers
    on their fast path (a Python list sends tf.reshape to its slow eager fallback)."""
    return _constant(values, tf.int32)


_INT32 = tf.int32


# dtype enum -> the Reshape Op of `_reshaped` (bounded by TensorFlow's dtypes).
_reshape_ops = {}


def _reshaped(execute, value, shape):
    """`value` reshaped to `shape` (ints, -1 allowed) with one Reshape run by `execute`:
    no TensorFlow op wrapper on the path (this runs for every batched matmul)."""
    if type(value) is _EagerTensor:
        enum = value._datatype_enum()  # pylint: disable=protected-access
    else:
        enum = value.dtype.as_datatype_enum
    reshape = _reshape_ops.get(enum)
    if reshape is None:
        reshape = _reshape_ops[enum] = Op.cached("Reshape", T=_DTYPES[enum], Tshape=_INT32)
    return execute(reshape, [value, _int32(shape)])[0]


def dtype_of(v):
    """The tf.DType of a tensor (of an eager one by its enum: `dtype` is a Python
    property)."""
    if type(v) is _EagerTensor:
        return _DTYPES[v._datatype_enum()]  # pylint: disable=protected-access
    return v.dtype


class _DtypeTable(dict):
    """dtype enum -> tf.DType (bounded by TensorFlow's dtypes)."""

    def __missing__(self, enum):
        d = self[enum] = tf.as_dtype(enum)
        return d


_DTYPES = DTYPES = _DtypeTable()  # (public: vectorized_map's value_dtype reads it)


def static_shape(v):
    """The static shape of a tensor as a tuple (None for unknown dims), or None for an
    unknown rank; an eager tensor's without building a TensorShape."""
    if type(v) is _EagerTensor:
        return v._shape_tuple()  # pylint: disable=protected-access
    shape = v.shape
    return None if shape.rank is None else tuple(shape.as_list())


def _replace(op, **attrs):
    """`op.replace(**attrs)`, memoized per op signature (Ops are read-only templates)."""
    key = (op.type, op.attrs_key(), tuple(sorted(attrs.items())))
    new = _replaced.get(key)
    if new is None:
        new = _replaced[key] = op.replace(**attrs)
    return new


def _prepended(first, values):
    """A constant: `values` (a numpy array) with `first` in front, in their dtype."""
    return _constant((first,) + tuple(values.tolist()), values.dtype)


def batched(outputs):
    return [Batched(o, True) for o in outputs]


def known_value(t):
    """`t`'s value as a NumPy array where it is known (eager, or constant in a graph), else None."""
    if type(t) is _EagerTensor:  # its value, as tf.get_static_value gives it
        try:
            return np.asarray(t.numpy())
        except tf.errors.UnimplementedError:  # (a resource or variant tensor)
            return None
    v = tf.get_static_value(t)
    return None if v is None else np.asarray(v)


def broadcast_batch(b, size):
    """`b` as a batched value (an unbatched one is broadcast along a new batch axis)."""
    if b.batched:
        return b.value
    v = b.value
    if dtype_of(v) == tf.variant and _ndim(v) == 0:
        return _batched_list(v, size)
    return tf.broadcast_to(v[None], tf.concat([[size], tf.shape(v)], 0))


def _batched_list(handle, size):
    """An unbatched TensorList as a batched one (pfor's: one list whose elements are the
    examples' elements stacked), by pfor's own stacking; e.g. a while loop's gradient
    accumulator that starts empty and receives per-example values."""
    from tensorflow.python.ops.parallel_for import pfor as _pfor  # pylint: disable=import-outside-toplevel
    if not _pfor._is_variant_with_internal_stacking(handle):  # pylint: disable=protected-access
        raise ValueError(
            "oh.vectorized_map: a variant tensor that is not a TensorList (or whose element "
            "type is unknown: an eager list made by a raw op) cannot be broadcast over the "
            "batch (%r)" % (handle,))
    return _pfor._stack(handle, tf.constant([size])).t  # pylint: disable=protected-access


def _align(inputs, rank):
    """Batched values expanded to per-example rank `rank` (for broadcasting ops)."""
    out = []
    for b in inputs:
        v = b.value
        if b.batched:
            missing = rank - (_ndim(v) - 1)
            if missing > 0:
                v = tf.reshape(v, tf.concat([tf.shape(v)[:1], tf.ones([missing], tf.int32),
                                             tf.shape(v)[1:]], 0))
        out.append(v)
    return out


# -- direct rules: fn(handler, execute, op, inputs) -> list of Batched or None (no rule) ----

def _elementwise(handler, execute, op, inputs):
    """Ops that broadcast their inputs like numpy (and unary elementwise ops)."""
    ranks = [_rank(b) for b in inputs]
    if None in ranks:
        return None
    return batched(execute(op, _align(inputs, max(ranks))))


def _same_shape(handler, execute, op, inputs):
    """Elementwise ops whose inputs must have one shape (the *Grad kernels)."""
    return batched(execute(op, [broadcast_batch(b, handler.size) for b in inputs]))


# (dtype, transpose_a, transpose_b) -> the BatchMatMulV2 Op of `_matmul` (a few).
_bmm_ops = {}
# A MatMul's serialized attributes -> (dtype, transpose_a, transpose_b). TensorFlow
# serializes the attribute map in hash-table order (a few hundred byte strings for the
# same attributes), which misses op.attrs' shared decode cache most of the time; this one
# holds only MatMuls' strings, so it fills once and then hits.
_matmul_attrs = BoundedCache("vectorized_map.matmul_attrs", 4096)


def _matmul(handler, execute, op, inputs):
    a, b = inputs
    if _rank(a) != 2 or _rank(b) != 2:
        return None
    raw = op._attrs_proto()  # pylint: disable=protected-access
    key = _matmul_attrs.get(raw)
    if key is None:
        attrs = op.attrs
        key = _matmul_attrs[raw] = (attrs["T"], attrs["transpose_a"], attrs["transpose_b"])
    dtype, transpose_a, transpose_b = key
    if dtype.is_complex and (transpose_a or transpose_b):
        return None  # BatchMatMul's adj_x/adj_y would also conjugate: leave it to pfor
    if a.batched and not b.batched and not transpose_a:
        # [B, m, k] @ [k, n]: one MatMul on [B*m, k] (much faster than a broadcast
        # batched matmul), as pfor's converter does.
        shape = static_shape(a.value)
        if None not in shape[1:]:
            flat = _reshaped(execute, a.value, (-1, shape[2]))
            (out,) = execute(op, [flat, b.value])
            return [Batched(_reshaped(execute, out, (handler.size, shape[1], -1)), True)]
    bmm = _bmm_ops.get(key)
    if bmm is None:
        bmm = _bmm_ops[key] = Op.cached("BatchMatMulV2", T=key[0], adj_x=key[1],
                                        adj_y=key[2])
    return batched(execute(bmm, [a.value, b.value]))


def _shift_axes(axes, rank):
    axes = np.atleast_1d(axes).astype(np.int64)
    return [int(a) % rank + 1 for a in axes] if rank else []


# (axes as bytes, their shape and dtype, per-example rank) -> the shifted axes constant.
_shifted = BoundedCache("vectorized_map.shifted_axes", 4096)


def _reduction(handler, execute, op, inputs):
    x, axis = inputs
    rank = _rank(x)
    if not x.batched or axis.batched or rank is None:
        return None
    axes = known_value(axis.value)
    if axes is None:
        return None
    key = (axes.tobytes(), axes.shape, axes.dtype.str, rank)
    eager = _executing_eagerly()
    shifted = _shifted.get(key) if eager else None
    if shifted is None:
        new = _shift_axes(axes, rank)
        if axes.ndim == 0:
            new = new[0]  # ArgMax/ArgMin take a scalar axis
        shifted = _constant(new, dtype_of(axis.value))
        if eager:
            _shifted[key] = shifted
    return batched(execute(op, [x.value, shifted]))


def _reshape(handler, execute, op, inputs):
    x, shape = inputs
    if not x.batched or shape.batched:
        return None
    target = known_value(shape.value)
    if target is None:
        return None
    return batched(execute(op, [x.value, _prepended(handler.size, target)]))


def _transpose(handler, execute, op, inputs):
    x, perm = inputs
    p = known_value(perm.value)
    if not x.batched or perm.batched or p is None:
        return None
    rank = len(p)  # the permutation's length is the per-example rank, known or not
    new = _constant([0] + [int(i) % rank + 1 for i in p], perm.value.dtype)
    return batched(execute(op, [x.value, new]))


def _expand_dims(handler, execute, op, inputs):
    x, axis = inputs
    a = known_value(axis.value)
    if not x.batched or axis.batched or a is None:
        return None
    a = int(a)
    if a < 0:
        rank = _rank(x)
        if rank is None:
            return None
        a += rank + 1
    new = _constant(a + 1, axis.value.dtype)
    return batched(execute(op, [x.value, new]))


def _squeeze(handler, execute, op, inputs):
    (x,) = inputs
    dims = op.attrs.get("squeeze_dims") or []
    rank = _rank(x)
    if rank is None:
        return None
    if not dims:
        shape = x.value.shape[1:]
        if not shape.is_fully_defined():
            return None
        dims = [i for i, d in enumerate(shape) if d == 1]
        if not dims:
            return [Batched(x.value, True)]  # nothing to squeeze (never the batch axis)
    new = _replace(op, squeeze_dims=tuple(int(d) % rank + 1 for d in dims))
    return batched(execute(new, [x.value]))


def _concat(handler, execute, op, inputs):
    *values, axis = inputs
    a = known_value(axis.value)
    if axis.batched or a is None:
        return None
    rank = _rank(next(b for b in values if b.batched))
    if rank is None:
        return None
    new_axis = _constant(int(a) % rank + 1, axis.value.dtype)
    vals = [broadcast_batch(b, handler.size) for b in values]
    return batched(execute(op, vals + [new_axis]))


def _pack(handler, execute, op, inputs):
    rank = _rank(next(b for b in inputs if b.batched))
    axis = op.attrs["axis"]
    if axis < 0 and rank is None:
        return None
    new = _replace(op, axis=(axis if axis >= 0 else axis + rank + 1) + 1)
    return batched(execute(new, [broadcast_batch(b, handler.size) for b in inputs]))


def _shape(handler, execute, op, inputs):
    (x,) = inputs
    static = static_shape(x.value)
    if static is not None and None not in static:
        return [Batched(_constant(static[1:], op.attrs["out_type"]), False)]
    (out,) = execute(op, [x.value])
    return [Batched(tf.raw_ops.Slice(input=out, begin=[1], size=[-1]), False)]


# (attributes, begin, end and strides as bytes, their dtype) -> (the rewritten op, its
# begin, end and strides constants): a slice seen before (`e[None]` in the mapped
# function, every call) builds nothing.
_slices = BoundedCache("vectorized_map.strided_slices", 4096)


def _strided_slice(handler, execute, op, inputs):
    x, begin, end, strides = inputs
    if not x.batched or begin.batched or end.batched or strides.batched:
        return None
    # A leading full slice over the batch axis; every mask moves up one bit.
    values = [known_value(t.value) for t in (begin, end, strides)]
    if any(v is None for v in values):
        return None
    eager = _executing_eagerly()
    key = (op.attrs_key(),) + tuple(v.tobytes() for v in values) + (values[0].dtype.str,)
    hit = _slices.get(key) if eager else None
    if hit is None:
        args = [_prepended(first, v) for first, v in zip((0, 0, 1), values)]
        attrs = op.attrs
        new = _replace(op, begin_mask=(attrs["begin_mask"] << 1) | 1,
                       end_mask=(attrs["end_mask"] << 1) | 1,
                       ellipsis_mask=attrs["ellipsis_mask"] << 1,
                       new_axis_mask=attrs["new_axis_mask"] << 1,
                       shrink_axis_mask=attrs["shrink_axis_mask"] << 1)
        hit = (new, args)
        if eager:
            _slices[key] = hit
    new, args = hit
    return batched(execute(new, [x.value] + args))


def _sparse_xent(handler, execute, op, inputs):
    features, labels = inputs
    if _rank(features) != 2 or _rank(labels) != 1:
        return None
    f = broadcast_batch(features, handler.size)
    lab = broadcast_batch(labels, handler.size)
    shape = static_shape(f)
    if shape is None or None in shape:
        return None
    loss, grad = execute(op, [_reshaped(execute, f, (-1, shape[-1])),
                              _reshaped(execute, lab, (-1,))])
    return [Batched(_reshaped(execute, loss, (handler.size, -1)), True),
            Batched(_reshaped(execute, grad, shape), True)]


def _shape_n(handler, execute, op, inputs):
    """Per-example shapes, unbatched (as `_shape`, pfor's ShapeN converter): the graph
    gradients of convolutions take their `input_sizes` from ShapeN, and pfor's
    converters of those ops need them loop invariant."""
    out_type = op.attrs["out_type"]
    statics = [static_shape(b.value) for b in inputs]
    if all(s is not None and None not in s for s in statics):
        return [Batched(_constant(s[1:] if b.batched else s, out_type), False)
                for b, s in zip(inputs, statics)]
    outs = execute(op, [b.value for b in inputs])
    return [Batched(tf.raw_ops.Slice(input=o, begin=[1], size=[-1]) if b.batched else o,
                    False) for b, o in zip(inputs, outs)]


def _conv2d_backprop_input(handler, execute, op, inputs):
    """pfor's converter: the batch folded into the images' batch dim of `out_backprop`,
    `input_sizes`' batch dim scaled by it. A per-example filter or `input_sizes` has no
    rule (pfor's converter refuses them too)."""
    sizes, kernel, dy = inputs
    if sizes.batched or kernel.batched or _rank(dy) != 4:
        return None
    shape = static_shape(dy.value)
    folded = _reshaped(execute, dy.value, (-1,) + shape[2:]) if None not in shape[2:] \
        else tf.reshape(dy.value, tf.concat([[-1], tf.shape(dy.value)[2:]], 0))
    known = known_value(sizes.value)
    if known is not None:
        scaled = _constant([int(known[0]) * handler.size] + known[1:].tolist(), known.dtype)
    else:
        scaled = sizes.value * _constant([handler.size, 1, 1, 1], sizes.value.dtype)
    (out,) = execute(op, [scaled, kernel.value, folded])
    out_shape = static_shape(out)
    if out_shape is not None and None not in out_shape[1:]:
        return [Batched(_reshaped(execute, out, (handler.size, -1) + out_shape[1:]), True)]
    return [Batched(tf.reshape(out, tf.concat([[handler.size, -1], tf.shape(out)[1:]], 0)),
                    True)]


def _optional_get_value(handler, execute, op, inputs):
    """A batched Optional is pfor's: one scalar variant holding the batched components
    (OptionalFromValue's converter stacks its inputs), so its value is read with the
    batch prepended to the declared shapes, as pfor's converter reads it."""
    (handle,) = inputs
    if _ndim(handle.value) != 0:
        return None  # a vector of Optionals (stacked by the per-example loop): pfor
    shapes = tuple(tf.TensorShape([handler.size]).concatenate(s)
                   for s in op.attrs["output_shapes"])
    return batched(execute(_replace(op, output_shapes=shapes), [handle.value]))


def _optional_has_value(handler, execute, op, inputs):
    """One presence for the whole batch (the Optional holds every example's values), as
    tf.map_fn gives it per example: unbatched, so Python control flow on it runs in the
    map (pfor has no converter for OptionalHasValue)."""
    (handle,) = inputs
    if _ndim(handle.value) != 0:
        return None
    return [Batched(o, False) for o in execute(op, [handle.value])]


def _tensor_list_element_shape(handler, execute, op, inputs):
    """The per-example element shape of a batched list (its elements' shape without the
    batch dimension), and -1 where the list's element shape is unknown. (pfor's
    converter takes [1:] of the -1 too: a scalar element shape, with which the gradient
    of a TensorListGetItem reserves a list that cannot hold the gradient;
    tf.vectorized_map fails there with "Tried to set a tensor with incompatible
    shape".)"""
    (handle,) = inputs
    if not handle.batched or _ndim(handle.value) != 0:
        return None
    (shape,) = execute(op, [handle.value])
    if type(shape) is _EagerTensor:
        return [Batched(shape if _ndim(shape) == 0 else shape[1:], False)]
    return [Batched(tf.cond(tf.rank(shape) > 0, lambda: tf.reshape(shape, [-1])[1:],
                            lambda: shape), False)]


def _stacked_element_shape(shape, size):
    """The element shape of a batched list from the per-example one (a numpy value), as
    pfor's `_stack_tensor_list_shape`: unknown stays unknown (-1)."""
    if -1 in shape.reshape([-1]).tolist():
        return _constant(-1, shape.dtype)
    return _prepended(size, shape.reshape([-1]))


def _tensor_list_reserve(handler, execute, op, inputs):
    """A reserved list, batched (see ALWAYS_BATCHED), its element shape the batch and the
    per-example one. (pfor's converter gives a known element shape up: its
    `_stack_tensor_list_shape` returns None for one, so reserved elements had an unknown
    shape, and a list of them could not be stacked or taken apart.)"""
    element_shape, num_elements = inputs
    if element_shape.batched or num_elements.batched:
        return None
    shape = known_value(element_shape.value)
    if shape is None:
        return None
    (out,) = execute(op, [_stacked_element_shape(shape, handler.size), num_elements.value])
    return [Batched(out, True)]


def _tensor_list_get_item(handler, execute, op, inputs):
    """A per-example index into a batched list: example b's element is row b of element
    index[b]. (pfor's converter maps over the examples with a tf.map_fn whose output
    dtype is left to default to the indices' int32: AssertionError in tf.vectorized_map.)"""
    handle, index, element_shape = inputs
    if not (handle.batched and index.batched) or element_shape.batched:
        return None
    shape = known_value(element_shape.value)
    if shape is None:
        return None
    items = tf.raw_ops.TensorListStack(
        input_handle=handle.value, element_shape=_stacked_element_shape(shape, handler.size),
        element_dtype=op.attrs["element_dtype"])  # [length, batch, ...]
    where = tf.stack([index.value, tf.range(handler.size, dtype=index.value.dtype)], axis=1)
    return [Batched(tf.gather_nd(items, where), True)]


def _tensor_list_gather(handler, execute, op, inputs):
    """Elements of a batched list at shared indices, the batch first. (pfor's converter
    returns the gathered elements as they come, [indices..., batch, ...], and calls that
    batched: tf.vectorized_map of `tf.TensorArray.gather` gives the batch second.)"""
    handle, indices, element_shape = inputs
    if not handle.batched or indices.batched or element_shape.batched:
        return None
    shape = known_value(element_shape.value)
    index_rank = _rank(indices)
    if shape is None or index_rank is None:
        return None
    (out,) = execute(op, [handle.value, indices.value,
                          _stacked_element_shape(shape, handler.size)])
    rank = _ndim(out)
    if rank is None:
        rank = tf.rank(out)
        perm = tf.concat([[index_rank], tf.range(index_rank), tf.range(index_rank + 1, rank)], 0)
    else:
        perm = [index_rank] + list(range(index_rank)) + list(range(index_rank + 1, rank))
    return [Batched(tf.transpose(out, perm), True)]


def _rank_op(handler, execute, op, inputs):
    (x,) = inputs
    (out,) = execute(op, [x.value])
    return [Batched(out - 1, False)]


def _gather(handler, execute, op, inputs):
    params, indices, axis = inputs
    a = known_value(axis.value)
    if axis.batched or a is None:
        return None
    rank, index_rank = _rank(params), _rank(indices)
    if rank is None or index_rank is None:
        return None
    a = int(a) % max(rank, 1)
    batch_dims = op.attrs.get("batch_dims", 0)
    if batch_dims < 0:  # (TensorFlow counts a negative batch_dims from the indices' rank)
        batch_dims += index_rank
    new_axis = _constant(a + 1, axis.value.dtype)
    if batch_dims == 0 and params.batched and not indices.batched:
        return batched(execute(op, [params.value, indices.value, new_axis]))
    if batch_dims == 0 and not params.batched:
        out = execute(op, [params.value, indices.value, axis.value])[0]
        if a == 0:  # batched indices into unbatched params: the batch axis comes first
            return batched([out])
        # gather puts the indices' axes (the batch first) at `a`: move the batch to 0.
        out_rank = rank + index_rank  # p[:a] + [batch] + q + p[a+1:]
        perm = [a] + list(range(a)) + list(range(a + 1, out_rank))
        return batched([tf.transpose(out, perm)])
    # The batch is one more batch dimension of both (an unbatched side is broadcast).
    new = _replace(op, batch_dims=batch_dims + 1)
    return batched(execute(new, [broadcast_batch(params, handler.size),
                                 broadcast_batch(indices, handler.size), new_axis]))


def _self_adjoint_eig(handler, execute, op, inputs):
    # The kernel takes stacks of matrices ([..., N, N]): the batch is one more axis.
    # Without compute_v its `v` is an empty placeholder, the same for every example
    # (pfor's graph tiles it and fails: "Expected multiples argument ... length 1").
    e, v = execute(op, [inputs[0].value])
    return [Batched(e, True), Batched(v, bool(op.attrs.get("compute_v", True)))]


def _channels_first(op):
    return op.attrs.get("data_format", b"NHWC") in (b"NCHW", "NCHW", b"NCDHW", "NCDHW")


def _fold_images(x, size, channels_first):
    """Batched images [B, N, ..., C] (or [B, N, C, ...]) as one image batch whose channels
    are the examples' channels side by side ([N, ..., B*C]): per-channel batch-norm
    statistics then stay per example."""
    rank = len(x.shape)  # with the batch
    if channels_first:
        perm = [1, 0] + list(range(2, rank))
    else:
        perm = list(range(1, rank - 1)) + [0, rank - 1]
    t = tf.transpose(x, perm)
    shape = tf.shape(t)
    if channels_first:
        return tf.reshape(t, tf.concat([shape[:1], [size * shape[2]], shape[3:]], 0))
    return tf.reshape(t, tf.concat([shape[:-2], [size * shape[-1]]], 0))


def _unfold_images(y, size, channels_first):
    """`_fold_images` undone."""
    shape = tf.shape(y)
    rank = len(y.shape) + 1
    if channels_first:
        t = tf.reshape(y, tf.concat([shape[:1], [size, shape[1] // size], shape[2:]], 0))
        return tf.transpose(t, [1, 0] + list(range(2, rank)))
    t = tf.reshape(y, tf.concat([shape[:-1], [size, shape[-1] // size]], 0))
    return tf.transpose(t, [rank - 2] + list(range(rank - 2)) + [rank - 1])


def _fold_channels(b, size):
    """A per-channel vector ([C] shared, or [B, C] per example) as the folded images'
    [B*C] (empty vectors, a training batch norm's mean and variance, stay empty)."""
    if b.batched:
        return tf.reshape(b.value, [-1])
    if b.value.shape.rank == 1 and b.value.shape[0] == 0:
        return b.value
    return tf.tile(b.value, [size])


def _per_example_channels(t, size):
    return Batched(tf.reshape(t, [size, -1]), True)


def _fused_batch_norm(handler, execute, op, inputs):
    # The batch is folded into the channels, so the kernel computes every example's
    # statistics at once (pfor's converter fails on the scalar reserve_space_3).
    x, rest = inputs[0], inputs[1:]
    if op.attrs.get("is_training") is None or _rank(x) not in (4, 5):
        return None
    first = _channels_first(op)
    size = handler.size
    y, mean, var, r1, r2, r3 = execute(
        op, [_fold_images(broadcast_batch(x, size), size, first)]
        + [_fold_channels(b, size) for b in rest])
    return [Batched(_unfold_images(y, size, first), True)] + [
        _per_example_channels(t, size) for t in (mean, var, r1, r2)] + [Batched(r3, False)]


def _fused_batch_norm_grad(handler, execute, op, inputs):
    dy, x, scale, r1, r2, r3 = inputs
    if r3.batched or _rank(x) not in (4, 5):
        return None
    first = _channels_first(op)
    size = handler.size
    dx, dscale, doffset, r4, r5 = execute(
        op, [_fold_images(broadcast_batch(dy, size), size, first),
             _fold_images(broadcast_batch(x, size), size, first)]
        + [_fold_channels(b, size) for b in (scale, r1, r2)] + [r3.value])
    return [Batched(_unfold_images(dx, size, first), True),
            _per_example_channels(dscale, size), _per_example_channels(doffset, size),
            Batched(r4, False), Batched(r5, False)]


def _last_axis(handler, execute, op, inputs):
    (x,) = inputs
    return batched(execute(op, [x.value]))


def _bias_add(handler, execute, op, inputs):
    value, bias = inputs
    if bias.batched or op.attrs.get("data_format", b"NHWC") not in (b"NHWC", "NHWC"):
        return None  # pfor
    return batched(execute(op, [value.value, bias.value]))


def _random(handler, execute, op, inputs):
    """A stateful random op inside the map draws independently for every example."""
    shape = known_value(inputs[0].value)
    if inputs[0].batched or shape is None:
        return None
    return batched(execute(op, [_prepended(handler.size, shape)]
                            + [b.value for b in inputs[1:]]))


def _l2_loss(handler, execute, op, inputs):
    (x,) = inputs
    rank = x.value.shape.rank
    if rank is None:
        return None
    return [Batched(tf.reduce_sum(tf.square(x.value), axis=list(range(1, rank))) * 0.5, True)]


def _bias_add_grad(handler, execute, op, inputs):
    (x,) = inputs
    if op.attrs.get("data_format", b"NHWC") not in (b"NHWC", "NHWC") or x.value.shape.rank is None:
        return None
    axes = list(range(1, x.value.shape.rank - 1))
    return [Batched(tf.reduce_sum(x.value, axis=axes), True)]


def _grad_grad_by_argmax(op, values):
    """MaxPoolGradGrad(x, y, g) as g at each window's maximum (MaxPoolWithArgmax), or
    None (NCHW, explicit padding: the op). In a graph (a function replayed under the
    map) the kernel returns zeros when y's shape is x's (SAME, stride 1) and g's buffer
    is not used elsewhere, as the folding reshape's can be: it reuses g's buffer for its
    output and zeros it before reading g. Both take the first maximum of a window."""
    attrs = op.attrs
    padding = attrs.get("padding")
    padding = padding.decode() if isinstance(padding, bytes) else padding
    if (op.type != "MaxPoolGradGrad" or padding not in ("SAME", "VALID")
            or attrs.get("data_format", b"NHWC") not in (b"NHWC", "NHWC")):
        return None
    x, _, g = values
    _, argmax = tf.raw_ops.MaxPoolWithArgmax(
        input=x, ksize=list(attrs["ksize"]), strides=list(attrs["strides"]),
        padding=padding, include_batch_in_index=True)
    return [tf.gather(tf.reshape(g, [-1]), argmax)]  # (argmax: indices into all of x)


def _pool_grad(handler, execute, op, inputs):
    """MaxPool's gradient ops and MaxPoolWithArgmax (per-image indices): every input
    batched, the map's batch folded into the images' batch dim. (pfor's graph gives
    zeros for MaxPoolGradGrad with an unbatched input: see forward_accumulator_rules.)"""
    if op.attrs.get("include_batch_in_index"):
        return None
    values = [broadcast_batch(b, handler.size) for b in inputs]
    if any(v.shape.rank is None for v in values):
        return None
    lead = tf.shape(values[0])[:2]
    folded = [tf.reshape(v, tf.concat([[-1], tf.shape(v)[2:]], 0)) for v in values]
    outs = _grad_grad_by_argmax(op, folded) or execute(op, folded)
    return [Batched(tf.reshape(o, tf.concat([lead, tf.shape(o)[1:]], 0)), True)
            for o in outs]


# Elementwise ops from core's table. ClipByValue is left to pfor's converter: its bounds
# must be scalars or of the input's shape, which aligning them to the batched rank breaks.
# The project's copy ops are elementwise identities too.
RULES = {name: _elementwise for name in (
    op_kinds.UNARY | op_kinds.BROADCASTING_BINARY | {"SelectV2"}
    | {"CopyOn", "CopyOnGrad", "CopyOff", "CopyOffGrad"})}
RULES.update({name: _same_shape for name in op_kinds.SAME_SHAPE_BINARY | {"AddN"}})
# Stateful random ops whose first input is the output shape: they run even without a
# batched input, one draw per example.
RANDOM = frozenset(("RandomUniform", "RandomStandardNormal", "TruncatedNormal",
                     "RandomUniformInt"))
RULES.update({name: _random for name in RANDOM})
# Ops batched even without a batched input: the random ops, and TensorListReserve, whose
# list pfor always makes batched (its force_stateful_ops): a later write of a per-example
# item into an unbatched reserved list would have to stack its elements, and reserved
# elements of unknown shape cannot be read (InvalidArgumentError in pfor's stacking).
ALWAYS_BATCHED = RANDOM | {"TensorListReserve"}
RULES.update({name: _reduction for name in (
    "Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "ArgMax", "ArgMin")})
RULES.update({
    # BatchMatMul broadcasts its batch dims like numpy: aligning ranks is its whole rule.
    "MatMul": _matmul, "BatchMatMulV2": _elementwise, "BatchMatMulV3": _elementwise,
    "Reshape": _reshape, "Transpose": _transpose, "ExpandDims": _expand_dims,
    "Squeeze": _squeeze, "ConcatV2": _concat, "Pack": _pack, "Shape": _shape,
    "Rank": _rank_op, "GatherV2": _gather, "Softmax": _last_axis, "LogSoftmax": _last_axis,
    "BiasAddGrad": _bias_add_grad, "L2Loss": _l2_loss, "StridedSlice": _strided_slice,
    "BiasAdd": _bias_add,
    "SparseSoftmaxCrossEntropyWithLogits": _sparse_xent,
    "MaxPoolGrad": _pool_grad, "MaxPoolGradGrad": _pool_grad,
    "MaxPool3DGrad": _pool_grad, "MaxPool3DGradGrad": _pool_grad,
    "MaxPoolWithArgmax": _pool_grad, "SelfAdjointEigV2": _self_adjoint_eig,
    "FusedBatchNormV3": _fused_batch_norm, "FusedBatchNormGradV3": _fused_batch_norm_grad,
    "ShapeN": _shape_n, "Conv2DBackpropInput": _conv2d_backprop_input,
    "TensorListElementShape": _tensor_list_element_shape,
    "TensorListGather": _tensor_list_gather, "TensorListGetItem": _tensor_list_get_item,
    "TensorListReserve": _tensor_list_reserve,
    "OptionalGetValue": _optional_get_value, "OptionalHasValue": _optional_has_value,
})


# -- plans: what a signature needs, decided once (handler.py caches them) -----------

FORWARD = "forward"      # run the op on the values as they are; every output is batched
UNBATCHED = "unbatched"  # no batched input: the op as it is, its outputs unbatched
RULE = "rule"            # the op's rule (then pfor, then a loop)
_RESOURCE_ENUM = tf.resource.as_datatype_enum
# Rules that only align per-example ranks before running the op itself.
_ALIGNING = frozenset(name for name, rule in RULES.items()
                      if rule is _elementwise)
_SAME_SHAPE = frozenset(name for name, rule in RULES.items() if rule is _same_shape)


# Op types whose plan reads attributes (the others' plans are keyed without them).
ATTRIBUTE_PLANS = frozenset(("BiasAdd",))


def plan_of(op, inputs):
    """FORWARD, UNBATCHED or RULE for ops of this signature (op type, the attributes of
    ATTRIBUTE_PLANS' types, and per input whether it is batched, its dtype and rank;
    `inputs` are eager), or None for the handler's generic path (resource inputs, random
    ops, function calls, unknown ranks). Every plan gives the values its rule gives:
    FORWARD only where the rule would run the op on the values unchanged (never an op
    with a resource output: those take no batched input)."""
    if op.output_dtype_enums is None or op.type in ALWAYS_BATCHED:
        return None
    if any(b.value._datatype_enum() == _RESOURCE_ENUM for b in inputs):  # pylint: disable=protected-access
        return None
    if not any(b.batched for b in inputs):
        return UNBATCHED
    op_type = op.type
    if op_type in _ALIGNING:
        ranks = [_rank(b) for b in inputs]
        if None in ranks:
            return None
        top = max(ranks)
        if all(r == top for b, r in zip(inputs, ranks) if b.batched):
            return FORWARD  # _align changes nothing
    elif op_type in _SAME_SHAPE:
        if all(b.batched for b in inputs):
            return FORWARD  # broadcast_batch changes nothing
    elif op_type in ("Softmax", "LogSoftmax"):
        return FORWARD
    elif op_type == "BiasAdd":
        if not inputs[1].batched and op.attrs.get("data_format", b"NHWC") in (b"NHWC",
                                                                               "NHWC"):
            return FORWARD
    return RULE
