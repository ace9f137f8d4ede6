"""SPMD rules of `oh.Mesh` for neural-network ops: biases, softmax, the sparse softmax
cross-entropy (rows or classes sharded), gathers (embeddings sharded on the vocabulary),
segment sums, convolutions and pooling on the batch axis.
Same contract as `rules.py`, whose table `RULES` this module's table extends.

>>> sorted(RULES)[:3]
['AvgPool', 'AvgPoolGrad', 'BiasAdd']
"""
import numpy as np
import tensorflow as tf

from tf_ophandlers.handlers.mesh.rules import MeshValue, elementwise, outputs, static_input


def _bias_add(mesh, op, inputs):
    if op.attrs.get("data_format", "NHWC") not in ("NHWC", b"NHWC"):
        return None
    return elementwise(mesh, op, inputs)


def _bias_add_grad(mesh, op, inputs):
    """The sum over every axis but the last (NHWC)."""
    (g,) = inputs
    if op.attrs.get("data_format", "NHWC") not in ("NHWC", b"NHWC") or None in g.shape:
        return None
    (shards,) = mesh.run(op, [g])
    summed = [m for m in g.layout[:-1] if m is not None]
    if summed:
        shards = mesh.all_reduce(shards, summed, "sum")
    return [MeshValue(shards, g.layout[-1:], g.shape[-1:])]


def _softmax(mesh, op, inputs):
    (x,) = inputs
    x = mesh.relayout_value(x, x.layout[:-1] + (None,))
    return outputs(mesh.run(op, [x]), x.layout, x.shape)


def _gather_sharded_rows(mesh, op, params_layout, params_shape, indices, run_local):
    """A gather from params whose axis 0 is sharded on mesh dimension m: each device
    gathers the rows it holds (others masked to zero), then a sum over m."""
    m = params_layout[0]
    indices = mesh.relayout_value(indices, tuple(None if l == m else l for l in indices.layout))
    rows = params_shape[0] // mesh.dim_size(m)
    starts = [mesh.coord(i, m) * rows for i in range(len(mesh.devices))]
    local, masks = [], []
    for i, s in enumerate(indices.shards):
        with mesh.on_device(i):
            tf.debugging.assert_less(s, tf.cast(params_shape[0], s.dtype), message=(
                "oh.Mesh: %s index out of range [0, %d)" % (op.type, params_shape[0])))
            tf.debugging.assert_non_negative(s, message="oh.Mesh: %s negative index" % op.type)
            shifted = s - tf.cast(starts[i], s.dtype)
            inside = tf.logical_and(shifted >= 0, shifted < rows)
            local.append(tf.where(inside, shifted, tf.zeros_like(shifted)))
            masks.append(inside)
    out = run_local(MeshValue(local, indices.layout, indices.shape))
    shards = []
    for i, (o, k) in enumerate(zip(out, masks)):
        with mesh.on_device(i):
            k = tf.reshape(k, tf.concat([tf.shape(k), tf.ones([len(o.shape) - len(k.shape)],
                                                                tf.int32)], 0))
            shards.append(tf.where(k, o, tf.zeros_like(o)))
    shards = mesh.all_reduce(shards, [m], "sum")
    layout = indices.layout + tuple(params_layout[1:])
    return [MeshValue(shards, layout, indices.shape + tuple(params_shape[1:]))]


def _gather_layout(params_layout, indices):
    used = {l for l in params_layout if l}
    return tuple(None if l in used else l for l in indices.layout)


def _gather(mesh, op, inputs):
    params, indices, axis_v = inputs
    axis = static_input(mesh, axis_v, "axis", op)
    if axis is None or op.attrs.get("batch_dims", 0) != 0 or None in params.shape:
        return None
    axis = int(axis) % len(params.shape)
    if params.layout[axis] is not None and axis == 0:
        return _gather_sharded_rows(
            mesh, op, params.layout, params.shape, indices,
            lambda idx: mesh.run(op, [params, idx, axis_v])[0])
    params = mesh.relayout_value(params, tuple(None if a == axis else l
                                               for a, l in enumerate(params.layout)))
    indices = mesh.relayout_value(indices, _gather_layout(params.layout, indices))
    layout = params.layout[:axis] + indices.layout + params.layout[axis + 1:]
    shape = params.shape[:axis] + indices.shape + params.shape[axis + 1:]
    return outputs(mesh.run(op, [params, indices, axis_v]), layout, shape)


