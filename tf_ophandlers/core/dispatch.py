"""The dispatcher: entry points called by the C++ callbacks (cc/boundary/device.cc, cc/boundary/handler_tensor.cc).

`execute` applies the RFC placement policy: an op placed by a handler scope runs on the
current stack; an op reaching the device by type-based dispatch runs on the stack of its
handler inputs, which must be related (one stack containing the others); inputs from
unrelated stacks are an error naming both stacks and the op.
"""
import operator
import re
import threading

import tensorflow as tf
from tensorflow.python import pywrap_tfe as _pywrap_tfe
from tensorflow.python.eager import context as _context

import tf_ophandlers._C as _C
from tf_ophandlers.core import cache as _cache
from tf_ophandlers.core import errors
from tf_ophandlers.core import registries
from tf_ophandlers.core import tf_patches
from tf_ophandlers.core.op import Op
from tf_ophandlers.core.stack import PHYSICAL
from tf_ophandlers.core.state import register_runtime_start, state

DISPATCHER_DEVICE = "/job:localhost/replica:0/task:0/device:OPHANDLER:0"
"""The one custom device every handler tensor lives on (DESIGN.md decision 1).

Examples:
    >>> oh.DISPATCHER_DEVICE
    '/job:localhost/replica:0/task:0/device:OPHANDLER:0'
"""


def _stack_for(op, inputs):
    """Type-based dispatch: the stack of the op's handler inputs."""
    stacks = []
    released = False
    for t in inputs:
        s = _C.stack_of(t)
        if s is not None and s._releases:  # pylint: disable=protected-access
            s = _unreleased(s)
            released = released or s is PHYSICAL
        if s is not None and s is not PHYSICAL and not any(s is x for x in stacks):
            stacks.append(s)
    if len(stacks) == 1:
        return stacks[0]
    if not stacks:
        return PHYSICAL if released else state.current
    best = max(stacks, key=lambda s: len(s.handlers))
    if all(best.contains(s) for s in stacks):
        return best
    others = [s for s in stacks if not best.contains(s)]
    raise errors.PlacementError(
        "tf_ophandlers: op %s has inputs on two unrelated handler stacks, %r and %r; "
        "copy one of them off its stack or run the op inside a scope of one of them "
        "(with oh.handler(...))" % (op.type, best, others[0]))


def _unreleased(stack):
    """`stack` without the handlers on its top that released their values (a closed
    tape: OpHandler.values_released); PHYSICAL when all did."""
    while stack is not PHYSICAL and stack._releases and stack.handler.values_released():  # pylint: disable=protected-access
        stack = stack.next
    return stack


def execute(op, inputs):
    if op.type == "_EagerConst":
        # TensorFlow's way of placing a Python constant on the current device; the result
        # goes into its C++ scalar cache keyed by device name. Constants therefore stay
        # physical (as in copy_to_device below) and are copied on where they are used.
        # Tracing handlers ask `is_python_constant` (constants of a trace, not inputs).
        t = inputs[0]
        if t._shape_tuple() == ():  # pylint: disable=protected-access
            # TensorFlow's scalar cache holds this handle (later uses of the same Python
            # scalar never reach the dispatcher again), so the key, kept with the value,
            # is enough: no tensor is held. (Bounded for a loop converting ever new floats.)
            _python_scalars[_C.tensor_key(t)] = _scalar_identity(t)
        elif _collectors[0]:
            # Converted at each use and read at once by the op that uses it; held only
            # while a scope that asks is open (`collect_python_constants`).
            _python_constants[_C.tensor_key(t)] = t
        return inputs
    if op.requested_device == DISPATCHER_DEVICE and (state.current is not PHYSICAL
                                                     or state.frames):
        stack = state.current  # scope placement (or a hook's ops, placed on its next)
        state.scope_placed = True
    else:
        state.scope_placed = False
        # Type-based dispatch; also for code that re-places an op on a handler tensor's
        # device outside any scope (TensorFlow's variable deleter does
        # `with tf.device(handle.device)`).
        stack = _stack_for(op, inputs)
    return stack.execute(op, inputs)


