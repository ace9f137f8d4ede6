"""Per-shard checkpoints of `oh.Mesh` variables (tf_ophandlers/handlers/mesh/handler.py).

`mesh.save_shards(prefix, {name: variable})` writes each device's own blocks: one
checkpoint file per device (`prefix-<i>-of-<n>`, TensorFlow's SaveV2 format, run on that
device), each distinct block of a variable once (devices holding the same block, a
layout replicated along a mesh dimension, leave it to the first of them), plus the
layouts, shapes and mesh dimensions in device 0's file. Nothing is gathered to one
device. `mesh.restore_shards(prefix, {name: variable})` restores: onto the same mesh
dimensions and layout, each device reads its own block back (`mesh.pack`); onto another
mesh or layout, the blocks are unsharded into the full value, which the assignment
relayouts to the variable's layout.

>>> import tempfile, os
>>> mesh = oh.Mesh({"batch": 2, "model": 2}, ["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
>>> with mesh:
...     w = tf.Variable(mesh.shard(tf.reshape(tf.range(8.), [2, 4]), (None, "model")))
>>> prefix = os.path.join(tempfile.mkdtemp(), "ckpt")
>>> mesh.save_shards(prefix, {"w": w})
>>> with mesh:
...     _ = w.assign(tf.zeros([2, 4]))
>>> mesh.restore_shards(prefix, {"w": w})
>>> mesh.unshard(w).numpy()[1].tolist()
[4.0, 5.0, 6.0, 7.0]
"""
import json

import numpy as np
import tensorflow as tf

_META = "_oh_mesh_meta"


def _file(prefix, i, n):
    return "%s-%d-of-%d" % (prefix, i, n)


def _owners(dims, layout):
    """The devices (indices, row-major over `dims`: [(name, size)]) holding the distinct
    blocks of `layout`: coordinate 0 along every mesh dimension not in the layout."""
    sizes = [k for _, k in dims]
    unused = [d for d, (m, _) in enumerate(dims) if m not in layout]
    return [i for i in range(int(np.prod(sizes)))
            if all(np.unravel_index(i, sizes)[d] == 0 for d in unused)]


def _block_index(dims, layout, i):
    """Device `i`'s block: its coordinate along the mesh dimension of each tensor axis."""
    names = [m for m, _ in dims]
    coords = np.unravel_index(i, [k for _, k in dims])
    return tuple(None if m is None else int(coords[names.index(m)]) for m in layout)


def _dtype_and_shape(v):
    """A variable's DType and shape list: a Keras 3 variable gives its dtype as a string
    and its shape as a tuple."""
    return tf.as_dtype(v.dtype), tf.TensorShape(v.shape).as_list()


def _checked(mesh, variables, what):
    if not isinstance(variables, dict) or not variables:
        raise TypeError("oh.Mesh.%s: variables must be a non-empty dict {name: variable}, "
                        "got %r" % (what, variables))
    for name, v in variables.items():
        if mesh.layout_of(v) is None or not hasattr(v, "assign"):
            raise TypeError("oh.Mesh.%s: %r (%s) is not a variable of %s"
                            % (what, name, getattr(v, "name", type(v).__name__),
                               mesh.debug_string()))


def save_shards(mesh, prefix, variables):
    """Writes the variables' blocks, each device its own file (see the module)."""
    _checked(mesh, variables, "save_shards")
    dims = list(mesh.dims.items())
    n = len(mesh.devices)
    per_device = [([], []) for _ in range(n)]
    meta = {"dims": dims, "vars": {}}
    for name, v in sorted(variables.items()):
        layout = tuple(mesh.layout_of(v))
        with mesh:
            shards = mesh.unpack(tf.identity(v))
        for i in _owners(dims, layout):
            per_device[i][0].append("%s/shard_%d" % (name, i))
            per_device[i][1].append(shards[i])
        dtype, shape = _dtype_and_shape(v)
        meta["vars"][name] = {"layout": list(layout), "shape": shape, "dtype": dtype.name}
    per_device[0][0].append(_META)
    with tf.device(mesh.devices[0]):
        per_device[0][1].append(tf.constant(json.dumps(meta)))
    for i, (names, tensors) in enumerate(per_device):
        if not names:
            continue
        with tf.device(mesh.devices[i]):
            tf.raw_ops.SaveV2(prefix=_file(prefix, i, n), tensor_names=names,
                              shape_and_slices=[""] * len(names), tensors=tensors)


