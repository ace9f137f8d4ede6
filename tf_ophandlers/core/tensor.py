"""What handler tensors show in Python: `tensor.device` and `tf.get_static_value`
(RFC "Available hooks").

`EagerTensor.device` is a C getset on a heap type; it is replaced by a property that asks
the tensor's handler (`OpHandler.device_string`) and falls back to TensorFlow's getter
for ordinary tensors. Transparent handlers (tapes) show the next stack's device, others
their stack name.
"""
import tensorflow as tf
from tensorflow.python.framework import ops as _ops

import tf_ophandlers._C as _C
from tf_ophandlers.core import tf_patches
from tf_ophandlers.core.state import state


def _wrap_device(tf_device):
    tf_getter = tf_device.__get__

    def device(self):
        p = _C.payload(self)
        if p is None:
            return tf_getter(self)
        stack, value = p
        return stack.handler.device_string(value, stack)

    return property(device, doc=tf_device.__doc__)


def _wrap_static_value(original_constant_value):
    eager_tensor = _ops.EagerTensor

    # tf.get_static_value / tensor_util.constant_value: gradient functions use it to
    # short-circuit. A handler tensor answers through its handler's `static_value` hook
    # instead of a copy-off (which a handler may refuse); so does a symbolic tensor of a
    # stack while a function is replayed (its payload is the replay's).

    def constant_value(tensor, partial=False):
        if isinstance(tensor, eager_tensor):
            p = _C.payload(tensor)
        elif state.mode is not None:  # a symbolic tensor of a stack, during a replay
            p = state.mode.payload(tensor)
        else:
            p = None
        if p is None:
            return original_constant_value(tensor, partial)
        stack, value = p
        return stack.handler.static_value(value)

    constant_value.__doc__ = original_constant_value.__doc__
    return constant_value


def _wrap_size(original):
    # tf.size computes an eager tensor's size in Python from its static shape; a handler
    # tensor may have unknown dims (oh.ParallelHandler's components of different batch
    # sizes): numpy then raised a TypeError (in _GatherV2Grad, an embedding's gradient).
    # Such a tensor runs the Size op, which its handler answers.
    from tensorflow.python.ops import gen_array_ops  # pylint: disable=import-outside-toplevel
    eager_tensor = _ops.EagerTensor

    def size_internal(input, name=None, optimize=True, out_type=tf.int32):  # pylint: disable=redefined-builtin
        if isinstance(input, eager_tensor) and None in input._shape_tuple():  # pylint: disable=protected-access
            return gen_array_ops.size(input, out_type=out_type, name=name)
        return original(input, name, optimize=optimize, out_type=out_type)

    size_internal.__doc__ = original.__doc__
    return size_internal


def _wrap_set_shape(original):
    # An eager tensor's shape is always fully known, so TensorFlow's EagerTensor.set_shape
    # requires each given dim to equal the tensor's. A handler tensor may have unknown
    # dims (oh.eval_shape's specs): tf.tensordot (Keras Dense on a 3-D input) then failed
    # on (None, None, None) vs (None, 5, 4). For such a tensor set_shape has graph
    # semantics, as in a tf.function: compatible shapes merge, and the handler's
    # `refine_shape` (if any) keeps the merged shape in the representation, so that the
    # ops that use the tensor see it too.
    shape_type = tf.TensorShape

    def set_shape(self, shape):
        p = _C.payload(self)
        if p is None or self.shape.is_fully_defined():
            return original(self, shape)
        shape = tf.TensorShape(shape)
        if not self.shape.is_compatible_with(shape):
            raise ValueError(f"Tensor's shape {self.shape} is not compatible "
                             f"with supplied shape {shape}.")
        merged = self.shape.merge_with(shape)
        stack, value = p
        refine = stack.handler.refine_shape
        if refine is not None:
            refine(value, merged)
        self._tensor_shape = shape_type(merged)  # pylint: disable=protected-access

    set_shape.__doc__ = original.__doc__
    return set_shape


tf_patches.subscribe("EagerTensor.device", "EagerTensor.device", _wrap_device)
tf_patches.subscribe("tensor_util.constant_value", "constant_value", _wrap_static_value)
tf_patches.subscribe("array_ops.size_internal", "size", _wrap_size)
tf_patches.subscribe("EagerTensor.set_shape", "EagerTensor.set_shape", _wrap_set_shape)
