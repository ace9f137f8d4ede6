"""Handler scopes: `with h:`, `oh.handler(...)`, `oh.handler_of(t)` and `tf.device` inside.

Opening a scope merges handlers onto the current stack (the scope entered last sees an op
first) and places ops on the dispatcher device, so TensorFlow hands every op to us.
Re-entering a stack (`with oh.handler(oh.handler_of(t)):`) re-opens its handlers in their
original order, skipping those already open (RFC "Re-entering a merged handler stack").
Inside a scope, `tf.device(...)` does not leave the handlers: the physical placement it
names accumulates at the bottom of the stack (RFC "Final handlers").
"""
import contextlib
import threading

import tensorflow as tf
from tensorflow.python.eager import context as _context
from tensorflow.python.framework import device_spec as _device_spec

import tf_ophandlers._C as _C
from tf_ophandlers.core import cache as _cache
from tf_ophandlers.core import dispatch as _dispatch
from tf_ophandlers.core import errors
from tf_ophandlers.core import handler as _handler
from tf_ophandlers.core import skip_trace
from tf_ophandlers.core import traceback_switch
from tf_ophandlers.core import tf_patches
from tf_ophandlers.core.dispatch import DISPATCHER_DEVICE
from tf_ophandlers.core.handler import OpHandler
from tf_ophandlers.core.stack import (  # noqa: F401  (current_stack: public here too)
    PHYSICAL, HandlerStack, Stack, current_stack, stack_of)
from tf_ophandlers.core.state import state

_original_context_device = _context.Context.device
# Handlers declaring `one_thread_at_a_time` with a scope open: id -> [handler, thread
# ident, open scopes]. An entry lives only while a scope is open (the handler is held
# that long anyway, by the thread's stack).
_owners = {}
_owners_lock = threading.Lock()


def _claim(handlers):
    """Records this thread's new scope of each handler of `handlers` that serves one
    thread at a time; raises HandlerError, claiming none, if another thread has one open."""
    mine = threading.get_ident()
    claim = [h for h in handlers if h.one_thread_at_a_time]
    if not claim:
        return
    with _owners_lock:
        for h in claim:
            owner = _owners.get(id(h))
            if owner is not None and owner[1] != mine:
                raise errors.HandlerError(
                    "tf_ophandlers: %s keeps the state of its open scope on the instance and "
                    "has a scope open on another thread; open it on one thread at a time, "
                    "or give each thread its own instance" % _describe(h))
        for h in claim:
            owner = _owners.setdefault(id(h), [h, mine, 0])
            owner[2] += 1


def _release(handlers):
    """Undoes `_claim` for `handlers` (a scope of theirs closed on this thread)."""
    claim = [h for h in handlers if h.one_thread_at_a_time]
    if not claim:
        return
    with _owners_lock:
        for h in claim:
            owner = _owners.get(id(h))
            if owner is not None and owner[0] is h:
                owner[2] -= 1
                if owner[2] <= 0:
                    del _owners[id(h)]
_stacks_by_name = _cache.WeakRegistry()
_merged_devices = _cache.BoundedCache("scope.merged_devices", 1024)


class _Scope:
    """One open handler scope of a thread (an entry of `state.scopes`)."""

    __slots__ = ("target", "previous", "device_scope", "opened", "depth", "traced",
                 "stack", "graph", "traceback_set")

    def __init__(self, target, depth):
        self.target = target        # what opened it: a handler or a stack
        self.depth = depth          # len(state.frames) when it opened
        self.previous = None        # eager: the stack current before it
        self.device_scope = None    # eager: the dispatcher device scope it entered
        self.opened = []            # eager: handlers it merged (scope_entered called)
        self.traced = None          # traced: TensorFlow's attribute scope
        self.stack = None           # the stack it placed ops on
        self.graph = None           # traced: the FuncGraph
        self.traceback_set = False  # eager: it set the traceback switch (traceback_switch)


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