# Python constants created under handler scopes, for tracing handlers (constants of a
# trace, not inputs). Scalars: key -> (dtype, value), for every scalar (TensorFlow's
# scalar cache keeps their handles alive, so a key stays that constant's while listed,
# and a clear of that cache forgets them all: patch "TFE_ClearScalarCache"; the value
# is checked again on lookup). Other constants: key -> tensor, only while a
# scope that asks for them is open, and forgotten when the last one closes, so user
# tensors are not kept alive after it.
_python_scalars = _cache.BoundedCache("dispatch.python_scalars", 16384)
_python_constants = _cache.BoundedCache("dispatch.python_constants", 4096)
_collectors = [0]  # open scopes asking for non-scalar constants (collect_python_constants)


def _forget_python_scalars():
    _python_scalars.clear()


def _wrap_scalar_cache_clear(original):
    # Every clear of TensorFlow's scalar cache (Context._clear_caches, _reset_context)
    # goes through this module attribute.
    def clear_scalar_cache():
        _forget_python_scalars()
        return original()

    return clear_scalar_cache


tf_patches.subscribe("pywrap_tfe.TFE_ClearScalarCache", "TFE_ClearScalarCache",
                     _wrap_scalar_cache_clear)


def _scalar_identity(t):
    value = t.numpy()  # (a string scalar's is bytes, a number's a numpy scalar)
    return (t._datatype_enum(), value.item() if hasattr(value, "item") else value)  # pylint: disable=protected-access


def collect_python_constants(delta):
    """A tracing handler's scope that asks `is_python_constant` about non-scalar
    constants opens (+1) or closes (-1); the last close forgets them."""
    _collectors[0] += delta
    if _collectors[0] <= 0:
        _collectors[0] = 0
        _python_constants.clear()


def is_python_constant(tensor):
    """Whether `tensor` is a Python constant TensorFlow converted under a handler scope
    (non-scalars: while a `collect_python_constants` scope is open)."""
    key = _C.tensor_key(tensor)
    known = _python_scalars.get(key)
    if known is not None:
        try:
            return tensor._shape_tuple() == () and _scalar_identity(tensor) == known  # pylint: disable=protected-access
        except Exception:  # pylint: disable=broad-except  (a value that cannot be read)
            return False
    return key in _python_constants


def copy_to_device(tensor):
    # TensorFlow calls this to create constants under a handler scope. They stay
    # physical: a handler copies them on when an op uses them, and TensorFlow's scalar
    # cache then never holds a handler tensor of a stack that is gone.
    return tensor


def copy_from_device(tensor, device):
    stack = _C.stack_of(tensor)
    return stack.copy_off(tensor, device)


_MAX_RANK = 254  # TensorFlow's TensorShape limit (cc/boundary/handler_tensor.h kMaxRank)
_INT64_LIMIT = 2 ** 63


def _hook_int(stack, hook, op_type, result, what):
    """`result` of a shape hook as an int, or a HandlerOutputError naming the hook."""
    if type(result) is int:  # the common case, first
        return result
    if not isinstance(result, bool):
        try:
            return operator.index(result)
        except TypeError:
            pass
    raise errors.hook_output_error(
        stack, hook, op_type,
        "%s of type %s (%s)" % (_safe_repr(result), type(result).__name__, what))


def num_dims(stack, value, op_type=None):
    handler = stack.handler
    value_shape = getattr(handler, "value_shape", None)
    if value_shape is not None:
        # A handler that answers the whole shape at once (oh.vectorized_map): the C++
        # side answers the `dim` queries that follow from it (cc/boundary/handler_tensor.cc),
        # instead of a hook call per axis. Anything but ints >= -1 (None: -1) takes the
        # per-axis hooks, which report it.
        shape = _whole_shape(value_shape(value))
        if shape is not None:
            if -1 in shape and not _tape_set_is_empty():
                raise _unknown_axis_under_tf_tape(stack, shape.index(-1), op_type)
            return shape
    rank = _hook_int(stack, "num_dims", op_type, handler.num_dims(value),
                     "a rank is an int from 0 to %d" % _MAX_RANK)
    if rank < 0:
        # TensorFlow's eager tensors always have a rank (a negative one would reach Python
        # as a SystemError from its shape accessor): say what is missing instead.
        raise ValueError(
            "tf_ophandlers: %s cannot tell the rank of this tensor (num_dims returned %d); "
            "eager tensors need a known rank" % (handler.debug_string(), rank))
    if rank > _MAX_RANK:
        raise errors.hook_output_error(
            stack, "num_dims", op_type,
            "%d (a rank is an int from 0 to %d)" % (rank, _MAX_RANK))
    return rank


