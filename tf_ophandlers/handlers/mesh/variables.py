"""Variable ops of `oh.Mesh` (tf_ophandlers/handlers/mesh/handler.py): creation, reads, writes
relayouted to the variable's layout, `ResourceGather`, dense `ResourceApply*` and sparse
`ResourceSparseApply*` kernels, sparse `ResourceScatter*` updates, and the layout
adoption that gives an optimizer's slot variables their variables' layouts (eagerly, or
before the next call of a replayed step). Other ops on a mesh variable raise (never
gathered: one device would see only its shard).

>>> "AssignVariableOp" in VAR_WRITES
True
"""
import numpy as np
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from tf_ophandlers.extend import errors, Op
from tf_ophandlers.handlers.mesh import rules_nn as mesh_rules_nn
from tf_ophandlers.handlers.mesh.rules import MeshValue, VarInfo

VAR_WRITES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")
# Sparse updates (an IndexedSlices gradient applied with scatter_sub, ...).
SCATTERS = tuple("ResourceScatter" + k for k in ("Add", "Sub", "Mul", "Div", "Min", "Max",
                                                  "Update"))



def variable_op(mesh, op, inputs, var_request):
    """The outputs of variable op `op` on `mesh` (`var_request`: a pending
    `shard_variable`, (handle value, layout) or None)."""
    t = op.type
    if t == "VarHandleOp":
        (handles,) = mesh.run(op, [])
        return [MeshValue(handles, (), (), VarInfo())]
    handle = inputs[0]
    var = handle.var
    unsupported = NotImplementedError(
        "oh.Mesh: op %s on a variable has no SPMD rule in %s (for these inputs)"
        % (t, mesh.debug_string()))
    if var is None:
        raise unsupported
    sparse = t.startswith("ResourceSparseApply")
    if (t in VAR_WRITES or t.startswith("ResourceApply") or sparse) and any(
            v.var is not None and v.var.broadcast for v in inputs):
        raise errors.PlacementError(
            "oh.Mesh: op %s would write a variable created outside %s once per device; "
            "create the variable inside the mesh's scope" % (t, mesh.debug_string()))
    if sparse:
        if sparse_apply(mesh, op, inputs):
            return []
        raise unsupported
    dense = t.startswith("ResourceApply")
    if not dense and any(v.var is not None for v in inputs[1:]):
        raise unsupported  # never gathered: one device would see only its shard
    if t in VAR_WRITES or dense:
        adopt_layout(mesh, op, handle, [v for v in inputs[1:] if v.var is None])
    if dense and var.layout is not None:
        same_layouts(mesh, op, [v for v in inputs if v.var is not None])
    if t in VAR_WRITES:
        value = inputs[1]
        request = var_request
        if request is not None and request[0] is handle and t == "AssignVariableOp":
            var.layout = None
            value = mesh.relayout_value(value, request[1])
            var.chosen = True
        if t == "AssignVariableOp" and (var.layout is None or var.shape != value.shape):
            var.layout, var.shape = value.layout, value.shape
            var.chosen = var.chosen or not value.replicated
            op = op.replace(validate_shape=False)
        if var.layout is None:
            # A variable whose handle was made in the scope but whose initial value this
            # handler never saw (assigned off the mesh's stack): no layout to write with.
            # (A Keras optimizer's variables created while its step is traced get theirs
            # from the assignment in the step's cond: the replay shares their records.)
            raise errors.PlacementError(
                "oh.Mesh: op %s writes a variable whose initial value was never assigned "
                "under %s, so its layout is unknown; create the variable, with its "
                "initial value, inside the mesh's scope (a Keras optimizer: create it in "
                "the scope; one created outside keeps its variables there: make a new "
                "one)" % (t, mesh.debug_string()))
        value = mesh.relayout_value(value, var.layout)
        mesh.run(op, [handle, value])
        return []
    if t == "ReadVariableOp":
        (reads,) = mesh.run(op, [handle])
        if var.layout is None:  # a host variable, or read before its first assignment
            return [MeshValue(reads, (None,) * reads[0].shape.rank, reads[0].shape)]
        return [MeshValue(reads, var.layout, var.shape)]
    if t == "VariableShape" and var.shape is not None:
        dtype = op.attrs.get("out_type", tf.int32).as_numpy_dtype
        return [mesh.constant(np.asarray(var.shape, dtype))]
    if t in ("VarIsInitializedOp", "DestroyResourceOp", "DisableCopyOnRead"):
        outs = mesh.run(op, [handle])
        return [MeshValue(o, (), ()) for o in outs]
    if t == "ResourceGather":
        out = mesh_rules_nn.RULES[t](mesh, op, inputs)
        if out is not None:
            return out
    if t in SCATTERS and var.layout is not None and var.shape is not None:
        if scatter(mesh, op, handle, inputs[1], inputs[2]):
            return []
    if dense and var.layout is not None and not any(
            v.shape and v.shape != var.shape for v in inputs[1:]):
        mesh.run(op, [handle] + [v if not v.shape else mesh.relayout_value(v, var.layout)
                                 for v in inputs[1:]])
        return []
    raise unsupported


