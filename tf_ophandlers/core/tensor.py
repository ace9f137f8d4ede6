"""What handler tensors show in Python: `tensor.device` (RFC "Available hooks").

`EagerTensor.device` is a C getset on a heap type; it is replaced by a property that asks
the tensor's handler (`OpHandler.device_string`) and falls back to TensorFlow's getter
for ordinary tensors. Transparent handlers (tapes) show the next stack's device, others
their stack name.
"""
from tensorflow.python.framework import ops as _ops

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
    _installed = True