def _whole_shape(shape):
    """`shape` (from `value_shape`) as a tuple of ints (-1 for unknown), or None when it
    is not a known-rank shape of valid axis lengths."""
    if type(shape) is not tuple or len(shape) > _MAX_RANK:
        return None
    if None in shape:
        shape = tuple(-1 if d is None else d for d in shape)
    for d in shape:
        if type(d) is not int or d < -1 or d >= _INT64_LIMIT:
            return None
    return shape


def dim(stack, value, index, op_type=None):
    length = stack.handler.dim(value, index)
    if type(length) is not int:
        length = _hook_int(stack, "dim", op_type, length,
                           "an axis length is an int, -1 when unknown")
    if length < -1 or length >= _INT64_LIMIT:
        raise errors.hook_output_error(
            stack, "dim", op_type,
            "%d for axis %d (an axis length is an int >= 0, or -1 when unknown)"
            % (length, index))
    if length == -1 and not _tape_set_is_empty():
        raise _unknown_axis_under_tf_tape(stack, index, op_type)
    return length


_tape_set_is_empty = _pywrap_tfe.TFE_Py_TapeSetIsEmpty


def _unknown_axis_under_tf_tape(stack, index, op_type):
    """The error for an unknown axis length asked while TensorFlow's own tape or
    accumulator records: its C++ tape keeps every recorded output's full shape and
    aborts the process on an unknown length (tensor_shape.cc "Check failed: size >= 0").
    An error here reaches the user from the op (or the `.shape` query) instead."""
    return ValueError(
        "%s: axis %d of a tensor%s has no single length (e.g. the components of a "
        "multi-device handler's tensor have different shapes), and a tf.GradientTape or "
        "tf.autodiff.ForwardAccumulator is recording: TensorFlow's tape needs every "
        "axis length of what it records. Use %s / %s "
        "(they keep per-handler shapes), or make the shapes equal (e.g. a batch that "
        "splits evenly)" % (stack.handler.debug_string(), index,
                            " (output of op %s)" % op_type if op_type else "",
                            registries.tape_name("reverse"), registries.tape_name("forward")))


def summarize(stack, value):
    text = stack.handler.tensor_debug_string(value)
    if not isinstance(text, str):
        raise errors.hook_output_error(
            stack, "tensor_debug_string", None,
            "%s of type %s (it must return a str)" % (_safe_repr(text), type(text).__name__))
    return text


def _safe_repr(obj):
    try:
        return repr(obj)[:200]
    except Exception:  # pylint: disable=broad-except
        return "<unprintable>"


def output_error(op, kind, detail, outputs):
    """Message for outputs the C++ boundary rejected (count or dtype mismatch)."""
    stack = next((s for s in map(_C.stack_of, outputs or ()) if s is not None), None)
    detail = re.sub(r"dtype enum (\d+)", lambda m: tf.dtypes.as_dtype(int(m.group(1))).name, detail)
    exc = errors.invalid_outputs(stack, op, kind, detail)
    return errors.stash_error(exc)[1]


# The eager context the runtime runs in (None before the first scope). Tests and some
# programs replace TensorFlow's context (context._reset_context, e.g. to configure devices
# anew): the runtime then moves to the new one when it is next started. Holding the
# context keeps its TFE_Context alive while the C++ side still points at it.
_runtime_context = None
_init_lock = threading.Lock()


def initialize():
    """Starts the runtime on first use (the first handler scope), not at import: it
    initializes TensorFlow's eager context (after which devices can no longer be
    configured), registers the dispatcher device and installs the runtime patches.
    After the context was replaced, it registers the device in the new one."""
    global _runtime_context
    ctx = _context.context()
    if ctx is _runtime_context:
        return
    with _init_lock:
        if ctx is _runtime_context:
            return
        ctx.ensure_initialized()
        if _runtime_context is None:
            _C.init(ctx._handle, DISPATCHER_DEVICE, Op, execute, copy_to_device,  # pylint: disable=protected-access
                    copy_from_device, errors.stash_error, num_dims, dim, summarize,
                    output_error)
            tf_patches.install_runtime()
        else:
            _C.context_changed(ctx._handle)  # pylint: disable=protected-access
            _cache.clear_all()
        _runtime_context = ctx


register_runtime_start(initialize)