def _open_traced(target):
    """A scope opened while a function is traced (RFC "delayed processing").

    The ops created in the scope are annotated with the stack's name (node attr
    ``_oh_stack``), and the function captures a *token* tensor of the stack, so that a
    call of the function reaches the stack by type-based dispatch and is replayed
    (core/functions): the annotated nodes then run on the handlers, merged onto the
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
        if h.replays_functions is not True:  # False, or decided per call
            raise errors.HandlerError(
                "tf_ophandlers: %s cannot be opened inside a function being traced: it "
                "takes function calls whole. Open it around the call of the function "
                "instead." % h.debug_string())
    traced = [e for e in state.scopes if e.traced is not None and e.graph is graph]
    stack = traced[-1].stack if traced else PHYSICAL
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
    entry = _Scope(target, len(state.frames))
    entry.traced, entry.stack, entry.graph = attr_scope, stack, graph
    state.scopes.append(entry)
    return entry


def stack_named(name):
    """The stack called `name` (a traced scope's annotation), or None."""
    return _stacks_by_name.get(name)


def _open(target):
    """Opens a scope for an OpHandler or a stack; returns its entry (for `_close`)."""
    handlers = _handlers_of(target)  # a bad target raises before anything starts
    _dispatch.initialize()  # the dispatcher device and runtime patches, on first use
    if not tf.executing_eagerly():
        return _open_traced(target)
    previous = state.current
    stack = previous
    opened = []
    for h in handlers:
        if not any(h is x for x in stack.handlers):
            stack = HandlerStack.merged(h, stack)
            _stacks_by_name[stack.name] = stack
            opened.append(stack.handler)
    _claim(opened)  # before anything changes: a refusal leaves the thread as it was
    entry = _Scope(target, len(state.frames))
    entry.previous, entry.stack = previous, stack
    ctx = _context.context()
    if stack is not previous and ctx.device_name != DISPATCHER_DEVICE:
        entry.device_scope = _original_context_device(ctx, DISPATCHER_DEVICE)
        entry.device_scope.__enter__()
        skip_trace.acquire()  # while ops go to the dispatcher (core/skip_trace.py)
        entry.traceback_set = traceback_switch.set_default()  # (core/traceback_switch.py)
    state.scopes.append(entry)
    state.current = stack
    for i, h in enumerate(opened):
        try:
            h.scope_entered()
        except BaseException:
            # A scope whose handler refused to open is not left open: the handlers
            # already told hear of the exit (their errors give way to this one), and
            # the thread's scopes and stack are as before, whatever the hook left open.
            _release(opened)
            _abandon(entry, opened[:i])
            raise
    entry.opened = opened
    return entry


def _abandon(entry, opened):
    """Undoes `_open` of `entry` after a failed `scope_entered`: drops it and any scope a
    hook opened above it, tells `opened` of the exit (ignoring their errors), restores
    the thread's stack and device scope."""
    scopes = state.scopes
    while scopes and any(e is entry for e in scopes):
        scopes.pop()
    state.current = entry.previous
    _C.nogil_forget()  # the C no-GIL path's hold on a stack ends with its scope
    try:
        for h in reversed(opened):
            try:
                h.scope_exited()
            except BaseException:  # pylint: disable=broad-except
                pass
    finally:
        if entry.device_scope is not None:
            entry.device_scope.__exit__(None, None, None)
            skip_trace.release()
            traceback_switch.restore(entry.traceback_set)


def _close(entry):
    """Closes the scope `entry`, which must be the innermost open scope of this thread,
    opened outside the hooks now running; otherwise raises and changes nothing."""
    scopes = state.scopes
    if not scopes or scopes[-1] is not entry:
        what = _describe(entry.target)
        if not any(e is entry for e in scopes):
            raise errors.HandlerError(
                "tf_ophandlers: the scope of %s is not open on this thread (closed twice, "
                "or never opened)" % what)
        raise errors.HandlerError(
            "tf_ophandlers: cannot close the scope of %s while the scope of %s, opened "
            "inside it, is still open; close scopes in reverse order" % (
                what, _describe(scopes[-1].target)))
    if len(state.frames) != entry.depth:
        raise errors.HandlerError(
            "tf_ophandlers: the scope of %s was opened outside the handler hook now "
            "running and cannot be closed inside it" % _describe(entry.target))
    scopes.pop()
    if entry.traced is not None:
        entry.traced.__exit__(None, None, None)
        return
    state.current = entry.previous
    _C.nogil_forget()  # the C no-GIL path's hold on a stack ends with its scope
    _release(entry.opened)
    try:
        error = None
        for h in reversed(entry.opened):
            try:
                h.scope_exited()
            except BaseException as e:  # pylint: disable=broad-except
                # Every handler hears of the exit, then the first error is raised (an
                # asynchronous or lazy handler's pending error surfaces here).
                error = error or e
        if error is not None:
            raise error
    finally:
        if entry.device_scope is not None:
            entry.device_scope.__exit__(None, None, None)
            skip_trace.release()
            traceback_switch.restore(entry.traceback_set)
        _purge_tensor_caches()
        _C.drain()


def is_open(target):
    """Whether a scope opened by `target` (a handler or a stack) is open on this thread."""
    return any(e.target is target for e in state.scopes)


def _describe(target):
    return target.debug_string() if isinstance(target, OpHandler) else repr(target)


def enter(target):
    """Opens a scope for an OpHandler or a stack; returns the stack it places ops on.
    Pair with `exit(target)`."""
    return _open(target).stack


def exit(target):  # pylint: disable=redefined-builtin
    """Closes the innermost scope `target` opened on this thread (`with h:` exits).

    Raises `oh.HandlerError`, leaving every scope as it was, if that scope is not the
    innermost one, was opened outside the running hook, or is not open at all.
    """
    for entry in reversed(state.scopes):
        if entry.target is target:
            return _close(entry)
    raise errors.HandlerError(
        "tf_ophandlers: the scope of %s is not open on this thread (closed twice, or "
        "never opened)" % _describe(target))


_handler.set_scope_functions(enter, exit)


@contextlib.contextmanager
def handler(target):
    """Scope placing ops on `target`: an OpHandler, a stack from `handler_of`, or None.

    >>> with oh.OpHandler():
    ...     y = tf.constant(1.) + 1.
    >>> with oh.handler(oh.handler_of(y)):   # run more ops where y was computed
    ...     z = y * 2.
    """
    entry = _open(target)
    try:
        yield entry.stack
    finally:
        _close(entry)


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


def original_device_scope(name):
    """TensorFlow's own device scope for `name` (what `tf.device` was before the
    "Context.device" patch): places ops on the dispatcher without the scope logic."""
    return _original_context_device(_context.context(), name)


def handler_of(tensor):
    """The handler stack `tensor` lives on, or None for an ordinary tensor.

    Examples:
        >>> h = oh.OpHandler()
        >>> with h:
        ...     y = tf.constant([1.0]) * 2.0
        >>> oh.handler_of(y).handler is h, oh.handler_of(tf.constant(1.0))
        (True, None)
    """
    if hasattr(tensor, "handle") and not isinstance(tensor, tf.Tensor):
        tensor = tensor.handle  # a variable: the stack of its resource handle
    return stack_of(tensor)


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


def _wrap_context_device(original):
    global _original_context_device  # pylint: disable=global-statement
    _original_context_device = original
    return _context_device


tf_patches.subscribe("Context.device", "Context.device", _wrap_context_device)