def _resource_gather(mesh, op, inputs):
    handle, indices = inputs
    var = handle.var
    if op.attrs.get("batch_dims", 0) != 0:
        return None
    if var.layout is None or var.shape is None:  # a host variable: the same on every device
        indices = mesh.relayout_value(indices, (None,) * len(indices.shape))
        (shards,) = mesh.run(op, [handle, indices])
        tail = tuple(shards[0].shape.as_list()[len(indices.shape):])
        return [MeshValue(shards, (None,) * (len(indices.shape) + len(tail)),
                          indices.shape + tail)]
    if var.layout[0] is not None:
        return _gather_sharded_rows(mesh, op, var.layout, var.shape, indices,
                                    lambda idx: mesh.run(op, [handle, idx])[0])
    indices = mesh.relayout_value(indices, _gather_layout(var.layout, indices))
    return outputs(mesh.run(op, [handle, indices]), indices.layout + tuple(var.layout[1:]),
                indices.shape + tuple(var.shape[1:]))


def _unsorted_segment_sum(mesh, op, inputs):
    """Sums rows into segments (an embedding's gradient made dense): local sums of the
    rows each device holds, then a sum over the mesh dimensions sharding the rows."""
    data, ids, num = inputs
    k = len(ids.shape)
    n = static_input(mesh, num, "num_segments", op)  # None: computed in a replay
    if not num.replicated or None in data.shape or data.shape[:k] != ids.shape:
        return None
    rows = data.layout[:k]
    used = {m for m in rows if m}
    rest = tuple(None if m in used else m for m in data.layout[k:])
    data = mesh.relayout_value(data, rows + rest)
    ids = mesh.relayout_value(ids, rows)
    (shards,) = mesh.run(op, [data, ids, num])
    if used:
        shards = mesh.all_reduce(shards, sorted(used), "sum")
    return [MeshValue(shards, (None,) + rest,
                      (None if n is None else int(n),) + data.shape[k:])]


def _nhwc(op):
    fmt = op.attrs.get("data_format", "NHWC")
    return (fmt.decode() if isinstance(fmt, bytes) else fmt) == "NHWC"


def _conv_or_pool(mesh, op, inputs):
    """Conv2D, pooling and their input gradients on the batch axis: every input with a
    batch axis keeps only its batch sharding, filters are replicated."""
    if not _nhwc(op) or any(None in v.shape for v in inputs):
        return None
    batched = [i for i, v in enumerate(inputs) if len(v.shape) == 4 and (
        op.type not in _FILTER_AT or i != _FILTER_AT[op.type])]
    m = next((inputs[i].layout[0] for i in batched if inputs[i].layout[0]), None)
    args = []
    for i, v in enumerate(inputs):
        if i in batched:
            args.append(mesh.relayout_value(v, (m,) + (None,) * 3))
        else:
            args.append(mesh.relayout_value(v, (None,) * len(v.shape)))
    shape_at = _SHAPE_AT.get(op.type)
    out_shape = None
    if shape_at is not None:  # an input giving the (global) output shape
        out_shape = static_input(mesh, args[shape_at], "shape", op)
        if out_shape is None:
            return None
        local = np.array(out_shape)
        if m is not None:
            local[0] //= mesh.dim_size(m)
        args[shape_at] = mesh.constant(local.astype(args[shape_at].dtype.as_numpy_dtype))
    outs = mesh.run(op, args)
    results = []
    for shards in outs:
        shape = list(shards[0].shape.as_list())
        if m is not None:
            shape[0] *= mesh.dim_size(m)
        results.append(MeshValue(shards, (m,) + (None,) * (len(shape) - 1), shape))
    return results


def _conv_filter_grad(mesh, op, inputs):
    """Conv2DBackpropFilter: per-device batch shards give partial sums of the filter's
    gradient, summed over the batch's mesh dimension."""
    x, sizes, dy = inputs
    if not _nhwc(op) or None in x.shape or None in dy.shape:
        return None
    m = x.layout[0] or dy.layout[0]
    x = mesh.relayout_value(x, (m, None, None, None))
    dy = mesh.relayout_value(dy, (m, None, None, None))
    (shards,) = mesh.run(op, [x, sizes, dy])
    if m is not None:
        shards = mesh.all_reduce(shards, [m], "sum")
    return [MeshValue(shards, (None,) * 4, shards[0].shape.as_list())]


_FILTER_AT = {"Conv2D": 1, "Conv2DBackpropInput": 1}
_SHAPE_AT = {"Conv2DBackpropInput": 0, "AvgPoolGrad": 0}


