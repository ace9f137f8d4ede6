"""Gradients of the broadcasting Add/AddV2/Sub/Mul (and Sum) from static shapes, for
`oh.GradientTape` on the stack of a handler with ``static_shape_gradients = True``
(oh.vectorized_map).

TensorFlow's eager gradient functions find the reduction axes at run time (two Shape ops
and a BroadcastGradientArgs, then a Sum and a Reshape per input: 7 ops for `h + b`),
where its graph gradients read them from the static shapes
(`math_grad._InferGradientReductionAxes`). On a handler's stack every op costs a trip
through the handler, so these do what the graph gradient does: the same Sum over the
same axes and a Reshape to the input's shape where an input was broadcast, nothing
where it was not. The values are those of TensorFlow's eager gradient (a Sum over no
axes and a Reshape to the same shape are the identity).
"""
import tensorflow as tf
from tensorflow.python.eager import context as _context
from tensorflow.python.ops import array_ops, gen_math_ops, math_ops

from tf_ophandlers.extend import (
    BoundedCache, executing_eagerly as _executing_eagerly, payload as _payload)

# (shape or axes, device scope) -> a physical int32 constant (a few per program).
_constants = BoundedCache("gradient_tape.static_shape_constants", 1024)


def _int32(values):
    key = (values, _context.context().device_name)
    t = _constants.get(key)
    if t is None:
        t = _constants[key] = tf.constant(values, dtype=tf.int32)
    return t


def _shape(t):
    """`t._shape_tuple()`; a handler tensor's from its representation when the handler
    gives it (`value_shape`, oh.vectorized_map's per-example shape): TensorFlow would ask
    the handler's num_dims and dim hooks, a trip through the dispatcher per axis."""
    p = _payload(t)
    if p is not None:
        shape = getattr(p[0].handler, "value_shape", None)
        if shape is not None:
            return shape(p[1])
    return t._shape_tuple()  # pylint: disable=protected-access


def _known(shape):
    return shape is not None and None not in shape


def _reduction_axes(xs, ys):
    """TensorFlow's `_InferGradientReductionAxes` on known shapes (tuples)."""
    rank = max(len(xs), len(ys))
    x_axes, y_axes = [], []
    for axis in range(rank):
        x_dim = 1 if axis < rank - len(xs) else xs[axis - (rank - len(xs))]
        y_dim = 1 if axis < rank - len(ys) else ys[axis - (rank - len(ys))]
        if x_dim == 1 and y_dim != 1:
            x_axes.append(axis)
        elif y_dim == 1 and x_dim != 1:
            y_axes.append(axis)
    return x_axes, y_axes


def _reduced(grad, grad_shape, shape, axes, other_rank):
    """`_ReduceGradientArg` with static axes (graph mode's `must_reduce`). A Sum over
    axes of size 1 only (`h + b` with `h` [1, n] per example) is left out: the Reshape
    alone gives its values (up to the sign of a zero)."""
    if grad is None or not (axes or len(shape) < other_rank):
        return grad
    if any(grad_shape[a] != 1 for a in axes):
        grad = math_ops.reduce_sum(grad, _int32(tuple(axes)), keepdims=True)
    return array_ops.reshape(grad, _int32(shape))


def _static(op, grad):
    """(x, y, x's shape, y's shape, grad's shape) of a binary op's gradient call when
    all are static and it runs eagerly with a dense gradient, else None."""
    if not isinstance(grad, tf.Tensor) or not _executing_eagerly():
        return None
    x, y = op.inputs
    if x is None or y is None:
        return None
    xs, ys, gs = _shape(x), _shape(y), _shape(grad)
    if not (_known(xs) and _known(ys) and _known(gs)):
        return None
    return x, y, xs, ys, gs


def _add_or_sub(op, grad, negate):
    """TensorFlow's `_AddGrad` / `_SubGrad` with static reduction axes, or None (not
    eager, unknown shapes, a non-dense gradient: the caller runs TensorFlow's)."""
    static = _static(op, grad)
    if static is None:
        return None
    _, _, xs, ys, gs = static
    skip = op.skip_input_indices or ()
    if 1 in skip and ys == ():
        return grad, None
    if xs == ys == gs:
        return grad, (-grad if negate else grad)
    x_axes, y_axes = _reduction_axes(xs, ys)
    gx = None if 0 in skip else grad
    gy = None if 1 in skip else (-grad if negate else grad)
    return (_reduced(gx, gs, xs, x_axes, len(ys)), _reduced(gy, gs, ys, y_axes, len(xs)))


def _mul(op, grad):
    """TensorFlow's `_MulGrad` with static reduction axes, or None."""
    static = _static(op, grad)
    if static is None or static[0].dtype.base_dtype != static[1].dtype.base_dtype:
        return None
    x, y, xs, ys, gs = static
    skip = op.skip_input_indices or ()
    if 1 in skip and ys == ():
        return gen_math_ops.mul(grad, math_ops.conj(y)), None
    if xs == ys == gs and grad.dtype in (tf.int32, tf.float32):
        return gen_math_ops.mul(grad, y), gen_math_ops.mul(grad, x)
    gx = None if 0 in skip else gen_math_ops.mul(grad, math_ops.conj(y))
    gy = None if 1 in skip else gen_math_ops.mul(math_ops.conj(x), grad)
    x_axes, y_axes = _reduction_axes(xs, ys)
    return (_reduced(gx, gs, xs, x_axes, len(ys)), _reduced(gy, gs, ys, y_axes, len(xs)))


def _sum(op, grad):
    """TensorFlow's `_SumGrad` where the input has one element (a per-example loss of
    shape [1] summed to a scalar): the Reshape alone, without its Tile by ones."""
    if not isinstance(grad, tf.Tensor) or not _executing_eagerly():
        return None
    x = op.inputs[0]
    shape = None if x is None else _shape(x)
    if not _known(shape) or any(d != 1 for d in shape):
        return None
    return [array_ops.reshape(grad, _int32(shape)), None]


#: op type -> fn(mock op, *output gradients) -> input gradients, or None (no fast path)
STATIC_GRADIENTS = {
    "Add": lambda op, grad: _add_or_sub(op, grad, False),
    "AddV2": lambda op, grad: _add_or_sub(op, grad, False),
    "Sub": lambda op, grad: _add_or_sub(op, grad, True),
    "Mul": _mul,
    "Sum": _sum,
}
