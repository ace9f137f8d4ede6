"""Handler scopes: `with h:`, `oh.handler(...)`, `oh.handler_of(t)` and `tf.device` inside.

Opening a scope merges handlers onto the current stack (the scope entered last sees an op
first) and places ops on the dispatcher device, so TensorFlow hands every op to us.
Re-entering a stack (`with oh.handler(oh.handler_of(t)):`) re-opens its handlers in their
original order, skipping those already open (RFC "Re-entering a merged handler stack").
Inside a scope, `tf.device(...)` does not leave the handlers: the physical placement it
names accumulates at the bottom of the stack (RFC "Final handlers").
"""
import contextlib
import weakref

import tensorflow as tf
from tensorflow.python.eager import context as _context
from tensorflow.python.framework import device_spec as _device_spec

from tf_ophandlers import _C
from tf_ophandlers.core import errors
from tf_ophandlers.core.handler import OpHandler
from tf_ophandlers.core.stack import PHYSICAL, HandlerStack, Stack, stack_of
from tf_ophandlers.core.state import state

DISPATCHER_DEVICE = "/job:localhost/replica:0/task:0/device:OPHANDLER:0"

_original_context_device = _context.Context.device
_stacks_by_name = weakref.WeakValueDictionary()
_merged_devices = {}


def _handlers_of(target):
    if isinstance(target, OpHandler):
        return (target,)
    if isinstance(target, Stack):
        return target.handlers
    if target is None:
        return ()
    raise TypeError("tf_ophandlers.handler: expected an OpHandler, a handler stack "
                    "(oh.handler_of(t)) or None, got %r" % (target,))


def enter(target):
    """Opens a scope for an OpHandler or a stack; pair with `exit()`."""
    if not tf.executing_eagerly():
        raise errors.HandlerError(
            "tf_ophandlers: opening a handler scope while tracing a tf.function is not "
            "supported yet; open it around the function call instead (ops inside would "
            "otherwise silently run on CPU).")
    previous = state.current
    stack = previous
    opened = []
    for h in _handlers_of(target):
        if not any(h is x for x in stack.handlers):
            stack = HandlerStack.merged(h, stack)
            _stacks_by_name[stack.name] = stack
            opened.append(stack.handler)
    ctx = _context.context()
    device_scope = None
    if stack is not previous and ctx.device_name != DISPATCHER_DEVICE:
        device_scope = _original_context_device(ctx, DISPATCHER_DEVICE)
        device_scope.__enter__()
    state.scopes.append((previous, device_scope, opened))
    state.current = stack
    for h in opened:
        h.scope_entered()
    return stack


def exit():  # pylint: disable=redefined-builtin
    previous, device_scope, opened = state.scopes.pop()
    state.current = previous
    for h in reversed(opened):
        h.scope_exited()
    if device_scope is not None:
        device_scope.__exit__(None, None, None)
    _purge_tensor_caches()
    _C.drain()


@contextlib.contextmanager
def handler(target):
    """Scope placing ops on `target`: an OpHandler, a stack from `handler_of`, or None.

    >>> with oh.handler(oh.handler_of(y)):   # run more ops where y was computed
    ...     z = y * 2.
    """
    stack = enter(target)
    try:
        yield stack
    finally:
        exit()


@contextlib.contextmanager
def physical():
    """Runs ops on TensorFlow's devices, outside every handler scope, for a while.

    For handler methods that run plain TensorFlow code from user code (not from a hook),
    e.g. a parallel handler's collective function call.
    """
    saved = state.current
    state.current = PHYSICAL
    device_scope = _original_context_device(_context.context(), None)
    device_scope.__enter__()
    try:
        yield
    finally:
        device_scope.__exit__(None, None, None)
        state.current = saved


def handler_of(tensor):
    """The handler stack `tensor` lives on, or None for an ordinary tensor."""
    if hasattr(tensor, "handle") and not isinstance(tensor, tf.Tensor):
        tensor = tensor.handle  # a variable: the stack of its resource handle
    return stack_of(tensor)


def current_stack():
    """The stack ops are placed on right now (PHYSICAL outside every scope)."""
    return state.current


def _purge_tensor_caches():
    """Drops handler tensors from TensorFlow's per-device tensor caches.

    Gradient code caches zeros/ones per device name, and every handler stack shares the
    dispatcher's name: a cached handler tensor would leak into the next scope and keep
    its stack alive (DESIGN.md: the scalar cache).
    """
    ctx = _context.context()
    for cache in (ctx.zeros_cache(), ctx.ones_rank_cache()):
        data = getattr(cache, "_data", None)
        if data:
            for key in [k for k, v in data.items() if _C.stack_of(v) is not None]:
                del data[key]


class _PhysicalPlacement:
    """`tf.device(name)` inside a handler scope: sets the bottom's physical device."""

    __slots__ = ("_name", "_saved")

    def __init__(self, name):
        self._name = name

    def __enter__(self):
        self._saved = state.device
        name = self._name
        if name is None:
            state.device = ""
        elif name:
            key = (state.device, name)
            merged = _merged_devices.get(key)
            if merged is None:
                spec = _device_spec.DeviceSpecV2.from_string(state.device or "")
                merged = spec.make_merged_spec(
                    _device_spec.DeviceSpecV2.from_string(name)).to_string()
                _merged_devices[key] = merged
            state.device = merged
        return self

    def __exit__(self, *exc_info):
        state.device = self._saved
        return False


def on_device(name):
    """Places the ops a hook runs on physical device `name`, below every handler (the
    `tf.device` of hooks, whose TensorFlow device scope is still the dispatcher's)."""
    return _PhysicalPlacement(name)


def _context_device(self, name):
    if hasattr(name, "to_string") and not isinstance(name, str):
        name = name.to_string()  # a DeviceSpec
    if isinstance(name, str) and name:
        # tf.device(stack_name) behaves as oh.handler(stack): a stack name is never a
        # physical device (it would silently run on CPU under soft placement).
        stack = _stacks_by_name.get(name)
        if stack is not None:
            return handler(stack)
    if state.current is not PHYSICAL and (name is None or isinstance(name, str)) \
            and name != DISPATCHER_DEVICE:
        return _PhysicalPlacement(name)
    return _original_context_device(self, name)


def install_device_scopes():
    _context.Context.device = _context_device


def install_tf_handler():
    """Makes `tf.handler` an alias of `oh.handler` (RFC spelling)."""
    tf.handler = handler
