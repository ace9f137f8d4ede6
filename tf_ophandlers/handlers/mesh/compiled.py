"""`oh.Mesh`'s compiled per-op calls: the per-device runs of one op (`Mesh.run`) as one
multi-device function, built once per (op type, attributes, devices, input dtypes) in a
bounded cache and called as one eager op (no per-device Python call and device scope).

Used, with `oh.Mesh(..., compile_ops=True)`, for stateless ops with tensor inputs when
the mesh runs eagerly straight on TensorFlow's devices (nothing below it); otherwise, or
when a function cannot be built for the op, the mesh runs the op once per device.
Measured in `benchmarks/mesh.py`: on a loaded 2-core machine a multi-device function
call (its partitions run on the inter-op threads) was slower than four eager ops, so it
is off by default.

>>> calls = PerOpCalls(["/device:CPU:0", "/device:CPU:1"])
>>> op = Op.cached("Mul", T=tf.float32)
>>> outs = calls.run(op, [[tf.constant(2.)] * 2, [tf.constant(3.)] * 2], lambda: PHYSICAL)
>>> [float(t) for t in outs[0]]
[4.0, 9.0]
"""
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from tf_ophandlers.extend import functions, LAUNCHES, LRUCache, PHYSICAL, scope
from tf_ophandlers.extend import Op  # noqa: F401  (the docstring's example)

_NOT_TENSORS = (tf.resource, tf.variant, tf.string)
_calls = LRUCache("mesh.per_op_functions", 1024)  # key -> CompiledCall, or False


def _build(op, devices, dtypes):
    n = len(dtypes)
    specs = [tf.TensorSpec(None, d) for d in dtypes] * len(devices)

    def body(*args):
        graph = tf.compat.v1.get_default_graph()
        outs = []
        for i, device in enumerate(devices):
            with graph.device(device):
                outs.extend(graph.create_op(op.type, list(args[i * n:(i + 1) * n]),
                                            attrs=op.attr_protos()).outputs)
        return outs

    with tf.init_scope():
        fn = tf.function(body, input_signature=specs, autograph=False)
        return functions.CompiledCall(fn.get_concrete_function())


class PerOpCalls:
    """Compiled per-op calls over `devices` (the mesh's, in its order)."""

    def __init__(self, devices, enabled=True):
        self.devices = tuple(devices)
        self.enabled = enabled

    def run(self, op, per_device_args, below_fn):
        """A list per output of the per-device results of `op` on `per_device_args`
        (one input list per device), or None when the op must run per device.
        `below_fn()` is the stack below the mesh (compiled calls need PHYSICAL)."""
        first = per_device_args[0]
        if not self.enabled or not first or below_fn() is not PHYSICAL or not tf.executing_eagerly():
            return None
        dtypes = tuple(t.dtype for t in first)
        if any(d in _NOT_TENSORS for d in dtypes):
            return None
        key = (op.type, op.attrs_key(), self.devices, dtypes)
        call = _calls.get(key)
        if call is None:
            op_def = op_def_registry.get(op.type)
            if op_def is None or op_def.is_stateful or op.output_dtype_enums is None:
                call = False
            else:
                try:
                    call = _build(op, self.devices, dtypes)
                except (ValueError, TypeError, tf.errors.OpError):
                    call = False  # shape functions that need static shapes: per device
            _calls[key] = call
        if call is False:
            return None
        with scope.on_device(self.devices[0]), LAUNCHES:
            flat = call.run(PHYSICAL, [t for args in per_device_args for t in args])
        k = len(flat) // len(self.devices)
        return [tuple(flat[i * k + j] for i in range(len(self.devices))) for j in range(k)]
