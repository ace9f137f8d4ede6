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

import tf_ophandlers._C as _C
from tf_ophandlers.core import tf_patches
from tf_ophandlers.core.state import state


def _install_device():
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


def _install_static_value():
    eager_tensor = _ops.EagerTensor

    # tf.get_static_value / tensor_util.constant_value: gradient functions use it to
    # short-circuit. A handler tensor answers through its handler's `static_value` hook
    # instead of a copy-off (which a handler may refuse); so does a symbolic tensor of a
    # stack while a function is replayed (its payload is the replay's).
    original_constant_value = _tensor_util.constant_value

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
    _tensor_util.constant_value = constant_value
    tf.get_static_value = constant_value


def _install_size():
    # tf.size computes an eager tensor's size in Python from its static shape; a handler
    # tensor may have unknown dims (oh.ParallelHandler's components of different batch
    # sizes): numpy then raised a TypeError (in _GatherV2Grad, an embedding's gradient).
    # Such a tensor runs the Size op, which its handler answers.
    from tensorflow.python.ops import array_ops  # pylint: disable=import-outside-toplevel
    from tensorflow.python.ops import gen_array_ops  # pylint: disable=import-outside-toplevel
    original = array_ops.size_internal
    eager_tensor = _ops.EagerTensor

    def size_internal(input, name=None, optimize=True, out_type=tf.int32):  # pylint: disable=redefined-builtin
        if isinstance(input, eager_tensor) and None in input._shape_tuple():  # pylint: disable=protected-access
            return gen_array_ops.size(input, out_type=out_type, name=name)
        return original(input, name, optimize=optimize, out_type=out_type)

    size_internal.__doc__ = original.__doc__
    array_ops.size_internal = size_internal


def _install_set_shape():
    # An eager tensor's shape is always fully known, so TensorFlow's EagerTensor.set_shape
    # requires each given dim to equal the tensor's. A handler tensor may have unknown
    # dims (oh.eval_shape's specs): tf.tensordot (Keras Dense on a 3-D input) then failed
    # on (None, None, None) vs (None, 5, 4). For such a tensor set_shape has graph
    # semantics, as in a tf.function: compatible shapes merge, and the handler's
    # `refine_shape` (if any) keeps the merged shape in the representation, so that the
    # ops that use the tensor see it too.
    base = _ops._EagerTensorBase  # pylint: disable=protected-access
    original = base.set_shape
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
    base.set_shape = set_shape


tf_patches.register(
    "EagerTensor.device", "tensorflow.python.framework.ops.EagerTensor.device",
    "tensor.device of a handler tensor is what its handler says (OpHandler.device_string: "
    "a transparent tape shows the physical device); the getter is a C getset with no "
    "hook. Plain tensors pay one C call (payload lookup) more.", "runtime",
    _install_device, None)
tf_patches.register(
    "constant_value", "tensorflow.python.framework.tensor_util.constant_value, "
    "tf.get_static_value",
    "gradient functions short-circuit on static values; a handler tensor answers through "
    "its handler's static_value hook instead of a copy-off the handler may refuse.",
    "runtime", _install_static_value, None)
tf_patches.register(
    "size", "tensorflow.python.ops.array_ops.size_internal",
    "eagerly, tf.size multiplies the tensor's static dims in Python; a handler tensor "
    "with an unknown dim (components of different batch sizes on several devices) runs "
    "the Size op instead. Plain tensors pay one shape check.", "runtime",
    _install_size, None)
tf_patches.register(
    "EagerTensor.set_shape", "tensorflow.python.framework.ops._EagerTensorBase.set_shape",
    "TensorFlow's eager set_shape requires equal dims (an eager shape is always known); a "
    "handler tensor with unknown dims (a handler that infers shapes only) gets graph semantics: compatible "
    "shapes merge (OpHandler.refine_shape). Plain tensors pay one payload lookup.",
    "runtime", _install_set_shape, None)
