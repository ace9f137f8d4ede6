"""Handler stacks: the merged handler states ops are placed on (RFC "Composition").

A `HandlerStack` is one handler merged onto the stack it executes on (`next`). Stacks are
linked toward the bottom, `PHYSICAL`, which runs ops on TensorFlow's devices. Opening
`with h:` inside stack S merges h onto S; the same (handler, S) pair always yields the
same stack object while it is alive, so tensors produced by two scopes of the same tape
at the same level are on one stack.

Each stack's public operations take and return ordinary tensors:
  execute(op, inputs)   -> outputs on this stack
  copy_on(tensor)       -> the tensor on this stack
  copy_off(tensor, dev) -> a physical tensor
Inputs that live elsewhere are copied on first (RFC placement policy); inputs already on
this stack are unwrapped to the handler's own representation.
"""
import inspect
import itertools
import operator
import types
import weakref

from tensorflow.python import pywrap_tfe

from tensorflow.python.eager import context as _context
from tensorflow.python.framework import dtypes as _dtypes
from tensorflow.python.framework.ops import EagerTensor as _EagerTensor
from tensorflow.python.framework.tensor import Tensor as _Tensor

import tf_ophandlers._C as _C
from tf_ophandlers.core import errors
from tf_ophandlers.core.cache import BoundedCache, WeakRegistry
from tf_ophandlers.core.op import Op
from tf_ophandlers.core.representation import (  # noqa: F401  (public via the stack)
    move_onto, payload, representation_of, stack_of)
from tf_ophandlers.core.fast_decision import (  # noqa: F401  (never_copy: public via the stack)
    COPY_OPS, fast_decision, fast_signature, handles_predicate, needs_no_python_kernel, never_copy,
    physical_copy_of, takes_copy)
from tf_ophandlers.core.state import register_bottom, start_runtime, state

_execute = _C.execute
_unwrap_inputs = _C.unwrap_inputs
_wrap_outputs = _C.wrap_outputs
_indices = {}  # handler type name -> itertools.count

_merges = WeakRegistry()  # (id(handler), id(next)) -> HandlerStack
_function_call_rule = [None]  # set by core/functions (register_function_call_rule)
_substitute_rule = [None]  # set by a handler module (register_substitute_rule)
_tape_set_is_empty = pywrap_tfe.TFE_Py_TapeSetIsEmpty


def register_function_call_rule(rule):
    """Installs ``rule(stack, op, inputs) -> outputs``, which runs a function call op
    (an op without an OpDef, e.g. ``__inference_f_12``) placed on a stack whose handler
    replays functions. core/functions/call.py registers the replay; the stacks know
    nothing else of it."""
    _function_call_rule[0] = rule


def register_substitute_rule(rule):
    """Installs ``rule(stack, op, values) -> outputs``, which runs the execute hook of
    `stack`'s handler for `op` when the handler may change what ops compute
    (`OpHandler.changes_computation`) and a TensorFlow tape or accumulator is recording:
    it returns what the hook returns and makes those tapes differentiate what the hook
    ran, not `op`'s registered gradient. handlers/substitutes.py registers it."""
    _substitute_rule[0] = rule


tensor_key = _C.tensor_key
"""``tensor_key(tensor)``: a tensor's identity key (its TensorFlow handle), stable while it
lives, for state keyed by tensors (a tape's tracked set); C, as it is on hot paths.

Examples:
    >>> x = tf.constant(1.0)
    >>> oh.tensor_key(x) == oh.tensor_key(x), oh.tensor_key(x) == oh.tensor_key(x + 0.0)
    (True, False)
"""


# Dtypes no Python scalar converts to (a variable's handle is a resource scalar).
_NO_PYTHON_SCALAR = frozenset((_dtypes.resource.as_datatype_enum, _dtypes.variant.as_datatype_enum))


