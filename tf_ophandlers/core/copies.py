"""The copy ops and their gradients (RFC "Copies and their gradients").

CopyOn/CopyOnGrad and CopyOff/CopyOffGrad live in the op library `_copy_ops`
(cc/kernels/copy_ops.cc), loaded with `tf.load_op_library` so TensorFlow generates their
wrappers and records them on tapes. Their gradients are each other, so higher-order
gradients work and CopyOn must be linear: d CopyOn = CopyOnGrad, d CopyOnGrad = CopyOn,
d CopyOff = CopyOffGrad, d CopyOffGrad = CopyOff.

Run under a handler scope, `copy_on(x)` puts `x` on the current stack and
`copy_off(x, device)` takes a handler tensor off its stack; on a physical device all four
are the identity.
"""
import glob
import os

import tensorflow as tf
from tensorflow.python import pywrap_tfe as _pywrap_tfe
from tensorflow.python.eager import context as _context
from tensorflow.python.eager import core as _core
from tensorflow.python.framework import ops as _ops

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_lib = tf.load_op_library(sorted(glob.glob(os.path.join(_PACKAGE_DIR, "_copy_ops*.so")))[0])


def _fast(wrapper, op_type, x, attr, value):
    """`wrapper(x, **{attr: value})` (the op library's generated wrapper) run eagerly the
    way its own fast path runs it (`TFE_Py_FastPathExecute`: the op executes and is
    recorded on TensorFlow's tapes), without the wrapper's Python layers (dispatch
    decorators, argument handling): the copy ops' gradients run for every copied tensor
   . Graph mode and the fast path's fallbacks (an input it cannot convert)
    take the wrapper."""
    ctx = _context.context()
    if ctx.executing_eagerly():
        try:
            if attr is None:
                return _pywrap_tfe.TFE_Py_FastPathExecute(ctx, op_type, None, x)
            return _pywrap_tfe.TFE_Py_FastPathExecute(ctx, op_type, None, x, attr, value)
        except _core._NotOkStatusException as e:  # pylint: disable=protected-access
            _ops.raise_from_not_ok_status(e, None)
        except _core._FallbackException:  # pylint: disable=protected-access
            pass
    return wrapper(x) if attr is None else wrapper(x, **{attr: value})


def copy_on(x):
    """CopyOn: `x` copied onto the stack the op runs on.

    Examples:
        >>> class Doubling(oh.OpHandler):
        ...     def copy_on(self, tensor):       # what enters the handler is doubled
        ...         return 2.0 * tensor
        >>> with Doubling():
        ...     y = oh.copy_on(tf.constant(3.0))
        >>> float(y)
        6.0
    """
    return _fast(_lib.copy_on, "CopyOn", x, None, None)


def copy_on_grad(dcopied, original_device=""):
    """CopyOnGrad: the gradient of CopyOn, mapped back to `original_device`."""
    return _fast(_lib.copy_on_grad, "CopyOnGrad", dcopied, "original_device",
                 original_device)


def copy_off(x, new_device=""):
    """CopyOff: `x` copied off its handler stack to `new_device`.

    Examples:
        >>> with oh.OpHandler():
        ...     y = tf.constant([1.0, 2.0]) * 2.0
        >>> z = oh.copy_off(y, "/job:localhost/replica:0/task:0/device:CPU:0")
        >>> z.device.endswith("CPU:0"), z.numpy().tolist()
        (True, [2.0, 4.0])
    """
    return _fast(_lib.copy_off, "CopyOff", x, "new_device", new_device)


def copy_off_grad(dcopied, original_device=""):
    """CopyOffGrad: the gradient of CopyOff."""
    return _fast(_lib.copy_off_grad, "CopyOffGrad", dcopied, "original_device",
                 original_device)


def parallel_pack(tensors):
    """ParallelPack: one tensor of the current stack's parallel handler whose component i
    is `tensors[i]` (an op of the handler-specific op library; identity elsewhere)."""
    return _lib.parallel_pack(tensors)


def parallel_unpack(tensor, num_components):
    """ParallelUnpack: the `num_components` components of a parallel handler's tensor."""
    return _lib.parallel_unpack(tensor, N=num_components)


def _string_attr(op, name):
    value = op.get_attr(name)
    return value.decode() if isinstance(value, bytes) else value


def _keep_slices(copy, grad, **attrs):
    """`copy` applied to `grad`; a sparse gradient (tf.IndexedSlices, as TensorFlow gives
    for a gather from a variable) stays sparse, with each of its parts copied (a copy is
    linear and elementwise), so optimizers see the gradient type TensorFlow gives."""
    if isinstance(grad, tf.IndexedSlices):
        shape = grad.dense_shape
        return tf.IndexedSlices(copy(grad.values, **attrs), copy(grad.indices, **attrs),
                                None if shape is None else copy(shape, **attrs))
    return copy(grad, **attrs)


def _reduced_in_copy_on_grad(grad):
    """Whether a handler of the stack the sparse gradient `grad` lives on combines parts
    in `copy_on_grad` (OpHandler.copy_on_grad_reduces)."""
    from tf_ophandlers.core.stack import stack_of  # pylint: disable=import-outside-toplevel
    for part in (grad.values, grad.indices):  # either part may be the reducing stack's
        stack = stack_of(part)
        if stack is not None and any(getattr(h, "copy_on_grad_reduces", False)
                                     for h in getattr(stack, "handlers", ())):
            return True
    return False


@_ops.RegisterGradient("CopyOn")
def _copy_on_gradient(op, grad):
    if isinstance(grad, tf.IndexedSlices) and _reduced_in_copy_on_grad(grad):
        # Summing each part (values, indices, dense shape) of a parallel handler's
        # components would add indices and dense shapes: a wrong gradient.
        grad = tf.convert_to_tensor(grad)
    return _keep_slices(copy_on_grad, grad, original_device=op.inputs[0].device)


@_ops.RegisterGradient("CopyOnGrad")
def _copy_on_grad_gradient(op, grad):
    return _keep_slices(copy_on, grad)


@_ops.RegisterGradient("CopyOff")
def _copy_off_gradient(op, grad):
    return _keep_slices(copy_off_grad, grad,
                        original_device=_string_attr(op, "new_device"))


@_ops.RegisterGradient("CopyOffGrad")
def _copy_off_grad_gradient(op, grad):
    return _keep_slices(copy_off, grad, new_device=_string_attr(op, "original_device"))
