"""`oh.Mesh`'s per-device launches and communication (a mixin of `Mesh`, handler.py).

Every op the mesh issues is a raw op run on the stack below with the physical device set
directly (`run`, `run_on`): no TensorFlow Python API and no device-scope object per
device. Communication among the devices of one mesh dimension is explicit:

- all-reduce: one `AddN` (or `Maximum`, ...) per group on the group's first device, a
  `Mean`'s division done there once, then the result for the other devices;
- all-gather: a `ConcatV2` on each device; a relayout onto a mesh dimension: one `Slice`
  per device.

A result "for another device" is the tensor itself when the mesh's devices are CPUs of
one process (`Mesh.shares_host_memory`: an op there reads a tensor of another logical
CPU in place, while an explicit copy is one more eager op) and in a replayed function
(the graph partitioner adds the transfers); otherwise an `Identity` on that device.
There, devices holding the same tensor (a value replicated along a mesh dimension)
share one op: `run` runs a stateless op once per distinct inputs, and slices,
all-gathers and all-reduces are made once per distinct inputs too.

>>> mesh = oh.Mesh({"x": 2}, ["CPU:0", "CPU:1"])
>>> with mesh:
...     s = mesh.shard(tf.range(4.), ("x",))
...     float(tf.reduce_sum(s))     # one AddN of the two shards, then one Sum
6.0
"""
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import device_spec, op_def_registry

from tf_ophandlers.extend import (
    BoundedCache, COPY_OPS, execute_physical, LAUNCHES, LRUCache, next_stack, Op, PHYSICAL,
    scope, stack_of, state)
from tf_ophandlers.handlers.mesh.rules import MeshValue

SMALL = 16  # tensors up to this size are shared between devices, never copied eagerly
_COMBINE = {"sum": "AddN", "max": "Maximum", "min": "Minimum", "prod": "Mul",
            "all": "LogicalAnd", "any": "LogicalOr"}
_ops = BoundedCache("mesh.ops", 256)  # (name, dtype, n) -> Op
_constants = LRUCache("mesh.constants", 512)  # (bytes, dtype, shape) -> eager tensor
_stateless_types = BoundedCache("mesh.stateless_op_types", 1024)  # op type -> bool
# In a replay: (id of a device-less Const tensor, device) -> weak references to it and to
# its copy on the device. Weak: the graph keeps both alive while it is built, and a
# strong entry would keep every replayed graph alive.
_placed_constants = LRUCache("mesh.placed_constants", 1024)
_RESOURCE = tf.resource  # dtypes are interned: `is` compares them


def raw_op(name, dtype, n=None):
    """The (cached) Op `name` for inputs of `dtype` (`n`: AddN's and ConcatV2's count)."""
    key = (name, id(dtype), n)  # DTypes are interned; hashing one runs Python code
    op = _ops.get(key)
    if op is None:
        if name == "AddN":
            op = Op.cached(name, N=n, T=dtype)
        elif name == "ConcatV2":
            op = Op.cached(name, N=n, T=dtype, Tidx=tf.int32)
        elif name == "Slice":
            op = Op.cached(name, T=dtype, Index=tf.int32)
        elif name in ("LogicalAnd", "LogicalOr"):
            op = Op.cached(name)
        else:
            op = Op.cached(name, T=dtype)
        _ops[key] = op
    return op


def stateless(op_type):
    """Whether ops of `op_type` are stateless (the same inputs give the same outputs)."""
    known = _stateless_types.get(op_type)
    if known is None:
        op_def = op_def_registry.get(op_type)
        known = _stateless_types[op_type] = op_def is not None and not op_def.is_stateful
    return known


def _of_this_context(tensor):
    """Whether `tensor` belongs to where ops run now (an eager tensor while executing
    eagerly, a tensor of the graph being built): relayouts of a value are remembered only
    then (never a replay's symbolic tensors on an eager value it captured)."""
    if tf.executing_eagerly():
        return True
    return getattr(tensor, "graph", None) is tf.compat.v1.get_default_graph()


def placed_constants(tensors, device):
    """`tensors` (inputs of an op a replay emits on `device`) with each constant of the
    function that has no device (a constant of the traced body, a `host_constant`)
    replaced by its copy on `device`, made once per constant and device: else the
    partitioned function sends the one constant to every device that reads it (a
    Send/Recv pair per device, most of a replayed step's cross-device edges)."""
    out = list(tensors)
    for k, t in enumerate(out):
        node = getattr(t, "op", None)
        if node is None or node.type != "Const" or node.device:
            continue
        key = (id(t), device)
        hit = _placed_constants.get(key)
        copy = hit[1]() if hit is not None and hit[0]() is t else None
        if copy is None:
            with t.graph.as_default(), t.graph.device(device):
                copy = tf.constant(tf.get_static_value(t), t.dtype)
            _placed_constants[key] = (weakref.ref(t), weakref.ref(copy))
        out[k] = copy
    return out


