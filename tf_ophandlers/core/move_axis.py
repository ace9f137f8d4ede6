"""OhMoveAxis (cc/handlers/data_format/move_axis.cc, in the `_copy_ops` op library): ``transpose(x, [0, 2, ...,
r-1, 1])`` (``to_last``) or ``transpose(x, [0, r-1, 1, ..., r-2])``, the data move of a
channels-first tensor to channels-last and back, in a kernel cheaper than TensorFlow's
Transpose for it (a 3-channel image: Eigen's shuffle computes an index per element).

Only for graphs that stay in the process (the replay cache's functions): a graph users
may export keeps tf.transpose, so that it loads without this library (TensorFlow
Serving). The gradient is the move the other way.
"""
import tensorflow as tf
from tensorflow.python.framework import ops as _ops

from tf_ophandlers.core import copies as _copies
from tf_ophandlers.core.functions import per_call
from tf_ophandlers.core.op import Op
from tf_ophandlers.core.stack import PHYSICAL

# Types the kernel cannot move as plain memory.
_NOT_PLAIN = frozenset((tf.string, tf.resource, tf.variant))


def direction(perm, dtype):
    """True if `perm` moves axis 1 to the end, False if it moves the last axis to 1,
    None if it is neither (or rank < 3, or `dtype` is not plain memory)."""
    r = len(perm)
    if r < 3 or perm[0] != 0 or dtype in _NOT_PLAIN:
        return None
    rest = tuple(perm[1:])
    if rest == tuple(range(2, r)) + (1,):
        return True
    if rest == (r - 1,) + tuple(range(1, r - 1)):
        return False
    return None


def move_axis(x, to_last):
    """OhMoveAxis(x, to_last) through the op library's wrapper (eager or graph)."""
    return _copies._lib.oh_move_axis(x, to_last=to_last)  # pylint: disable=protected-access


@_ops.RegisterGradient("OhMoveAxis")
def _move_axis_gradient(op, grad):
    return move_axis(grad, not op.get_attr("to_last"))


def in_replay(nxt, value, perm):
    """``transpose(value, perm)`` as one OhMoveAxis node when a replay over the physical
    device is being built (a function of the replay cache) and `perm` is a channels
    move; None otherwise (the caller runs tf.transpose)."""
    if nxt is not PHYSICAL or not per_call.replaying():
        return None
    to_last = direction(perm, value.dtype)
    if to_last is None:
        return None
    return nxt.execute(Op.cached("OhMoveAxis", T=value.dtype, to_last=to_last), [value])[0]