def own_handle(tensor):
    """Gives `tensor` a TensorHandle of its own (a copy sharing its buffer) when it has
    TensorFlow's cached handle of a Python scalar; returns whether it did.

    TensorFlow hands equal Python scalars one cached handle (two ``tf.constant(3.0)``),
    so `tensor_key` cannot tell them apart, while TensorFlow's tape tells tensors apart
    by object. A handler keying tensors by handle calls this before it starts keying a
    tensor (a tape's `watch`). No handler keys a cached handle for one tensor (ops never
    return one), so no key of a tensor already keyed changes. The tensor keeps its
    value, dtype, shape, device and TensorFlow id."""
    if type(tensor) is not _EagerTensor or tensor._shape_tuple() != () or (  # pylint: disable=protected-access
            tensor._datatype_enum() in _NO_PYTHON_SCALAR) or (  # pylint: disable=protected-access
            not _C.handle_shared(tensor)):  # (a cached handle is shared: the cache holds it)
        return False
    start_runtime()  # (the C++ side needs its context)
    if not _scalar_cached(tensor):
        return False
    copy = _execute(Op.cached("Identity", T=tensor.dtype), [tensor], tensor.device)[0]
    return _C.swap_handles(tensor, copy)  # `copy` now holds the shared handle, and drops it


def _scalar_cached(tensor):
    """Whether `tensor` holds TensorFlow's cached handle of a Python scalar: the cache is
    keyed by the Python value (an int and a float are two keys), the dtype asked for
    (none, or the tensor's) and the device scope it was created under (none, the
    tensor's device, or the scope open now)."""
    value = tensor.numpy().item()
    values = [value]
    if isinstance(value, complex) and value.imag == 0:
        value = value.real
        values.append(value)
    if isinstance(value, float) and value.is_integer():
        values.append(int(value))
    names = {"", tensor.device, _context.context().device_name or ""}
    dtypes = (0, tensor.dtype.as_datatype_enum)  # (0: DT_INVALID, no dtype given)
    return any(_C.scalar_cached(tensor, v, d, name)
               for v in values for d in dtypes for name in names)


def current_stack():
    """The stack ops are placed on right now (PHYSICAL outside every scope; inside a
    hook, the hook's next stack).

    Examples:
        >>> h = oh.OpHandler()
        >>> with h:
        ...     print(oh.current_stack().handler is h)
        True
    """
    return state.current


def next_stack():
    """The stack the running hook executes on (O(1); `self.next` inside a hook). Ops a
    hook runs with ordinary TensorFlow calls are placed there too.

    Examples:
        >>> class Below(oh.OpHandler):
        ...     def execute(self, op, inputs):
        ...         assert oh.next_stack() is self.next
        ...         return self.next.execute(op, inputs)
        >>> with Below():
        ...     y = tf.constant(1.0) + 1.0
        >>> float(y)
        2.0
    """
    frames = state.frames
    if not frames:
        raise errors.HandlerError(
            "tf_ophandlers.next_stack() is only defined while a handler hook runs")
    return frames[-1].next


def run_deferred_above(handler):
    """Runs what the handlers above `handler` on this thread's current stack deferred
    (those with a `run_deferred()` method: oh.Lazy), innermost first. A handler about to
    change how it treats ops (a tape that pauses or resumes) calls it first, so that ops
    recorded before the change reach it as it was, not as it will be."""
    handlers = state.current.handlers
    for i in range(len(handlers) - 1, -1, -1):
        h = handlers[i]
        if h is handler:
            return
        run = getattr(h, "run_deferred", None)
        if run is not None:
            run()


def replays(handler, op):
    """Whether `handler` replays function call `op` (its `replays_functions`)."""
    replays = handler.replays_functions
    return replays if replays is True or replays is False else bool(replays(op))


def _not_a_list(handler, op, outputs):
    """The error for an `execute` hook that returned something other than a list."""
    if isinstance(outputs, (types.GeneratorType, types.CoroutineType)):
        outputs.close()  # never run later (nor warn "never awaited")
    return errors.HandlerOutputError(
        "%s.execute returned %s for op %s; it must return a list of outputs" % (
            handler.debug_string(),
            "None" if outputs is None else "a " + type(outputs).__name__, op.type))


class OffStack:
    """An output an `execute` hook returns as it is, instead of on the handler's stack.

    For handler-specific ops whose results leave the handler, such as a parallel
    handler's unpack (its components are ordinary tensors). Only handlers with
    ``returns_off_stack = True`` may return it.

    Examples:
        >>> class Splitter(oh.OpHandler):
        ...     returns_off_stack = True
        ...     def execute(self, op, inputs):
        ...         outputs = self.next.execute(op, inputs)
        ...         return [oh.OffStack(t) for t in outputs]   # leave the handler at once
        >>> with Splitter():
        ...     y = tf.constant(1.0) + 1.0
        >>> oh.handler_of(y) is None
        True
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor


class Stack:
    """Common interface of PHYSICAL and HandlerStack."""

    handler = None
    next = None
    handlers = ()  # handlers from the outermost (bottom) to this one
    _releases = False  # the handler declares values_released (read by type-based dispatch)
    _substituting = False  # a handler of the stack may change what ops compute

    def contains(self, other):
        """Whether `other`'s handlers appear in this stack in the same order."""
        mine = iter(self.handlers)
        return all(any(h is m for m in mine) for h in other.handlers)


