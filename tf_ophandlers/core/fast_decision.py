"""The C++ per-op path's decisions (cc/fast/fast_path.h), as the stacks declare them.

For each (stack, op type) the C++ path asks once how it may run ops of that type placed
on the stack: forward them without a Python frame, call a native handler, call the
Python execute hook with unwrap/copy-on/wrap done in C, record for a tape in C, or take
the whole Python path (`HandlerStack.execute`). `fast_decision` answers;
`fast_signature` canonicalizes what the answer depends on, so stacks of equal
declarations share decisions. Kept apart from core/stack.py, which only calls them.
"""
import os
import types

import tf_ophandlers._C as _C
from tf_ophandlers.core.cache import BoundedCache, register_external_cache

COPY_OPS = frozenset(("CopyOn", "CopyOff", "CopyOnGrad", "CopyOffGrad"))
"""The copy ops of the RFC (cc/kernels/copy_ops.cc). A stack runs them through its handler's
copy hooks unless the handler takes them in `execute` (`OpHandler.handles_copy`).

Examples:
    >>> sorted(oh.COPY_OPS)
    ['CopyOff', 'CopyOffGrad', 'CopyOn', 'CopyOnGrad']
"""

register_external_cache(
    "fast_path.decisions", lambda: (_C.fast_stats()["entries"], _C.fast_stats()["maxsize"]))
register_external_cache(
    "fast_path.shared_decisions",
    lambda: (_C.fast_stats()["shared_entries"], _C.fast_stats()["shared_maxsize"]))

# The canonical object of each declaration signature (fast_signature below): C++
# keys the decisions it shares between stacks by this object's identity (holding a
# reference), so equal declarations must map to one object.
_fast_signatures = BoundedCache("fast_path.signatures", 1024)

#: ``OH_FAST_PATH=0`` in the environment: every op placed on a Python handler's stack
#: takes the Python path (`HandlerStack.execute`), the reference that the C paths must
#: agree with (DESIGN.md decision 9); CI runs the differential tests both ways. C/C++
#: handlers keep their native path (there is no Python one to compare with).
C_PATHS = os.environ.get("OH_FAST_PATH", "1") != "0"

#: Kinds of the C++ per-op path's decision for an op type on a stack (cc/fast/fast_path.h):
#: the Python path; forward to the next stack; a C/C++ handler; the Python execute hook
#: called from C; forward, then the handler's ``after_execute``; the handler's execute
#: implemented in C (registered through the fast path's hook slot,
#: cc/fast/handler_hooks.h), else as FAST_HOOK.
(FAST_PYTHON, FAST_FORWARD, FAST_NATIVE, FAST_HOOK, FAST_AFTER_EXECUTE,
 FAST_PLUGIN) = 0, 1, 2, 3, 4, 5


def takes_copy(handler, op):
    """Whether `handler` takes copy op `op` in `execute` like any op
    (`OpHandler.handles_copy`: True for every copy op, or a predicate)."""
    handles_copy = handler.handles_copy
    return handles_copy is True or (handles_copy is not None and bool(handles_copy(op)))


def physical_copy_of(handler):
    """The `physical_copy_on` the C++ path may call for `handler` instead of its
    `copy_on` (read from the stack as `_physical_copy_on`), or None: the one that
    `handler`'s `copy_on` comes with. The instance, then its classes from the most
    derived: the first to set `copy_on` or `physical_copy_on` decides, and one that
    sets `copy_on` alone gets None (its copy_on would be skipped for physical inputs)."""
    own = getattr(handler, "__dict__", None) or {}
    if "physical_copy_on" in own:
        return own["physical_copy_on"]
    if "copy_on" in own:
        return None
    for cls in type(handler).__mro__:
        defined = cls.__dict__
        if "physical_copy_on" in defined:
            return getattr(handler, "physical_copy_on", None)
        if "copy_on" in defined:
            return None
    return None


def needs_no_python_kernel(op_type):
    """Whether ops of `op_type` run no Python inside their kernel (tf.py_function's do;
    the C++ fast path never takes them either)."""
    return "PyFunc" not in op_type