def adopt_layout(mesh, op, handle, values):
    """A variable whose replicated layout was never chosen (an optimizer's slot
    variable, created from zeros) takes the layout of the first sharded value of its
    shape written to it (`adopt_var_layout`)."""
    var = handle.var
    if var.chosen or var.layout is None or any(var.layout):
        return
    source = next((v for v in values if v.shape == var.shape and not v.replicated), None)
    if source is None:
        return
    adopt_var_layout(mesh, op, handle, source.layout)


def adopt_var_layout(mesh, op, handle, layout):
    """The replicated, never chosen variable of `handle` resliced in place to `layout`,
    eagerly; nothing otherwise. While a function is replayed (traced) the reslice is
    only noted (`VarInfo.adopt`) and done eagerly before the next call
    (`apply_adoption`, from `Mesh.function_input`): a replay's trace may be a probe
    whose ops never run (control_flow.py) or fail, and the stored value must not
    change layout on a trace's word. That call is then replayed again with the new
    layout (the layout is part of the replay's key)."""
    var = handle.var
    if var.chosen or var.layout is None or any(var.layout):
        return
    dtype = op.attrs.get("dtype", op.attrs.get("T"))
    if not tf.executing_eagerly():
        if var.adopt is None:
            var.adopt = (tuple(layout), dtype)
        return
    (reads,) = mesh.run(Op.cached("ReadVariableOp", dtype=dtype), [handle])
    value = mesh.relayout_value(MeshValue(reads, var.layout, var.shape), layout)
    mesh.run(Op.cached("AssignVariableOp", dtype=dtype, validate_shape=False),
             [handle, value])
    var.layout, var.chosen, var.adopt = tuple(layout), True, None


def apply_adoption(mesh, handle):
    """The layout noted by `adopt_var_layout` in a replay, applied to the variable of
    `handle` (eagerly)."""
    var = handle.var
    layout, dtype = var.adopt
    if var.chosen or var.layout is None or any(var.layout):
        var.adopt = None
        return
    (initialized,) = mesh.run(Op.cached("VarIsInitializedOp"), [handle])
    if not all(bool(s) for s in initialized):  # (the replay's call never ran its writes)
        return
    adopt_var_layout(mesh, Op.cached("ReadVariableOp", dtype=dtype), handle, layout)


def scatter(mesh, op, handle, indices, updates):
    """A `ResourceScatter*` on a mesh variable: indices replicated, updates relayouted to
    the variable's layout past the rows; with rows sharded (an embedding on the
    vocabulary) each device applies only the rows it holds (indices shifted, the others
    dropped). False when the shapes are not a scatter's."""
    var = handle.var
    k = len(indices.shape)
    if (None in indices.shape or None in updates.shape
            or tuple(updates.shape) != tuple(indices.shape) + tuple(var.shape[1:])):
        return False
    indices = mesh.relayout_value(indices, (None,) * k)
    updates = mesh.relayout_value(updates, (None,) * k + tuple(var.layout[1:]))
    m = var.layout[0]
    if m is None:
        mesh.run(op, [handle, indices, updates])
        return True
    for i in range(len(mesh.devices)):
        local, upd = _own_rows(mesh, op, var, i, indices.shards[i], updates.shards[i], k)
        mesh.run_on(op, [handle.shards[i], local, upd], i)
    return True