class PhysicalStack(Stack):
    """The bottom of every stack: TensorFlow's physical devices."""

    name = ""

    def execute(self, op, inputs):
        if op.type in COPY_OPS:
            # On a physical device every copy op is the identity (cc/kernels/copy_ops.cc).
            return [self.copy_on(inputs[0])]
        mode = state.mode
        if mode is not None and mode.building():
            return mode.emit(op, inputs)
        # Handler tensors among `inputs` are copied off by the C++ boundary.
        return _execute(op, inputs, state.device)

    def copy_on(self, tensor):
        stack = stack_of(tensor)
        if stack is None:
            return tensor
        return stack.copy_off(tensor, state.device)

    def copy_off(self, tensor, device):
        return self.copy_on(tensor)

    def __repr__(self):
        return "PHYSICAL"


PHYSICAL = PhysicalStack()
"""The bottom of every stack: TensorFlow's own devices (the RFC's final handlers).

Examples:
    >>> oh.current_stack() is oh.PHYSICAL      # outside every handler scope
    True
"""

#: ``execute_physical(op, inputs, device) -> outputs``: runs `op` eagerly on the physical
#: device `device` (a canonical name), as ``PHYSICAL.execute`` does outside a replay for
#: any op but the copy ops. For a handler that launches an op on many devices itself (a
#: mesh's per-device shards): callers check ``state.mode is None`` and the op type.
execute_physical = _execute
register_bottom(PHYSICAL)
# What the C++ per-op fast path reads (cc/fast/fast_path.h). Only references: starts nothing.
_C.fast_setup(state, PHYSICAL)

#: The handler attributes a stack derives its fields from (HandlerStack._declarations;
#: fast_signature reads `transient` too).
_DECLARATIONS = frozenset((
    "execute", "copy_on", "function_input", "function_output", "after_execute",
    "returns_off_stack", "handles_ops", "defers_needs_copy", "needs_copy", "transient",
    "handles_copy", "physical_copy_on", "values_released", "changes_computation"))
_templates = BoundedCache("stack.templates", 256)  # (class, on a handler) -> fields
# class -> (its declarations when decided, bool). A declaration assigned to the class
# after a stack of it was built (a monkeypatched execute) must not get the old fields:
# the declarations are compared at each build (a tuple ==, cheaper than hashing them).
_class_decides = BoundedCache("stack.class_declarations", 256)
_class_declarations = operator.attrgetter(*sorted(_DECLARATIONS))


def _decided_by_class(cls):
    """Whether a `cls` instance that sets no declaration itself takes them all from the
    class: not a C/C++ handler, ordinary attribute lookup, no declaration a data
    descriptor (a property may read the instance), `handles_ops` None, a frozenset or a
    staticmethod of a plain function (a method or closure may read the instance, a
    mutable collection may change), `returns_off_stack` a bool, None or a frozenset."""
    if issubclass(cls, _C.NativeHandlerBase) or getattr(
            cls, "__getattribute__") is not object.__getattribute__ or hasattr(
                cls, "__getattr__"):
        return False
    if any(hasattr(type(inspect.getattr_static(cls, name, None)), "__set__")
           for name in _DECLARATIONS):
        return False
    handles = inspect.getattr_static(cls, "handles_ops", None)
    if isinstance(handles, staticmethod):
        handles = handles.__func__
        if not (type(handles) is types.FunctionType and handles.__closure__ is None):
            return False
    elif not (handles is None or type(handles) is frozenset):
        return False
    off = inspect.getattr_static(cls, "returns_off_stack", None)
    return off is None or type(off) in (bool, frozenset)