def _unique(mesh, op, inputs):
    """Unique (an optimizer deduplicating a sparse gradient's indices) needs every
    index: the input is all-gathered (replicated), the op runs once per distinct input
    (`Mesh.run`) and its outputs are replicated."""
    (x,) = inputs
    if len(x.shape) != 1:
        return None
    x = mesh.relayout_value(x, (None,))
    return [MeshValue(o, (None,), tuple(o[0].shape.as_list())) for o in mesh.run(op, [x])]


def _sparse_xent(mesh, op, inputs):
    """SparseSoftmaxCrossEntropyWithLogits (Keras's sparse categorical crossentropy from
    logits). Rows sharded (batch): the op runs on each device's rows, its outputs (loss
    [batch], backprop [batch, classes]) keep the rows' sharding. Classes sharded too
    (a vocabulary-parallel output layer): `_sparse_xent_class_sharded`."""
    logits, labels = inputs
    if len(logits.shape) != 2 or len(labels.shape) != 1 or None in logits.shape:
        return None
    rows, classes = logits.layout
    if rows is None and labels.layout[0] != classes:
        rows = labels.layout[0]  # labels sharded, logits not: slice the logits' rows
    logits = mesh.relayout_value(logits, (rows, classes))
    labels = mesh.relayout_value(labels, (rows,))
    if classes is None:
        loss, backprop = mesh.run(op, [logits, labels])
        return [MeshValue(loss, (rows,), logits.shape[:1]),
                MeshValue(backprop, (rows, None), logits.shape)]
    return _sparse_xent_class_sharded(mesh, op, logits, labels)


def _sparse_xent_class_sharded(mesh, op, logits, labels):
    """Each device holds a block of classes: the row maxima and the sums of exponentials
    are combined over the classes' mesh dimension (a max, then a sum: the log-sum-exp of
    the whole row), the label's logit is picked by the device holding that class (zero
    elsewhere, then summed). The same arithmetic as TensorFlow's kernel: loss =
    log(sum(exp(x - max))) - (x[label] - max), backprop = softmax - one_hot."""
    rows, c = logits.layout
    n = logits.shape[1]
    k = n // mesh.dim_size(c)
    dtype = logits.dtype

    def on_each(fn, *columns):
        out = []
        for i, args in enumerate(zip(*columns)):
            with mesh.on_device(i):
                out.append(fn(i, *args))
        return out

    def local_max(i, x, y):
        tf.debugging.assert_less(y, tf.cast(n, y.dtype), message=(
            "oh.Mesh: %s label out of range [0, %d)" % (op.type, n)))
        tf.debugging.assert_non_negative(y, message="oh.Mesh: %s negative label" % op.type)
        return tf.reduce_max(x, axis=1)

    maxima = mesh.all_reduce(on_each(local_max, logits.shards, labels.shards), [c], "max")
    shifted = on_each(lambda i, x, m: x - m[:, None], logits.shards, maxima)
    exps = on_each(lambda i, z: tf.exp(z), shifted)
    sums = mesh.all_reduce(on_each(lambda i, e: tf.reduce_sum(e, axis=1), exps), [c], "sum")

    def local_label(i, y):
        return y - tf.cast(mesh.coord(i, c) * k, y.dtype)

    local = on_each(local_label, labels.shards)

    def picked(i, z, y):
        inside = tf.logical_and(y >= 0, y < k)
        got = tf.gather(z, tf.where(inside, y, tf.zeros_like(y)), axis=1, batch_dims=1)
        return tf.where(inside, got, tf.zeros_like(got))

    label_logits = mesh.all_reduce(on_each(picked, shifted, local), [c], "sum")
    loss = on_each(lambda i, s, z: tf.math.log(s) - z, sums, label_logits)
    # one_hot gives a row of zeros for a label another device holds (index outside [0, k)).
    backprop = on_each(lambda i, e, s, y: e / s[:, None] - tf.one_hot(y, k, dtype=dtype),
                       exps, sums, local)
    return [MeshValue(loss, (rows,), logits.shape[:1]),
            MeshValue(backprop, (rows, c), logits.shape)]


RULES = {"BiasAdd": _bias_add, "BiasAddGrad": _bias_add_grad, "Softmax": _softmax,
         "LogSoftmax": _softmax, "GatherV2": _gather, "ResourceGather": _resource_gather,
         "UnsortedSegmentSum": _unsorted_segment_sum, "Unique": _unique, "Conv2DBackpropFilter": _conv_filter_grad,
         "SparseSoftmaxCrossEntropyWithLogits": _sparse_xent}
RULES.update({t: _conv_or_pool for t in ("Conv2D", "Conv2DBackpropInput", "MaxPool",
                                         "MaxPoolGrad", "AvgPool", "AvgPoolGrad")})
