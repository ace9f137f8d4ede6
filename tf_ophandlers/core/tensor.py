"""What handler tensors show in Python: `tensor.device` and `tf.get_static_value`
(RFC "Available hooks").

`EagerTensor.device` is a C getset on a heap type; it is replaced by a property that asks
the tensor's handler (`OpHandler.device_string`) and falls back to TensorFlow's getter
for ordinary tensors. Transparent handlers (tapes) show the next stack's device, others
their stack name.
"""
import tensorflow as tf
from tensorflow.python.framework import ops as _ops
from tensorflow.python.framework import tensor_util as _tensor_util

from tf_ophandlers import _C

_installed = False


def install():
    global _installed
    if _installed:
        return
    eager_tensor = _ops.EagerTensor
    tf_device = eager_tensor.__dict__.get("device") or _ops._EagerTensorBase.__dict__["device"]  # pylint: disable=protected-access
    tf_getter = tf_device.__get__

    def device(self):
        p = _C.payload(self)
        if p is None:
            return tf_getter(self)
        stack, value = p
        return stack.handler.device_string(value, stack)

    eager_tensor.device = property(device, doc=tf_device.__doc__)

    # tf.get_static_value / tensor_util.constant_value: gradient functions use it to
    # short-circuit. A handler tensor answers through its handler's `static_value` hook
    # instead of a copy-off (which a handler may refuse).
    original_constant_value = _tensor_util.constant_value

    def constant_value(tensor, partial=False):
        p = _C.payload(tensor) if isinstance(tensor, eager_tensor) else None
        if p is None:
            return original_constant_value(tensor, partial)
        stack, value = p
        return stack.handler.static_value(value)

    constant_value.__doc__ = original_constant_value.__doc__
    _tensor_util.constant_value = constant_value
    tf.get_static_value = constant_value
    _installed = True