def never_copy(op, index):  # pylint: disable=unused-argument
    """``needs_copy = staticmethod(never_copy)``: every input from elsewhere (a physical
    tensor, a constant) enters as it is, and the stack answers `wants_copy` in C, so the
    C++ per-op path makes no Python call per such input (`oh.Lazy`, `oh.Async`).

    Examples:
        >>> class Quiet(oh.OpHandler):
        ...     needs_copy = staticmethod(oh.never_copy)   # constants enter as they are
        >>> with Quiet():
        ...     y = tf.constant([1.0]) + 1.0
        >>> y.numpy().tolist()
        [2.0]
    """
    return False


def lazy_record_setup(value_type, node_type, sequence, sigs, dtypes, stateful):
    """Registers oh.Lazy's representation types (`__slots__` classes), its sequence
    counter and its caches with the C++ record path (FAST_PLUGIN,
    cc/handlers/lazy/fast_lazy.cc)."""
    _C.lazy_setup(value_type, node_type, sequence, sigs, dtypes, stateful)


#: ``lazy_plan(order, needed, specs, want_plan)``: oh.Lazy's pass over the pending nodes
#: of a value request; ``lazy_upstream(roots)``: those nodes; ``lazy_computed(order)``:
#: marks them computed (cc/handlers/lazy/fast_lazy_plan.cc; handlers/lazy/handler.py `Lazy._run`).
lazy_plan = _C.lazy_plan
lazy_upstream = _C.lazy_upstream
lazy_computed = _C.lazy_computed
#: ``skip_trace_setup(TFE_Py_FastPathExecute)`` and ``skip_trace_execute``: TensorFlow's
#: op fast path without its stack capture, while oh.Lazy is open (cc/fast/fast_trace.cc).
skip_trace_setup = _C.skip_trace_setup
skip_trace_execute = _C.skip_trace_execute


def handles_predicate(handler):
    """``handler.handles_ops`` as a predicate on op types, or None (every op)."""
    handles = handler.handles_ops
    if handles is None:
        return None
    if callable(handles):
        return handles
    if isinstance(handles, (str, bytes)):
        raise TypeError(
            "%s.handles_ops must be a collection of op types or a function "
            "op_type -> bool, not the string %r" % (handler.debug_string(), handles))
    return frozenset(handles).__contains__


def fast_signature(stack, handler):
    """Everything `fast_decision` reads besides the op type and `stack.next` (the handler's
    class, its default hooks, `handles_ops`, `returns_off_stack`, `after_execute`,
    `needs_copy`, `transient`, and whether copies defer to the stack below), as one
    canonical object: stacks with equal signatures get equal decisions, so C++
    shares them (a fresh handler per step asks Python once per op type, not once
    per step). None when the decision cannot be shared: a C/C++ handler (decided in
    C), or a `handles_ops` function that may read the instance (a bound method, a
    closure, any callable that is not a plain function)."""
    if isinstance(handler, _C.NativeHandlerBase):
        return None
    handles = handler.handles_ops
    if handles is not None:
        if callable(handles):
            if not (isinstance(handles, types.FunctionType) and handles.__closure__ is None):
                return None
        else:
            handles = stack._handles.__self__  # the frozenset handles_predicate built
    sig = (type(handler), stack._default_execute, stack._records, handles,
           stack._off_stack_ops if stack._off_stack_ops is not None else stack._off_stack,
           handler.needs_copy is None, stack._defer_copy, bool(handler.transient),
           stack.default_copy_on, handler.handles_copy is True)
    try:
        got = _fast_signatures.get(sig)
    except TypeError:  # an unhashable declaration: not shared
        return None
    if got is None:
        _fast_signatures[sig] = got = sig
    return got


