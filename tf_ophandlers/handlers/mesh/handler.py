"""`oh.Mesh`: Mesh-TensorFlow/DTensor-style sharding as an op handler.

A tensor of the mesh is a `MeshValue`: one local shard per mesh device and a layout,
one mesh dimension name (or None, replicated) per tensor axis. Every op runs on each
device's shards under an SPMD rule (`rules.py`: elementwise with broadcasting,
contractions with partial sums reduced, reductions, reshapes, softmax, gathers, shape
queries, variables); ops without a rule are gathered to full tensors, run once and
replicated, and reported once per op type (`mesh.fallbacks`). Copying a mesh tensor off
(`.numpy()`, `print`) gives the full tensor.

>>> import tensorflow as tf, tf_ophandlers as oh
>>> mesh = oh.Mesh({"batch": 2, "model": 2}, ["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
>>> with mesh:
...     x = mesh.shard(tf.ones([4, 6]), ("batch", None))
...     w = mesh.shard(tf.ones([6, 8]), (None, "model"))
...     y = tf.matmul(x, w)                 # no communication: rows x columns
>>> mesh.layout_of(y), [s.shape.as_list() for s in mesh.unpack(y)][0]
(('batch', 'model'), [2, 4])
>>> float(tf.reduce_sum(y))               # a sum over sharded axes: all-reduced
192.0

Ops are launched per device and communicate with explicit cross-device ops among the
devices of one mesh dimension (an AddN on the group's first device, read in place by the
group's other logical CPUs; concatenations for all-gathers): `comm.py`.
"""
import collections
import logging
import re
import threading
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context, execute
from tensorflow.python.framework import op_def_registry

from tf_ophandlers.extend import (
    copies, current_stack, errors, LAUNCHES, next_stack, OffStack, Op, OpHandler,
    per_device as _per_device, representation_of, scope, SOURCE_GRADIENT_NODE, stack_of,
    state)
from tf_ophandlers.handlers.mesh import (
    checkpoint as mesh_checkpoint, comm as mesh_comm, rules as mesh_rules,
    rules_nn as mesh_rules_nn, variables as mesh_variables)
from tf_ophandlers.handlers.mesh.comm import MeshCommunication, stateless as _stateless
from tf_ophandlers.handlers.mesh.compiled import PerOpCalls
from tf_ophandlers.handlers.mesh.rules import MeshValue, VarInfo

_log = logging.getLogger("tf_ophandlers")
RULES = {**mesh_rules.RULES, **mesh_rules_nn.RULES}
_SMALL = mesh_comm.SMALL
_UNEVEN_OK = ("shard", "relayout", "traced")  # requests whose non-dividing axes stay replicated
_MARKER = re.compile(r"ohmesh([0-9a-f]+)_([0-9n]+)(?:_\d+)?$")  # a traced shard's Identity
_ITERATOR_OPS = ("IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional",
                 "MultiDeviceIteratorGetNextFromShard")
# Op types `execute` looks at before the rules.
_SPECIAL_OPS = frozenset(("ParallelPack", "ParallelUnpack", "Identity", "VarHandleOp")
                         + _ITERATOR_OPS)


class _VarSummary(tuple):
    """A variable handle's part of a function summary: (layout, shape, broadcast) as
    the cache key, plus the handle's own `VarInfo`, which the replay's handle shares
    (not a copy). A layout chosen inside the replay (Keras assigns the first value of
    a variable created while its step is traced inside a cond branch: an optimizer's
    slots and iteration counter) must reach the ops after that branch and the next
    calls: with a copy, they saw no layout. The record is held weakly (cached
    summaries must not keep variables' records alive)."""

    def __new__(cls, var):
        self = super().__new__(cls, (var.layout, tuple(var.shape or ()), var.broadcast))
        self._ref = weakref.ref(var)
        return self

    def record(self):
        var = self._ref()
        if var is None:  # (the variable is gone: a record of the summary's state)
            var = VarInfo(self[0], self[1], self[2])
        return var


