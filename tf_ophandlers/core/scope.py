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


TRACED_STACK_ATTR = "_oh_stack"


def _enter_traced(target):
    """A scope opened while a function is traced (RFC "delayed processing").

    The ops created in the scope are annotated with the stack's name (node attr
    ``_oh_stack``), and the function captures a *token* tensor of the stack, so that a
    call of the function reaches the stack by type-based dispatch and is replayed
    (core/replay.py): the annotated nodes then run on the handlers, merged onto the
    stack the call runs on. The handlers see the ops when the function is called, not
    while it is traced.
    """
    from tensorflow.core.framework import attr_value_pb2  # pylint: disable=import-outside-toplevel
    from tensorflow.python.framework import func_graph  # pylint: disable=import-outside-toplevel
    from tensorflow.python.framework import ops  # pylint: disable=import-outside-toplevel
    graph = ops.get_default_graph()
    handlers = _handlers_of(target)
    if not isinstance(graph, func_graph.FuncGraph):
        raise errors.HandlerError(
            "tf_ophandlers: handler scopes need eager execution or a tf.function being "
            "traced; TF1 graph mode is not supported")
    for h in handlers:
        if not h.replays_functions:
            raise errors.HandlerError(
                "tf_ophandlers: %s cannot be opened inside a function being traced: it "
                "takes function calls whole. Open it around the call of the function "
                "instead." % h.debug_string())
    traced = [e for e in state.scopes if e[0] == "traced" and e[3] is graph]
    stack = traced[-1][2] if traced else PHYSICAL
    for h in handlers:
        if not any(h is x for x in stack.handlers):
            stack = HandlerStack.merged(h, stack)
            _stacks_by_name[stack.name] = stack
    with ops.init_scope():
        # Larger than TensorFlow's limit for capturing eager tensors as constants.
        token = stack.copy_on(tf.zeros([129], tf.int8))
    graph.capture(token)
    attr_scope = graph._attr_scope(  # pylint: disable=protected-access
        {TRACED_STACK_ATTR: attr_value_pb2.AttrValue(s=stack.name.encode())})
    attr_scope.__enter__()
    state.scopes.append(("traced", attr_scope, stack, graph))
    return stack


def stack_named(name):
    """The stack called `name` (a traced scope's annotation), or None."""
    return _stacks_by_name.get(name)


def enter(target):
    """Opens a scope for an OpHandler or a stack; pair with `exit()`."""
    if not tf.executing_eagerly():
        return _enter_traced(target)
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
    entry = state.scopes.pop()
    if entry[0] == "traced":
        entry[1].__exit__(None, None, None)
        return
    previous, device_scope, opened = entry
    state.current = previous
    try:
        error = None
        for h in reversed(opened):
            try:
                h.scope_exited()
            except BaseException as e:  # pylint: disable=broad-except
                # Every handler hears of the exit, then the first error is raised (an
                # asynchronous or lazy handler's pending error surfaces here).
                error = error or e
        if error is not None:
            raise error
    finally:
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