def fast_decision(stack, op_type):
    """How the C++ per-op path (cc/fast/fast_path.h) may run ops of `op_type` placed on
    the stack: ``(kind, next, transient, default_copy_on, copy_all[, hook_objects])``.
    `kind` is FAST_FORWARD when the handler's execute is not called for the op type (so
    C++ unwraps, runs the op on `next` and wraps, as `HandlerStack.execute` does),
    FAST_NATIVE for a C/C++ handler, FAST_HOOK when the Python execute hook runs for it
    (C++ does `HandlerStack.execute`'s unwrap, copy-on and wrap around the hook, on the
    op's first stack), FAST_PYTHON otherwise. `copy_all`: every input that is not this
    stack's is copied on (no `needs_copy`, no deferral to the stack below).
    `default_copy_on`: a tensor that is not the stack's is moved to the next stack as it
    is (`move_onto`). `hook_objects`: a FAST_FORWARD type (outside `handles_ops`) whose
    ops with an input that is not a tensor (the handler's own object, which only its
    execute can take) run as FAST_HOOK would; given only when true (an extension
    built before it parses five items). Asked once per (stack, op type); the
    answer is cached in C++ until a stack is built, and shared with later stacks of the
    same `fast_signature` (so everything this reads besides `op_type` and `stack.next`
    must be in the signature)."""
    handler = stack.handler
    if isinstance(handler, _C.NativeHandlerBase):
        # (C++ decides these stacks itself: fast_decision.cc, the same rule.)
        kind = FAST_NATIVE if stack._runs_execute(op_type) else FAST_FORWARD
    elif not C_PATHS:
        return (FAST_PYTHON, stack.next, bool(handler.transient), stack.default_copy_on,
                handler.needs_copy is None and not stack._defer_copy)
    elif op_type in COPY_OPS:
        # A handler taking every copy op like any op (`handles_copy = True`, in the
        # signature) gets its hook called from C as for other ops; else the copy rules.
        kind = (FAST_HOOK if handler.handles_copy is True and stack._runs_execute(op_type)
                and not stack._records and not stack._off_stack else FAST_PYTHON)
    elif not stack._runs_execute(op_type):
        kind = FAST_FORWARD
    elif stack._records and not stack._off_stack and needs_no_python_kernel(op_type):
        kind = FAST_AFTER_EXECUTE
    elif not stack._off_stack or (stack._off_stack_ops is not None
                                 and op_type not in stack._off_stack_ops):
        # FAST_PLUGIN: the handler's execute has a C implementation (registered through
        # the hook slot, cc/fast/handler_hooks.h); the class declares it (its type is in
        # fast_signature), else the hook.
        kind = FAST_PLUGIN if getattr(type(handler), "_oh_records_in_c", False) else FAST_HOOK
    else:
        kind = FAST_PYTHON
    copy_all = handler.needs_copy is None and not stack._defer_copy
    # A forwarded type outside handles_ops whose op has an input that is not a tensor
    # (the handler's own object) goes to the execute hook (HandlerStack.execute): C++
    # runs it as FAST_HOOK when the type would take that path if handled.
    hook_objects = (kind == FAST_FORWARD and stack._handles is not None
                    and not isinstance(handler, _C.NativeHandlerBase)
                    and not stack._default_execute and not stack._records
                    and op_type not in COPY_OPS and (
                        not stack._off_stack or (stack._off_stack_ops is not None
                                                 and op_type not in stack._off_stack_ops)))
    decision = (kind, stack.next, bool(handler.transient), stack.default_copy_on, copy_all)
    return decision + (True,) if hook_objects else decision  # (C++: optional 6th item)


def async_hook_in_c(execute, op_kinds, implied, inferred, resource, valueless):
    """Lets the C++ path run `execute` (oh.Async's hook, handlers/async_execution.py) for
    its common case in C (cc/handlers/async_execution/fast_async.cc), from the hook's own tables: `op_kinds`
    (op type -> kind), `implied` (the kind whose signature needs no attributes),
    `inferred` (signature -> outputs' ``(part, dtype)``), `resource` (`tf.resource`) and
    `valueless` (dtype enums whose parts carry no value). The C path reads the tables
    and never fills them: a miss runs the hook, which does."""
    _C.async_setup(execute, op_kinds, implied, inferred, resource, valueless)