class Mesh(MeshCommunication, OpHandler):
    """Shards tensors over a mesh of devices (`dims`: {name: size}, row-major over
    `devices`) and runs ops SPMD on the local shards.

    >>> mesh = oh.Mesh({"model": 2}, ["CPU:0", "CPU:1"])
    >>> with mesh:
    ...     w = tf.Variable(mesh.shard(tf.ones([4, 6]), (None, "model")))  # 4x3 per device
    ...     y = tf.matmul(tf.ones([2, 4]), w)
    >>> mesh.layout_of(y), float(y[0, 0])
    ((None, 'model'), 4.0)
    """

    transient = False  # variables created under it hold one shard per device
    returns_off_stack = ("ParallelUnpack",)  # unpack's shards are ordinary tensors
    # A replayed step runs ~25% faster (CPU and wall; benchmarks/mesh.py's MLP step,
    # interleaved A/B) instantiated without grappler: its rewrites of the per-device
    # graph (141 nodes instead of 190) cost more at run time than they save.
    optimize_replays = False
    TYPE_NAME = "MESH"

    def __init__(self, dims, devices, compile_ops=False, batch_dim=None):
        """`compile_ops`: run an op's per-device shards as one compiled multi-device
        function call (cached per op signature; `compiled.py`) instead of one eager
        op per device; off by default: slower on the loaded 2-core machine it was
        measured on (`benchmarks/mesh.py`).

        `batch_dim`: the mesh dimension that dataset elements a replayed function reads
        (a compiled `model.fit`'s batches) are sharded on along their first axis
        (`iterator_element`); None: replicated."""
        dims = list(dims.items()) if isinstance(dims, dict) else list(dims)
        names = [n for n, _ in dims]
        sizes = [s for _, s in dims]
        if not dims or len(set(names)) != len(names) or not all(
                isinstance(n, str) for n in names):
            raise ValueError("oh.Mesh: dims must map distinct names to sizes, got %r" % (dims,))
        if not all(isinstance(s, (int, np.integer)) and s >= 1 for s in sizes):
            raise ValueError("oh.Mesh: dimension sizes must be positive ints, got %r" % (dims,))
        devices = list(devices)
        if int(np.prod(sizes)) != len(devices):
            raise ValueError("oh.Mesh: a %s mesh needs %d devices, got %d" % (
                "x".join(map(str, sizes)), int(np.prod(sizes)), len(devices)))
        self.devices = _per_device.canonical_devices(devices, "oh.Mesh")
        self.dims = dict(zip(names, [int(s) for s in sizes]))
        if batch_dim is not None and batch_dim not in self.dims:
            raise ValueError("oh.Mesh: batch_dim %r is not a dimension of the mesh %r"
                             % (batch_dim, dims))
        self.batch_dim = batch_dim
        self.dims_key = tuple(self.dims.items())  # for plan caches keyed by dimension sizes
        self._index = {n: i for i, n in enumerate(names)}
        #: CPUs of one process: a shard of another device is read in place, not copied.
        self.shares_host_memory = mesh_comm.host_memory_devices(self.devices)
        self._coords = [tuple(int(c) for c in np.unravel_index(i, sizes))
                        for i in range(len(devices))]
        # For each mesh dimension, each device's group: the devices differing only there.
        self._groups = {}
        for n, k in self.dims.items():
            d = self._index[n]
            self._groups[n] = [
                [j for c in range(k) for j in range(len(devices))
                 if self._coords[j][d] == c and all(
                     self._coords[j][e] == self._coords[i][e] for e in range(len(sizes))
                     if e != d)]
                for i in range(len(devices))]
        self.fallbacks = collections.Counter()
        self._per_op = PerOpCalls(self.devices, enabled=compile_ops)
        self.uneven = collections.Counter()  # shard/relayout requests kept replicated
        self._local = threading.local()
        _per_device.ensure_optimizer_check()

    def debug_string(self):
        return "Mesh(%s)" % ", ".join("%s=%d" % kv for kv in self.dims.items())

    def misplaced_write(self, optimizer, variable):
        # (A Mesh replay creates the variables of an unbuilt optimizer.)
        return _per_device.misplaced_write_message(
            self, optimizer, variable, "device", "mesh", "`")

    def holds_variable(self, variable):
        """Whether `variable` is one of this mesh's (its shards on the mesh's devices); a
        host variable is only replicated for reading (parallel.check_optimizer_step)."""
        value = self._value_of(getattr(variable, "handle", None))
        return value is not None and value.var is not None and not value.var.broadcast

    # -- the public API --------------------------------------------------------------------

    def shard(self, tensor, layout):
        """`tensor` (any tensor) as a mesh tensor with `layout` (one mesh dimension name
        or None per axis); each device keeps only its shard."""
        return self.relayout(tensor, layout, "shard")

    def relayout(self, tensor, layout, what="relayout"):
        """`tensor` with a new layout (same values; all-gathers and slices as needed).
        Differentiable: a tape records it as an Identity."""
        tensor = tf.convert_to_tensor(tensor)
        if tf.inside_function() and stack_of(tensor) is None:
            # Traced (a tf.function called later in the mesh's scope): an Identity whose
            # node name carries the layout; its replay relayouts (`_traced_relayout`).
            layout = self._checked_layout(layout, tensor.shape, "traced")
            code = "".join("n" if m is None else str(self._index[m]) for m in layout)
            with self._scope_for(tensor):
                return tf.identity(tensor, name="ohmesh%x_%s" % (id(self), code))
        layout = self._checked_layout(layout, tensor.shape, what)
        with self._scope_for(tensor):
            self._local.request = (layout, tuple(tensor.shape.as_list()))
            try:
                return tf.identity(tensor)
            finally:
                self._local.request = None

    def layout_of(self, tensor):
        """The layout of a mesh tensor or variable (a tuple); None for other tensors."""
        value = self._value_of(getattr(tensor, "handle", tensor))
        if value is None:
            return None
        if value.var is not None:
            return value.var.layout
        return value.layout

    def unpack(self, tensor):
        """The local shards of a mesh tensor, one ordinary tensor per device."""
        with self._scope_for(tensor):
            return copies.parallel_unpack(tensor, len(self.devices))

    def unshard(self, tensor):
        """The full (unsharded) tensor, on the mesh's first device."""
        with self._scope_for(tensor):
            return copies.copy_off(tensor, self.devices[0])

    def shard_variable(self, variable, layout):
        """Changes a variable's layout in place (each device then holds only its shard);
        later assignments keep it. For Keras weights created in the mesh's scope."""
        handle = getattr(variable, "handle", None)
        value = self._value_of(handle) if handle is not None else None
        if value is None or value.var is None:
            raise TypeError("oh.Mesh.shard_variable: %r is not a variable of %s"
                            % (variable, self.debug_string()))
        layout = self._checked_layout(layout, variable.shape, "shard_variable")
        with self._scope_for(handle):
            self._local.var_request = (value, layout)
            try:
                variable.assign(tf.identity(variable))
            finally:
                self._local.var_request = None
        return variable

    def source_gradient(self, source, gradient):
        """A tape's gradient of a sharded tensor or variable gets the source's layout
        (`OpHandler.source_gradient`): the backward computation may leave it replicated
        (a sum's gradient is a broadcast of the seed), a full copy on every device."""
        value = self._value_of(source)
        if value is None:
            return gradient
        layout = self._source_layout(value, gradient.shape.as_list())
        if layout is None or self.layout_of(gradient) in (None, layout):
            return gradient  # replicated sources, or not a gradient of this mesh
        return self.relayout(gradient, layout)

    @staticmethod
    def _source_layout(value, gradient_shape):
        """The layout a gradient of shape `gradient_shape` of source `value` (a MeshValue)
        takes, or None (a replicated source, or a gradient of another shape)."""
        var = value.var
        layout, shape = (var.layout, var.shape) if var is not None else (value.layout,
                                                                        value.shape)
        if (layout is None or not any(layout) or shape is None
                or tuple(gradient_shape) != tuple(shape)):
            return None
        return layout

    def _traced_source_gradient(self, inputs):
        """A replayed function's gradient of a source of a tape inside it, marked when it
        was traced in a scope of a handler with `source_gradient` (`tf.GradientTape`'s
        "source gradients" patch: IdentityN(gradient, source)): relayouted to the
        source's layout, as the eager hook does."""
        gradient, source = inputs
        if gradient.var is None:
            layout = self._source_layout(source, gradient.shape)
            if layout is not None and gradient.layout != layout:
                gradient = self.relayout_value(gradient, layout)
        return [gradient, source]

    def iterator_element(self, value):
        """A dataset element's component read by a replayed function (a compiled
        `model.fit`'s batch), fetched just before the call (`OpHandler.iterator_element`):
        its first axis sharded along `batch_dim` (kept replicated where it does not
        divide: a partial last batch), replicated without one. Fetching it outside the
        replay gives the SPMD rules its shape, which the traced read leaves unknown in
        the batch dimension; rules taking an unknown dimension would have to defer every
        layout and collective that depends on it to run time."""
        if self.batch_dim is None or not value.shape or value.var is not None:
            return value
        layout = (self.batch_dim,) + (None,) * (len(value.shape) - 1)
        return self.relayout_value(value, self._checked_layout(layout, value.shape, "shard"))

    def save_shards(self, prefix, variables):
        """Writes each device's blocks of `variables` ({name: variable}) to its own
        checkpoint file (`prefix-<i>-of-<n>`), with their layouts (`checkpoint.py`)."""
        mesh_checkpoint.save_shards(self, prefix, variables)

    def restore_shards(self, prefix, variables):
        """Restores `save_shards` files into `variables`: per device onto the same mesh
        and layout, else unsharded and resharded to each variable's layout."""
        mesh_checkpoint.restore_shards(self, prefix, variables)

    # -- helpers for the rules (rules.py) ------------------------------------------

    def dim_size(self, name):
        return self.dims[name]

    def coord(self, device_index, name):
        return self._coords[device_index][self._index[name]]

    # -- hooks ----------------------------------------------------------------------------

    def needs_copy(self, op, index):  # pylint: disable=method-hidden
        return op.type != "ParallelPack"

    def value_dtype(self, value):
        return value.shards[0].dtype

    def num_dims(self, value):
        return len(value.shape)

    def dim(self, value, index):
        n = value.shape[index]
        return -1 if n is None else int(n)

    def static_value(self, value):
        if value.replicated and value.var is None:
            return tf.get_static_value(value.shards[0])
        return None

    def tensor_debug_string(self, value):
        if value.var is not None:
            return "MeshVariableHandle(layout=%s)" % (value.var.layout,)
        return "MeshValue(layout=%s, value=%s)" % (
            value.layout, np.asarray(self.gather_full(value)) if hasattr(
                value.shards[0], "numpy") else value.shards[0])

    def copy_on(self, tensor):
        below = next_stack()
        found, value = representation_of(self, tensor)
        if found:  # ours, from an earlier merge
            return MeshValue([below.copy_on(s) for s in value.shards], value.layout,
                             value.shape, value.var)
        shards = self.replicas(below, tensor)
        shape = tensor._shape_tuple() or ()  # pylint: disable=protected-access
        var = VarInfo(broadcast=True) if tensor.dtype is tf.resource else None
        return MeshValue(shards, (None,) * len(shape), shape, var)

    def copy_off(self, value, device):
        if value.var is not None:
            raise errors.CopyOffError("oh.Mesh: a variable handle of %s cannot be copied off"
                                      % self.debug_string())
        return self.gather_full(value)

    def copy_on_grad(self, value, original_device):
        return self.gather_full(value)

    def function_input(self, value):
        """The distinct shards (devices sharing one tensor pass it once: a replay then
        sees the sharing and runs ops once per distinct inputs) and, in the summary,
        which of them each device holds."""
        var = value.var
        if var is not None and var.adopt is not None and tf.executing_eagerly():
            mesh_variables.apply_adoption(self, value)  # (before the call's replay key)
        parts, index, holds = [], {}, []
        for s in value.shards:
            j = index.get(id(s))
            if j is None:
                j = index[id(s)] = len(parts)
                parts.append(s)
            holds.append(j)
        summary = (value.layout, value.shape,
                   None if var is None else _VarSummary(var), tuple(holds))
        return summary, parts

    def function_output(self, summary, tensors):
        layout, shape, var, holds = summary
        if var is not None:
            var = var.record()
        return MeshValue([tensors[j] for j in holds], layout, shape, var)

    def function_join(self, summaries):
        """Values meeting in control flow with the same layout but different sharing of
        shards between devices join as unshared (`function_coerce` copies)."""
        first = summaries[0]
        if all(s == first for s in summaries[1:]) or any(
                s[:3] != first[:3] for s in summaries[1:]):
            return super().function_join(summaries)  # equal, or the default's error
        return first[:3] + (tuple(range(len(self.devices))),)

    def function_coerce(self, value, summary):
        if summary[3] != tuple(range(len(self.devices))):
            return super().function_coerce(value, summary)
        below, seen, shards = next_stack(), set(), []
        for device, s in zip(self.devices, value.shards):
            if id(s) in seen:  # a device's own copy of a shared shard
                s = self._copy_to(below, s, device)
            seen.add(id(s))
            shards.append(s)
        return MeshValue(shards, value.layout, value.shape, value.var)

    changes_computation = False  # runs each op as it is, on shards

    def execute(self, op, inputs):
        t = op.type
        if (t == "IdentityN" and len(inputs) == 2 and op.node_name is not None
                and SOURCE_GRADIENT_NODE in op.node_name):
            return self._traced_source_gradient(inputs)
        if t in _per_device.VARIABLE_READS and any(v.var is not None and not v.var.broadcast
                                       for v in inputs):
            _per_device.refuse_tape_below(self, op, "device", "oh.Mesh")
        if t not in _SPECIAL_OPS:
            for v in inputs:
                if v.var is not None:
                    break
            else:  # the common case: a rule, else the fallback
                if state.mode is not None:  # replaying: shape arithmetic as constants
                    folded = self._fold_shape_arithmetic(op, inputs)
                    if folded is not None:
                        return folded
                rule = RULES.get(t)
                out = rule(self, op, inputs) if rule is not None else None
                return out if out is not None else self._fallback(op, inputs)
        if t == "ParallelPack":
            return [self._pack(inputs)]
        if t == "ParallelUnpack":
            return [OffStack(s) for s in self._own_shards(inputs[0])]
        if t == "Identity" and getattr(self._local, "request", None) is not None:
            layout, shape = self._local.request
            if inputs[0].shape == shape:
                self._local.request = None
                return [self.relayout_value(inputs[0], layout)]
        if t == "Identity" and op.node_name is not None and "ohmesh" in op.node_name:
            marked = _MARKER.search(op.node_name)
            if marked is not None and int(marked.group(1), 16) == id(self):
                names = list(self.dims)
                layout = tuple(None if c == "n" else names[int(c)] for c in marked.group(2))
                layout = self._checked_layout(layout, inputs[0].shape, "shard")
                return [self.relayout_value(inputs[0], layout)]
        if t in _ITERATOR_OPS and not tf.executing_eagerly():
            # Reads at the top level of the replayed body were fetched before the call
            # (`iterator_element`); this one is in a loop or branch (Keras's
            # steps_per_execution > 1: get_next_as_optional in a while loop), which may
            # run it any number of times, so it cannot be fetched ahead.
            raise NotImplementedError(
                "oh.Mesh: op %s iterates a dataset inside a loop or branch of a function "
                "replayed on %s; batches read there have unknown shapes, which the SPMD "
                "rules need (a read at the function's top level is fetched before the "
                "call). Keras: compile with steps_per_execution=1 (compiled model.fit, "
                "evaluate and predict then work), or run_eagerly=True, or write the loop: "
                "iterate the dataset outside, shard each batch with mesh.shard and call a "
                "tf.function step in the mesh's scope" % (t, self.debug_string()))
        if any(v.var is not None for v in inputs) or t == "VarHandleOp":
            out = mesh_variables.variable_op(
                self, op, inputs, getattr(self._local, "var_request", None))
        else:
            rule = RULES.get(t)
            out = rule(self, op, inputs) if rule is not None else None
        return out if out is not None else self._fallback(op, inputs)

    # -- internals ------------------------------------------------------------------------

    def _fallback(self, op, inputs):
        """Gathers the inputs, runs the op once on the first device, replicates."""
        below = next_stack()
        sharded = [v for v in inputs if not v.replicated]
        op_def = op_def_registry.get(op.type)
        if inputs and not sharded and op_def is not None and not op_def.is_stateful \
                and not self._variant_stays_on_first(op, inputs):
            # Replicated inputs of a stateless op: the same result on every device.
            folded = self._fold(op, inputs)
            if folded is not None:
                return folded
            outs = self.run(op, inputs)
            return [MeshValue(o, (None,) * o[0].shape.rank, o[0].shape.as_list()) for o in outs]
        if sharded:
            self.fallbacks[op.type] += 1
            if self.fallbacks[op.type] == 1:
                _log.warning("oh.Mesh: op %s has no SPMD rule for layouts %s; its inputs are "
                             "gathered to full tensors and its outputs replicated (reported "
                             "once per op type)", op.type, [v.layout for v in inputs])
        full = [v.shards[0] if v.replicated else self.gather_full(v) for v in inputs]
        with scope.on_device(self.devices[0]), LAUNCHES:
            outs = below.execute(op, full)
        result = []
        for o in outs:
            if self._read_in_place(o):
                shards = (o,) * len(self.devices)
            else:
                shards = [o] + [self._copy_to(below, o, d) for d in self.devices[1:]]
            shape = o.shape.as_list() if o.shape.rank is not None else []
            result.append(MeshValue(shards, (None,) * len(shape), shape))
        return result

    def _variant_stays_on_first(self, op, inputs):
        """Whether `op` takes or makes a variant (a tf.data dataset) on devices that do not
        share host memory: it then runs once, on the first device, where the dataset
        stays (its batches are copied as any replicated output). TensorFlow cannot copy
        a dataset variant between the tasks of a cluster ("could not parse rpc response"),
        so one per device would need copies of the first device's."""
        if self.shares_host_memory:
            return False
        dtypes = op.output_dtypes or ()
        return any(d is tf.variant for d in dtypes) or any(
            v.shards[0].dtype is tf.variant for v in inputs)

    def _fold_shape_arithmetic(self, op, inputs):
        """In a replay, a stateless op with integer outputs of small known replicated
        inputs (a gradient's ExpandDims/ConcatV2 of shapes) folded to constants (as
        `_fold`), so that rules reading shapes (Reshape's target) see constants."""
        dtypes = op.output_dtypes
        if (not inputs or dtypes is None or not all(d.is_integer for d in dtypes)
                or not all(v.replicated and v.var is None for v in inputs)
                or not _stateless(op.type)):
            return None
        outs = self._fold(op, inputs)
        if outs is None or any(int(np.prod(o.shape)) > _SMALL for o in outs):
            return None
        return outs

    def _fold(self, op, inputs):
        """In a replay, a stateless op of small known values (BroadcastGradientArgs of
        shapes, a gradient's reduction axes) computed now, so rules see constants."""
        if tf.executing_eagerly() or op.output_dtypes is None or any(
                d in (tf.variant, tf.resource) for d in op.output_dtypes):
            return None  # (a TensorList or a handle has no NumPy value to fold into)
        values = [self.static_value(v) for v in inputs]
        if any(v is None or np.size(v) > _SMALL for v in values):
            return None
        with tf.init_scope(), scope.physical():
            outs = execute.execute(op.type, len(op.output_dtypes),
                                   [tf.constant(v) for v in values], op.attr_tuple(),
                                   context.context())
        return [self.constant(o.numpy()) for o in outs]

    def _pack(self, tensors):
        layout = getattr(self._local, "pack_layout", None)
        below = next_stack()
        shards = [t.shards[i] if isinstance(t, MeshValue) else self._copy_to(below, t, d)
                  for i, (d, t) in enumerate(zip(self.devices, tensors))]
        local = shards[0].shape.as_list()
        layout = layout or (None,) * len(local)
        shape = [n * self.dims[m] if m else n for n, m in zip(local, layout)]
        return MeshValue(shards, layout, shape)

    def pack(self, shards, layout):
        """A mesh tensor from its local shards (one per device, in device order)."""
        shards = [tf.convert_to_tensor(s) for s in shards]
        if len(shards) != len(self.devices):
            raise ValueError("oh.Mesh.pack: got %d shards for %d devices"
                             % (len(shards), len(self.devices)))
        # Every device holds a block of the same shape (layouts shard evenly): checked
        # here, or the mistake surfaces later as a raw ConcatOp error of a gather.
        first = shards[0]
        for i, s in enumerate(shards[1:], 1):
            if s.dtype != first.dtype or (
                    s.shape.is_fully_defined() and first.shape.is_fully_defined()
                    and s.shape.as_list() != first.shape.as_list()):
                raise ValueError(
                    "oh.Mesh.pack: shard %d (for %s) is %s %s, shard 0 is %s %s; every "
                    "device's shard must have the same dtype and shape"
                    % (i, self.devices[i], s.dtype.name, s.shape, first.dtype.name,
                       first.shape))
        global_shape = [n * self.dims[m] if m else n for n, m in zip(
            shards[0].shape.as_list(), layout)]
        layout = self._checked_layout(layout, tf.TensorShape(global_shape), "pack")
        with self._scope_for(None):
            self._local.pack_layout = layout
            try:
                return copies.parallel_pack(shards)
            finally:
                self._local.pack_layout = None

    def _value_of(self, tensor):
        if tensor is None:
            return None
        found, value = representation_of(self, tensor)
        return value if found else None

    def _checked_layout(self, layout, shape, what):
        layout = tuple(layout)
        shape = tf.TensorShape(shape)
        if shape.rank is not None and len(layout) != shape.rank:
            raise ValueError("oh.Mesh.%s: layout %s has %d entries for a tensor of rank %d"
                             % (what, layout, len(layout), shape.rank))
        used = [m for m in layout if m is not None]
        for m in used:
            if m not in self.dims:
                raise ValueError("oh.Mesh.%s: %r is not a dimension of %s"
                                 % (what, m, self.debug_string()))
        if len(set(used)) != len(used):
            raise ValueError("oh.Mesh.%s: layout %s uses a mesh dimension twice" % (what, layout))
        for a, m in enumerate(layout):
            n = shape[a] if shape.rank is not None else None
            if m is not None and n is None and what == "traced":
                continue  # decided when the function is replayed, with the global shape
            if m is not None and n is not None and n % self.dims[m] and what in _UNEVEN_OK:
                layout = layout[:a] + (None,) + layout[a + 1:]
                self._report_uneven(what, a, n, m)
            elif m is not None and (n is None or n % self.dims[m]):
                raise ValueError("oh.Mesh.%s: axis %d of size %s cannot be sharded over mesh "
                                 "dimension %r of size %d" % (what, a, n, m, self.dims[m]))
        return layout

    def _report_uneven(self, what, axis, n, m):
        self.uneven[m] += 1
        if self.uneven[m] == 1:
            _log.warning("oh.Mesh.%s: axis %d of size %d does not divide over mesh dimension "
                         "%r of size %d; that axis is kept replicated (a partial last batch: "
                         "same values, no parallelism on it; reported once per mesh "
                         "dimension, counted in mesh.uneven)", what, axis, n, m, self.dims[m])

    def _scope_for(self, tensor):
        """A scope where ops run on this mesh: the current one if it holds the mesh, the
        tensor's stack if it does, else the mesh's own scope."""
        if any(h is self for h in current_stack().handlers):
            return _NullScope()
        stack = stack_of(tensor) if tensor is not None else None
        if stack is not None and any(h is self for h in stack.handlers):
            return scope.handler(stack)
        return scope.handler(self)


class _NullScope:
    def __enter__(self):
        return None

    def __exit__(self, *exc_info):
        return False