def _own_rows(mesh, op, var, i, indices, updates, k):
    """The rows of `updates` (indices of rank `k`, flattened) that device `i` holds of
    `var` (rows sharded on one mesh dimension), with their indices shifted to the
    device's first row; out-of-range indices raise."""
    m = var.layout[0]
    rows = var.shape[0] // mesh.dim_size(m)
    with mesh.on_device(i):
        idx = tf.reshape(indices, [-1])
        tf.debugging.assert_less(idx, tf.cast(var.shape[0], idx.dtype), message=(
            "oh.Mesh: %s index out of range [0, %d)" % (op.type, var.shape[0])))
        tf.debugging.assert_non_negative(idx, message="oh.Mesh: %s negative index"
                                         % op.type)
        local = idx - tf.cast(mesh.coord(i, m) * rows, idx.dtype)
        keep = tf.logical_and(local >= 0, local < rows)
        upd = tf.reshape(updates, tf.concat([[-1], tf.shape(updates)[k:]], 0))
        return tf.boolean_mask(local, keep), tf.boolean_mask(upd, keep)


def same_layouts(mesh, op, handles):
    """An optimizer kernel's variables (the first, then its slots) with one layout: a
    slot created replicated adopts the first's (eagerly); else a clear error."""
    var = handles[0].var
    for h in handles[1:]:
        if h.var.layout != var.layout and h.var.shape == var.shape:
            adopt_var_layout(mesh, op, h, var.layout)
        if h.var.layout != var.layout or h.var.shape != var.shape:
            raise NotImplementedError(
                "oh.Mesh: op %s updates variables of different layouts or shapes (%s %s "
                "and %s %s) in %s; run the first optimizer step eagerly in the mesh's "
                "scope (its slot variables then take their variable's layout)"
                % (op.type, var.layout, var.shape, h.var.layout, h.var.shape,
                   mesh.debug_string()))


def sparse_apply(mesh, op, inputs):
    """A `ResourceSparseApply*` optimizer kernel (Adagrad, Momentum, FTRL, ...) on a mesh
    variable and its slot variables: every variable takes the first one's layout (a slot
    created replicated adopts it, eagerly), the indices are replicated, the gradient's
    rows relayouted to the variable's layout past the rows; with rows sharded each device
    applies only the rows it holds (indices shifted, the others dropped), in the order
    given, as TensorFlow's kernel does. False when the inputs are not a sparse apply's."""
    op_def = op_def_registry.get(op.type)
    names = [a.name for a in op_def.input_arg] if op_def is not None else []
    if "grad" not in names or "indices" not in names or len(names) != len(inputs):
        return False
    var = inputs[0].var
    grad, indices = inputs[names.index("grad")], inputs[names.index("indices")]
    if (var.layout is None or var.shape is None or len(indices.shape) != 1
            or tuple(grad.shape[1:]) != tuple(var.shape[1:]) or None in var.shape
            or None not in (grad.shape[0], indices.shape[0])
            and grad.shape[0] != indices.shape[0]):
        return False  # (the row count is unknown in a replay: deduplicated indices)
    same_layouts(mesh, op, [v for v in inputs if v.var is not None])
    indices = mesh.relayout_value(indices, (None,))
    grad = mesh.relayout_value(grad, (None,) + tuple(var.layout[1:]))
    at_grad, at_indices = names.index("grad"), names.index("indices")
    for i in range(len(mesh.devices)):
        args = [v.shards[i] for v in inputs]
        if var.layout[0] is not None:
            args[at_indices], args[at_grad] = _own_rows(
                mesh, op, var, i, indices.shards[i], grad.shards[i], 1)
        else:
            args[at_indices], args[at_grad] = indices.shards[i], grad.shards[i]
        mesh.run_on(op, args, i)
    return True