def host_memory_devices(devices):
    """Whether `devices` (canonical names) are CPUs of one task: an op on one of them
    reads a tensor of another in place."""
    specs = [device_spec.DeviceSpecV2.from_string(d) for d in devices]
    return all(s.device_type == "CPU" and (s.job, s.replica, s.task) == (
        specs[0].job, specs[0].replica, specs[0].task) for s in specs)


class _OnDevice:
    """`scope.on_device(device)` holding `LAUNCHES` (core/launch_lock.py): the
    TensorFlow calls of a rule on one mesh device take turns with other threads'."""

    __slots__ = ("_placement",)

    def __init__(self, device):
        self._placement = scope.on_device(device)

    def __enter__(self):
        LAUNCHES.acquire()
        try:
            self._placement.__enter__()
        except BaseException:
            LAUNCHES.release()
            raise
        return self

    def __exit__(self, *exc_info):
        try:
            return self._placement.__exit__(*exc_info)
        finally:
            LAUNCHES.release()


class MeshCommunication:
    """Launches and communication for `Mesh` (needs `devices`, `dims`, `_index`,
    `_coords`, `_groups`, `shares_host_memory` and `_per_op`)."""

    def on_device(self, device_index):
        """A scope placing the TensorFlow calls of a rule on one mesh device (in a
        replayed function too: core/functions/symbolic.py places the nodes a hook
        creates on the hook's device)."""
        return _OnDevice(self.devices[device_index])

    def run(self, op, args, eager_op=None, distinct=False):
        """Runs `op` on every device's shards of `args` (MeshValues); a list per output
        of the per-device results. `eager_op`: an equivalent op launched instead when
        the shards run as eager ops on TensorFlow's devices (not in a replay);
        `distinct`: no two devices hold the same shards of every arg (the caller knows
        from the layouts: no search for shared inputs)."""
        if self._per_op.enabled:
            compiled = self._per_op.run(
                op, [[v.shards[i] for v in args] for i in range(len(self.devices))],
                next_stack)
            if compiled is not None:
                return compiled
        if self.shares_host_memory and args and not distinct:
            first = args[0].shards
            if (first[0] is first[-1] or len(set(map(id, first))) < len(first)) \
                    and stateless(op.type):
                columns = list(zip(*[v.shards for v in args]))
                keys = [tuple(map(id, c)) for c in columns]
                if len(set(keys)) < len(keys):
                    return self._run_once_per_inputs(op, columns, keys, eager_op)
        below = next_stack()
        st = state
        if below is PHYSICAL and st.mode is None and op.type not in COPY_OPS:
            # Eager, straight on TensorFlow's devices: one eager op per device.
            op = eager_op or op
            # The launches take turns with other threads' (core/launch_lock.py:
            # TensorFlow mixes up the inputs of concurrent ops on a device otherwise).
            with LAUNCHES:
                if args:
                    outs = [execute_physical(op, shards, device) for device, shards in
                            zip(self.devices, zip(*[v.shards for v in args]))]
                else:
                    outs = [execute_physical(op, [], device) for device in self.devices]
            return list(zip(*outs)) if outs[0] else []
        saved = st.device
        outs = []
        placing = st.mode is not None
        try:
            with LAUNCHES:
                if args:
                    for device, shards in zip(self.devices, zip(*[v.shards for v in args])):
                        st.device = device
                        shards = placed_constants(shards, device) if placing else list(shards)
                        outs.append(below.execute(op, shards))
                else:
                    for device in self.devices:
                        st.device = device
                        outs.append(below.execute(op, []))
        finally:
            st.device = saved
        return list(zip(*outs)) if outs and outs[0] else []

    def _run_once_per_inputs(self, op, columns, keys, eager_op=None):
        """A stateless op on a host-memory mesh whose devices share input shards (the
        same tensors: replicated along a mesh dimension): run once per distinct inputs
        (`columns`: each device's input shards, `keys` their ids), on the first device
        that has them; the others read that result in place."""
        done, outs = {}, []
        for i, (shards, key) in enumerate(zip(columns, keys)):
            out = done.get(key)
            if out is None:
                out = done[key] = self.run_on(op, list(shards), i, eager_op)
            outs.append(out)
        return list(zip(*outs)) if outs[0] else []

    def run_on(self, op, inputs, device_index, eager_op=None):
        """The outputs of `op` run once, on mesh device `device_index` (`eager_op`: as
        in `run`)."""
        st = state
        below = next_stack()
        if below is PHYSICAL and st.mode is None:
            with LAUNCHES:
                return execute_physical(eager_op or op, inputs, self.devices[device_index])
        saved = st.device
        st.device = device = self.devices[device_index]
        try:
            if st.mode is not None:
                inputs = placed_constants(inputs, device)
            with LAUNCHES:
                return below.execute(op, inputs)
        finally:
            st.device = saved

    def map_shards(self, fn, shards):
        out = []
        for i, s in enumerate(shards):
            with self.on_device(i):
                out.append(fn(s))
        return out

    def host_constant(self, value, dtype):
        """A small constant (axes, slice bounds) as a tensor ops of the next stack take:
        cached eager tensors; a node in a replayed function."""
        value = np.asarray(value, dtype.as_numpy_dtype)
        if not tf.executing_eagerly():
            return tf.constant(value)
        key = (value.tobytes(), dtype, value.shape)
        t = _constants.get(key)
        if t is None:
            with scope.physical():
                t = _constants[key] = tf.constant(value)
        return t

    def constant(self, value):
        """A replicated mesh value of a numpy constant."""
        value = np.asarray(value)
        if value.size <= SMALL:
            t = self.host_constant(value, tf.as_dtype(value.dtype))
            return MeshValue((t,) * len(self.devices), (None,) * value.ndim, value.shape)
        t = tf.constant(value)
        return MeshValue(self.replicas(next_stack(), t), (None,) * t.shape.rank,
                         t.shape.as_list())

    def all_reduce(self, shards, dims, kind, divide_by=None):
        """Combines shards over the devices that differ only in the mesh dimensions
        `dims` (partial sums, maxima, ...): one reduction per group, on the group's first
        device (then divided by `divide_by` there, for a mean), whose result every
        device of the group gets."""
        shards = list(shards)
        name = _COMBINE[kind]
        dtype = shards[0].dtype
        below = next_stack()
        share = self.shares_host_memory
        done = {}
        for group in self._reduce_groups(frozenset(dims)):
            first = group[0]
            parts = [shards[j] for j in group]
            key = tuple(map(id, parts)) if share else None
            if key in done:  # the same partial results as an earlier group's: shared
                for i in group:
                    shards[i] = done[key]
                continue
            if len(parts) == 1:
                total = parts[0]
            elif name == "AddN":
                (total,) = self.run_on(raw_op(name, dtype, len(parts)), parts, first)
            else:
                total = parts[0]
                for p in parts[1:]:
                    (total,) = self.run_on(raw_op(name, dtype), [total, p], first)
            if divide_by is not None:
                (total,) = self.run_on(raw_op("RealDiv", dtype),
                                       [total, self.host_constant(divide_by, dtype)], first)
            if self._read_in_place(total):
                for i in group:
                    shards[i] = total
            else:
                for i in group:
                    shards[i] = total if i == first else self._copy_to(
                        below, total, self.devices[i])
            if share:
                done[key] = total
        return shards

    def _own_shards(self, value):
        """The shards of `value`, each on its own device (a shard read in place from
        another device is copied there): what `unpack` returns."""
        below = next_stack()
        shards = list(value.shards)
        if tf.executing_eagerly():
            for i, s in enumerate(shards):
                if (s.dtype is not _RESOURCE and stack_of(s) is None
                        and s.device != self.devices[i]):
                    shards[i] = self._copy_to(below, s, self.devices[i])
        return shards

    def _reduce_groups(self, dims):
        groups = self._groups.get(dims)
        if groups is None:
            keep = [d for n, d in self._index.items() if n not in dims]
            by_key = {}
            for i, c in enumerate(self._coords):
                by_key.setdefault(tuple(c[d] for d in keep), []).append(i)
            groups = self._groups[dims] = list(by_key.values())
        return groups

    def _read_in_place(self, tensor):
        """Whether an op on any mesh device reads `tensor` in place (small tensors,
        host-memory meshes, replayed functions) instead of a copy on its device.
        Resource handles are always copied (a handle belongs to its device)."""
        if tensor.dtype is _RESOURCE or stack_of(tensor) is not None:
            return False
        if self.shares_host_memory or not tf.executing_eagerly():
            return True
        n = tensor.shape.num_elements()
        return n is not None and n <= SMALL

    def _replica(self, below, tensor, device_index):
        """`tensor` for device `device_index`: itself if read in place there, else a
        copy there."""
        if self._read_in_place(tensor):
            return tensor
        return self._copy_to(below, tensor, self.devices[device_index])

    def replicas(self, below, tensor):
        """`tensor` for every mesh device (a tuple): `_replica` per device."""
        if self._read_in_place(tensor):
            return (tensor,) * len(self.devices)
        return tuple(self._copy_to(below, tensor, d) for d in self.devices)

    @staticmethod
    def _copy_to(below, tensor, device):
        st = state
        if below is PHYSICAL and st.mode is None:
            with LAUNCHES:
                (copy,) = execute_physical(raw_op("Identity", tensor.dtype), [tensor], device)
            return copy
        saved = st.device
        st.device = device
        try:
            with LAUNCHES:
                (copy,) = below.execute(raw_op("Identity", tensor.dtype), [tensor])
        finally:
            st.device = saved
        return copy

    def relayout_value(self, value, layout):
        """`value` (a MeshValue) with `layout`: all-gathers along axes that lose their
        mesh dimension, then one slice per device for the axes that gain one."""
        layout = tuple(layout)
        if value.layout == layout:
            return value
        if value.var is not None or not _of_this_context(value.shards[0]):
            return self._relayout(value, layout)
        done = value.relayouts
        if done is not None and layout in done:
            return done[layout]
        out = self._relayout(value, layout)
        if done is None:
            done = value.relayouts = {}
        done[layout] = out
        return out

    def _relayout(self, value, layout):
        shards, cur = list(value.shards), list(value.layout)
        share = self.shares_host_memory
        for a, (m, m2) in enumerate(zip(value.layout, layout)):
            if m is not None and m != m2:
                done, gathered = {}, []
                for i in range(len(self.devices)):
                    parts = [shards[j] for j in self._groups[m][i]]
                    key = tuple(map(id, parts)) if share else i
                    out = done.get(key)
                    if out is None:
                        out = done[key] = self._concat(parts, a, i)
                    gathered.append(out)
                shards = gathered
                cur[a] = None
        gain = [(a, m2) for a, m2 in enumerate(layout) if m2 is not None and cur[a] is None]
        if gain:
            rank = len(layout)
            rows = {}
            for a, m2 in gain:
                n, k = value.shape[a], self.dims[m2]
                if n is None or n % k:
                    raise ValueError("oh.Mesh: axis %d of size %s cannot be sharded over mesh "
                                     "dimension %r of size %d" % (a, n, m2, k))
                rows[a] = n // k
            op = raw_op("Slice", shards[0].dtype)
            done = {}
            for i in range(len(self.devices)):
                begin, size = [0] * rank, [-1] * rank
                for a, m2 in gain:
                    begin[a] = self._coords[i][self._index[m2]] * rows[a]
                    size[a] = rows[a]
                # Devices holding the same tensor that get the same block share one
                # Slice (a host-memory mesh reads it in place).
                key = (id(shards[i]), tuple(begin)) if share else i
                out = done.get(key)
                if out is None:
                    (out,) = self.run_on(op, [shards[i], self.host_constant(begin, tf.int32),
                                              self.host_constant(size, tf.int32)], i)
                    done[key] = out
                shards[i] = out
        return MeshValue(shards, layout, value.shape)

    def gather_full(self, value, device_index=0):
        """The full tensor of `value` on one device (a next-stack tensor)."""
        unused = [self._index[n] for n in self.dims if n not in value.layout]
        live = {i: s for i, s in enumerate(value.shards)
                if all(self._coords[i][d] == 0 for d in unused)}
        for a, m in enumerate(value.layout):
            if m is None:
                continue
            d = self._index[m]
            live = {i: self._concat([live[j] for j in self._groups[m][i]], a, device_index)
                    for i in live if self._coords[i][d] == 0}
        (full,) = live.values()
        if value.replicated and device_index:
            return self._copy_to(next_stack(), full, self.devices[device_index])
        return full

    def _concat(self, parts, axis, device_index):
        op = raw_op("ConcatV2", parts[0].dtype, len(parts))
        (out,) = self.run_on(op, list(parts) + [self.host_constant(axis, tf.int32)],
                             device_index)
        return out