def _template_key(handler, next_stack):
    """The key of the fields a stack of `handler` on `next_stack` shares with other
    stacks (its class, and whether it sits on a handler), or None when they are its own
    (`_decided_by_class`, or the instance sets a declaration itself)."""
    cls = type(handler)
    try:
        declared = _class_declarations(cls)
        entry = _class_decides.get(cls)
        if entry is None or entry[0] != declared:
            # new or changed (or evicted): its templates may be stale
            _templates.pop((cls, False), None)
            _templates.pop((cls, True), None)
            entry = _class_decides[cls] = (declared, _decided_by_class(cls))
    except (AttributeError, ValueError, TypeError):  # a declaration missing or odd: own
        return None
    if not entry[1]:
        return None
    own = getattr(handler, "__dict__", None)
    if own and not _DECLARATIONS.isdisjoint(own):
        return None
    return (cls, isinstance(next_stack, HandlerStack))


class HandlerStack(Stack):
    """A handler merged onto the stack it executes on.

    Examples:
        >>> h = oh.OpHandler()
        >>> with h:
        ...     stack = oh.current_stack()
        >>> isinstance(stack, oh.HandlerStack), stack.handler is h
        (True, True)
    """

    def __init__(self, handler, next_stack):
        self.handler = handler
        self.next = next_stack
        self.handlers = next_stack.handlers + (handler,)
        # What the stack derives from the handler's declarations depends only on its class
        # (and on whether it sits on another handler) unless the instance overrides one:
        # a fresh handler per scope reuses it (entering a scope builds a stack).
        key = _template_key(handler, next_stack)
        fields = _templates.get(key) if key is not None else None
        if fields is None:
            fields = self._declarations(handler, next_stack)
            if key is not None:
                _templates[key] = fields
        self.__dict__.update(fields)
        # Per stack, not in the shared fields: a physical_copy_on method is bound to this
        # handler (read by cc/fast/fast_hook.cc).
        self._physical_copy_on = physical_copy_of(handler)
        type_name = handler.type_name()
        index = next(_indices.setdefault(type_name, itertools.count()))
        self.name = "/job:localhost/replica:0/task:0/device:%s:%d" % (type_name, index)
        # While such a stack lives the C++ paths ask, for its ops, whether a TensorFlow
        # tape records (cc/fast/fast_path.h SubstitutesUnderTape); never otherwise.
        self._substituting = self._substitutes or next_stack._substituting
        if self._substituting:
            _C.substituting_stacks(1)
            weakref.finalize(self, _C.substituting_stacks, -1)
        # A new stack: the C++ fast path forgets its decisions (its cache is keyed by
        # stack objects, and this one may reuse a dead stack's address).
        _C.stacks_changed(fields["_may_be_fast"])

    def _declarations(self, handler, next_stack):
        """The fields the stack derives from `handler`'s declarations (a dict)."""
        # Hooks left at their defaults take fast paths that skip the hook frame (the
        # base class marks its default hooks with `_oh_default`). Read on the handler, not
        # its class: a hook set on the instance is not a default (else it is skipped).
        f = {}
        f["_records"] = records = getattr(handler, "after_execute", None) is not None
        # A default execute with after_execute still runs (it calls after_execute).
        f["_default_execute"] = getattr(handler.execute, "_oh_default", False) and not records
        # A handler whose execute hook runs may change what an op computes unless it
        # declares it does not (OpHandler.changes_computation).
        f["_substitutes"] = bool(handler.changes_computation) and not f["_default_execute"]
        f["default_copy_on"] = getattr(handler.copy_on, "_oh_default", False)
        f["default_function_input"] = getattr(handler.function_input, "_oh_default", False)
        f["default_function_output"] = getattr(handler.function_output, "_oh_default", False)
        off = handler.returns_off_stack
        f["_off_stack"] = bool(off)
        # Type-based dispatch asks the handler whether its values are released (the
        # handler's method, called on the stack's handler: not kept in shared fields).
        f["_releases"] = handler.values_released is not None
        # Op types whose outputs may leave the stack (None: any op type).
        f["_off_stack_ops"] = None if off is True or not off else frozenset(off)
        # Op types the handler's execute hook is not called for are forwarded to the
        # next stack as with a default execute (OpHandler.handles_ops).
        f["_handles"] = handles_predicate(handler)
        # A handler that only moves tensors on (default copy_on, or a tape) lets the
        # handler below decide which inputs to take as they are (a parallel pack).
        f["_defer_copy"] = isinstance(next_stack, HandlerStack) and (
            f["default_copy_on"] or handler.defers_needs_copy)
        if handler.needs_copy is never_copy:
            # `wants_copy(op, index)` as a C function returning False (an op is never
            # its input index object), so the C++ path calls no Python frame for it.
            f["wants_copy"] = operator.is_
        self.__dict__.update(f)  # (fast_signature reads them from the stack)
        f["_oh_sig"] = fast_signature(self, handler)
        f["_may_be_fast"] = (not f["_off_stack"] or f["_off_stack_ops"] is not None
                             or f["_default_execute"] or f["_handles"] is not None
                             or isinstance(handler, _C.NativeHandlerBase))
        return f

    def _oh_fast(self, op_type):
        """The C++ per-op path's decision for `op_type` on this stack (asked by cc/fast/fast_path.cc;
        core/fast_decision.py says what it is)."""
        return fast_decision(self, op_type)

    def _runs_execute(self, op_type):
        """Whether the handler's execute hook is called for ops of `op_type`."""
        handles = self._handles
        return not self._default_execute and (handles is None or bool(handles(op_type)))

    @staticmethod
    def merged(handler, next_stack):
        """The stack of `handler` executing on `next_stack` (memoized while alive)."""
        key = (id(handler), id(next_stack))
        stack = _merges.get(key)
        # The stack keeps both objects alive, so matching them by identity makes the ids
        # mean what they meant when the entry was made (merge may return other state).
        if stack is None or stack.next is not next_stack or stack.merged_from is not handler:
            start_runtime()  # a stack's tensors live on the dispatcher device
            state = handler.merge(next_stack)
            stack = HandlerStack(state if state is not None else handler, next_stack)
            stack.merged_from = handler
            _merges[key] = stack
        return stack

    # -- the handler's view -------------------------------------------------------------

    def call_hook(self, fn, *args):
        """Runs a hook with `self.next` as the place for ops the hook runs."""
        st = state
        saved = st.current
        st.frames.append(self)
        st.current = self.next
        try:
            return fn(*args)
        finally:
            st.current = saved
            st.frames.pop()

    def unwrap(self, tensor):
        """The handler's representation of a tensor on this stack."""
        p = payload(tensor)
        if p is None or p[0] is not self:
            raise errors.PlacementError(
                "tf_ophandlers: %r does not live on %s" % (tensor, self.name))
        return p[1]

    def wrap(self, value):
        """A tensor on this stack whose representation is `value`."""
        mode = state.mode
        if mode is not None and mode.building():
            return mode.wrap(self, value)
        return _C.wrap(self, value, self.handler.value_dtype(value).as_datatype_enum)

    # -- public operations ----------------------------------------------------------------

    def execute(self, op, inputs):
        mode = state.mode
        if mode is not None:
            if not mode.building():
                mode = None  # eager code inside a replay (tf.init_scope)
            elif not mode.represents(self):
                return mode.emit(op, inputs)  # below the replayed stacks: a node
        handler = self.handler
        if mode is None and op.output_dtype_enums is None and replays(handler, op):
            # A function call op (no OpDef): replayed through this stack (core/functions).
            rule = _function_call_rule[0]
            if rule is None:
                raise errors.HandlerError(
                    "tf_ophandlers: function call %s reached %s, but function replay "
                    "(tf_ophandlers.core.functions) is not loaded" % (op.type, self))
            return rule(self, op, inputs)
        if op.type in COPY_OPS and not takes_copy(handler, op):
            return self._execute_copy(op, inputs)
        if mode is None:
            values, foreign = _unwrap_inputs(self, inputs)
        else:
            values, foreign = self._unwrap_symbolic(inputs, mode)
        if foreign:
            if handler.needs_copy is None and not self._defer_copy:
                for i in foreign:
                    values[i] = self._copy_on_value(values[i])
            else:
                for i in foreign:  # a tensor of a stack built on this one: always
                    source = stack_of(values[i])  # (cc/fast/fast_internal.h WantsCopy)
                    if self.wants_copy(op, i) or source is not None and self._below(source):
                        values[i] = self._copy_on_value(values[i])
            if self._records and mode is None:
                self._check_recorded_copies(op, values, foreign)
        if not self._runs_execute(op.type) and (
                self._handles is None or all(isinstance(v, _Tensor) for v in values)):
            # A pass-through execute (or an op type outside the handler's handles_ops)
            # runs no ops of its own: forward without a frame. (An input whose representation
            # is not a tensor, a handler's own object, only the handler's execute can run:
            # handles_ops does not forward it. The C++ path hands such ops here.)
            # Ops that run *inside* the forwarded op (a tf.py_function's body) belong
            # below this stack, as they would with a frame.
            saved = state.current
            state.current = self.next
            try:
                outputs = self.next.execute(op, values)
            finally:
                state.current = saved
        else:
            if self._substitutes and mode is None and _substitute_rule[0] is not None and (
                    not _tape_set_is_empty()):
                outputs = _substitute_rule[0](self, op, values)
            else:
                outputs = self.call_hook(handler.execute, op, values)
            if type(outputs) is not list and not isinstance(outputs, (list, tuple)):
                raise _not_a_list(handler, op, outputs)
            if mode is not None:
                self._check_symbolic(op, outputs)
                if self._substitutes:
                    mode.check_substitute(self, op, values, outputs)
        if mode is not None:
            outputs = self._wrap_symbolic(outputs, mode)
            mode.executed(op, inputs, outputs)
            return outputs
        return self._wrap_eager(outputs)

    def _check_recorded_copies(self, op, values, foreign):
        """A handler with after_execute represents a tensor by a tensor of the next stack:
        its copy_on must give one (the C record path's check, cc/fast/fast_record.cc)."""
        for i in foreign:
            if not isinstance(values[i], _Tensor):
                raise TypeError(
                    "tf_ophandlers: the copy_on hook of %r returned a %s for input %d of op "
                    "%s, not a tensor of the next stack (a handler with after_execute "
                    "represents a tensor by a tensor of the next stack)" % (
                        self, type(values[i]).__name__, i, op.type))

    def _raise_not_a_list(self, op, outputs):
        """Raises the error for an execute hook that did not return a list (C++ path)."""
        raise _not_a_list(self.handler, op, outputs)

    def _wrap_eager(self, outputs):
        """What `execute` returns for the outputs of the handler's hook (eager)."""
        handler = self.handler
        next_stack = self.next
        if next_stack is not PHYSICAL or self._off_stack:
            # Outputs that leave this stack: those the handler returned as OffStack, and
            # tensors that are not of the next stack, which left the stacks below (a
            # parallel unpack's components, a transient handler's resource handle).
            off = False
            for i, o in enumerate(outputs):
                kind = type(o)
                if kind is OffStack:
                    off = True
                elif (kind is _EagerTensor and next_stack is not PHYSICAL
                      and _C.stack_of(o) is not next_stack):
                    if not isinstance(outputs, list):
                        outputs = list(outputs)
                    outputs[i] = OffStack(o)
                    off = True
            if off:
                wrapped = iter(_wrap_outputs(
                    self, [o for o in outputs if type(o) is not OffStack],
                    handler.transient, handler.value_dtype))
                return [o.tensor if type(o) is OffStack else next(wrapped) for o in outputs]
        # RFC "Placement of resource handles": a transient handler leaves resource handles
        # on the next stack, so a variable does not keep it alive.
        return _wrap_outputs(self, outputs, handler.transient, handler.value_dtype)

    # The symbolic counterparts of the C++ unwrap_inputs/wrap_outputs, for a function
    # being replayed (the mode's shadow tensors carry their payload in Python).

    def _unwrap_symbolic(self, inputs, mode):
        values, foreign = list(inputs), []
        for i, t in enumerate(inputs):
            p = payload(t)  # an eager tensor of this stack too (copy_on returns it)
            if p is not None and p[0] is self:
                values[i] = p[1]
            else:
                foreign.append(i)
        return values, foreign

    def _check_symbolic(self, op, outputs):
        """The dispatcher's output check (cc/boundary/device.cc: count, then each dtype) for what
        the execute hook returned while a function is replayed, with the same error."""
        expected = op.output_dtypes
        if expected is None:
            return  # a function call op: its outputs are its callee's
        if len(outputs) != len(expected):
            raise errors.invalid_outputs(self, op, "count", "expected %d outputs, got %d" % (
                len(expected), len(outputs)))
        for i, (o, want) in enumerate(zip(outputs, expected)):
            value = o.tensor if type(o) is OffStack else o
            got = value.dtype if isinstance(value, _Tensor) else self.handler.value_dtype(value)
            if got != want:
                raise errors.invalid_outputs(self, op, "dtype", "output %d: expected %s, got %s" % (
                    i, want.name, getattr(got, "name", got)))

    def _wrap_symbolic(self, outputs, mode):
        transient = self.handler.transient
        next_represented = mode.represents(self.next)
        result = []
        for o in outputs:
            if type(o) is OffStack:
                result.append(o.tensor)
            elif transient and isinstance(o, _Tensor) and o.dtype == _dtypes.resource:
                # Resource handles stay on the next stack (as _C.wrap_outputs: a tensor;
                # a handler's own value of a handle, a tangent's Dual, is wrapped).
                result.append(o)
            elif (isinstance(o, _Tensor) and next_represented
                  and stack_of(o) is not self.next):
                result.append(o)  # left the stacks below
            else:
                result.append(self.wrap(o))
        return result

    def _below(self, other):
        """Whether `other` is a stack built on this one (this is in its `next` chain)."""
        s = other.next
        while s is not None and s is not self:
            s = s.next
        return s is self

    def wants_copy(self, op, index):
        """Whether input `index` of `op` is copied onto this stack before execute."""
        needs_copy = self.handler.needs_copy
        if needs_copy is not None:
            return needs_copy(op, index)
        return self.next.wants_copy(op, index) if self._defer_copy else True

    def _copy_on_value(self, tensor):
        """The handler's representation of `tensor`, which lives elsewhere."""
        source = stack_of(tensor)
        if source is not None and self._below(source):
            # A tensor of a stack built on this one (a tape's tensor used under the
            # accumulator the tape ran on): its representation here, not copied off and
            # on again, which would lose this handler's representation (a tangent).
            found, value = representation_of(self.handler, tensor)
            if found:
                return value
        if self.default_copy_on:
            return move_onto(self.handler, self.next, tensor)  # no frame needed
        return self.call_hook(self.handler.copy_on, tensor)

    def _execute_copy(self, op, inputs):
        (t,) = inputs
        if op.type in ("CopyOn", "CopyOffGrad"):
            return [self.copy_on(t)]
        device = op.attrs.get("new_device" if op.type == "CopyOff" else "original_device", b"")
        device = device.decode() if isinstance(device, bytes) else device
        if stack_of(t) is not self:
            t = self.copy_on(t)
        hook = self.handler.copy_off if op.type == "CopyOff" else self.handler.copy_on_grad
        value = self.call_hook(hook, self.unwrap(t), device)
        try:  # a gradient's copy with a tape or accumulator below: recorded there
            if op.type != "CopyOnGrad" or not any(h.differentiates and takes_copy(
                    h, op) for h in self.next.handlers):  # (copied off, it lost its tangent)
                return [self.next.copy_off(value, device)]
        except errors.CopyOffError as e:  # refused below by a handler taking copy ops
            # (also under transparent handlers between: vectorized_map > PassThrough >
            # GradientTape > Async, OH_FUZZ_SEED=100 slow case 28): the copy op runs there
            below = getattr(getattr(e, "refused_by", None), "handler", None)
            if not any(h is below for h in self.next.handlers) or getattr(
                    below, "handles_copy", None) is None or not takes_copy(below, op):
                raise
        return self.next.execute(op, [value])

    def copy_on(self, tensor):
        p = payload(tensor)
        if p is not None and p[0] is self:
            return tensor
        mode = state.mode
        if mode is not None and mode.building() and not mode.represents(self):
            return mode.to_bottom(tensor)  # symbolic tensors of the replay's bottom
        return self.wrap(self._copy_on_value(tensor))

    def copy_off(self, tensor, device):
        mode = state.mode
        if mode is not None and mode.building() and not mode.represents(self):
            return mode.to_bottom(tensor)
        source = stack_of(tensor)
        if source is not self:
            # A representation that already left this stack (a handler returned it with
            # OffStack, e.g. a parallel unpack): copy it off from where it lives.
            return (source or PHYSICAL).copy_off(tensor, device)
        try:
            value = self.call_hook(self.handler.copy_off, self.unwrap(tensor), device)
        except errors.CopyOffError as e:  # this stack's refusal (see _execute_copy)
            e.refused_by = getattr(e, "refused_by", None) or self
            raise
        return self.next.copy_off(value, device)

    # -- presentation ---------------------------------------------------------------------

    def __repr__(self):
        return "<HandlerStack %s: %s>" % (
            self.name, " -> ".join(h.debug_string() for h in reversed(self.handlers)))