def _read(prefix, i, n, name, dtype, device):
    with tf.device(device):
        (t,) = tf.raw_ops.RestoreV2(prefix=_file(prefix, i, n), tensor_names=[name],
                                    shape_and_slices=[""], dtypes=[dtype])
    return t


def restore_shards(mesh, prefix, variables):
    """Restores the variables from `save_shards` files (see the module): every variable
    is checked and read first, then all are assigned, so a mismatch leaves them all as
    they were."""
    _checked(mesh, variables, "restore_shards")
    # The saving mesh's device count: device 0's file name says it.
    found = tf.io.gfile.glob(prefix + "-0-of-*.index")
    counts = [int(f[len(prefix) + len("-0-of-"):-len(".index")]) for f in found
              if f[len(prefix) + len("-0-of-"):-len(".index")].isdigit()]
    if len(counts) != 1:
        raise FileNotFoundError("oh.Mesh.restore_shards: %s checkpoint written by "
                                "save_shards at %r" % ("no" if not counts else "more than one",
                                                       prefix))
    n = counts[0]
    meta = json.loads(_read(prefix, 0, n, _META, tf.string, "CPU:0").numpy().decode())
    dims = [(m, int(k)) for m, k in meta["dims"]]
    for name, v in variables.items():
        info = meta["vars"].get(name)
        if info is None:
            raise KeyError("oh.Mesh.restore_shards: %r is not in the checkpoint %r (it has "
                           "%s)" % (name, prefix, sorted(meta["vars"])))
        dtype, shape = _dtype_and_shape(v)
        if info["shape"] != shape or info["dtype"] != dtype.name:
            raise ValueError("oh.Mesh.restore_shards: %r was saved as %s %s; the variable "
                             "is %s %s; no variable was restored"
                             % (name, info["dtype"], info["shape"], dtype.name, shape))
    values = {name: _restored_value(mesh, prefix, n, dims, meta["vars"][name], name, v)
              for name, v in variables.items()}
    with mesh:
        for name, v in variables.items():
            v.assign(values[name])


def _restored_value(mesh, prefix, n, dims, info, name, v):
    """The value to assign to `v` from its saved blocks."""
    dtype, _ = _dtype_and_shape(v)
    layout = tuple(info["layout"])
    blocks = {}  # block index -> the owner that saved it
    for i in _owners(dims, layout):
        blocks[_block_index(dims, layout, i)] = i
    if dims == list(mesh.dims.items()) and layout == tuple(mesh.layout_of(v)):
        # The same mesh and layout: every device reads its own block back.
        shards = [_read(prefix, blocks[_block_index(dims, layout, j)], n,
                        "%s/shard_%d" % (name, blocks[_block_index(dims, layout, j)]),
                        dtype, device) for j, device in enumerate(mesh.devices)]
        return mesh.pack(shards, layout)
    # Another mesh or layout: unshard, then the assignment reshards.
    full = np.zeros(info["shape"], dtype.as_numpy_dtype)
    sizes = dict(dims)
    for index, i in blocks.items():
        block = _read(prefix, i, n, "%s/shard_%d" % (name, i), dtype, "CPU:0").numpy()
        at = tuple(slice(None) if c is None else slice(
            c * (s // sizes[m]), (c + 1) * (s // sizes[m]))
            for c, s, m in zip(index, info["shape"], layout))
        full[at] = block
    return full
