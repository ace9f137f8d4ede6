"""`OpHandler`: the base class of every handler (RFC "Available hooks").

A handler has a *state* (the object itself, or what `merge` returns) and a *tensor
representation* (any Python value; by default a tensor of the next stack). Every hook has
a default, so ``OpHandler()`` is a pass-through handler and a subclass overrides only
what it changes:

>>> import tensorflow as tf, tf_ophandlers as oh
>>> class Doubler(oh.OpHandler):
...     def execute(self, op, inputs):
...         outputs = self.next.execute(op, inputs)
...         return [o * 2. if o.dtype.is_floating else o for o in outputs]
>>> with Doubler():
...     y = tf.add(1., 2.)
>>> float(y)
6.0

Inside a hook, `self.next` is the stack this handler executes on, and ops the hook runs
with ordinary TensorFlow calls (``tf.sin(x)``) are placed there too.
"""
from tf_ophandlers.core import errors
from tf_ophandlers.core.representation import move_onto
from tf_ophandlers.core.state import state as _state

# `with handler:` opens a scope through core/scope.py, which sits above this module and
# registers its enter/exit here (set_scope_functions) when it is imported.
_scope_functions = []


def set_scope_functions(enter, exit):  # pylint: disable=redefined-builtin
    """Called by core/scope.py: the functions `OpHandler.__enter__`/`__exit__` use."""
    _scope_functions[:] = [enter, exit]


def _default_hook(fn):
    """Marks a hook of the base class, so stacks take a fast path for handlers that do
    not override it (no hook frame, no Python call where C++ can do the work)."""
    fn._oh_default = True  # pylint: disable=protected-access
    return fn


#: The node name of the ``IdentityN(gradient, source)`` a tape tracing a function puts
#: around each dense gradient of a source, for a handler with `source_gradient` that
#: replays the function: it meets the node there and gives the gradient its source's
#: representation (other handlers, and TensorFlow, run it as the identity it is).
SOURCE_GRADIENT_NODE = "oh_source_gradient"


class _CacheToken:
    """Identity of a handler in replay cache keys that does not keep it alive."""

    __slots__ = ("name", "__weakref__")

    def __init__(self, handler):
        self.name = handler.debug_string()

    def __repr__(self):
        return "<%s>" % self.name


class OpHandler:
    """Pass-through op handler; subclass and override hooks to transform ops.

    Examples:
        >>> class CountOps(oh.OpHandler):
        ...     def __init__(self):
        ...         self.n = 0
        ...     def execute(self, op, inputs):
        ...         self.n += 1
        ...         return self.next.execute(op, inputs)
        >>> counter = CountOps()
        >>> with counter:
        ...     y = tf.sin(tf.constant(1.0))
        >>> counter.n
        1
    """

    #: A transient handler (tapes, logs) leaves resource handles (variables) on the next
    #: stack so that a variable created under it does not keep it alive (RFC "Placement
    #: of resource handles"). Handlers that own per-variable state set this to False.
    transient = True

    #: A transparent handler shows the next stack's device in ``tensor.device`` (as
    #: GradientTape does); otherwise ``tensor.device`` is the stack's name.
    transparent = False

    #: Set to a function ``needs_copy(op, index) -> bool`` to receive some inputs of
    #: some ops as they are, without copy-on (e.g. a parallel handler's pack op).
    needs_copy = None

    #: The op types this handler's `execute` is called for: None (every op), a
    #: collection of op type names (``frozenset({"MatMul", "Conv2D"})``), or a function
    #: ``handles_ops(op_type) -> bool``. Other ops are forwarded to the next stack as
    #: with the default `execute`, and cost no Python call at all where the C++ fast
    #: path can run them (inputs already on the stack), unless an input's representation
    #: is not a tensor (a handler's own object): `execute` gets those ops whatever their
    #: type. Read once per (stack, op type): set it on the class or in ``__init__``, not
    #: while the handler is in use.
    handles_ops = None

    #: Set to a method ``after_execute(op, inputs, outputs)`` when `execute` only forwards
    #: the op to the next stack and then looks at what ran (a tape records it), i.e. when
    #: `execute` is the default or exactly ``outputs = self.next.execute(op, inputs);
    #: self.after_execute(op, inputs, outputs); return outputs`` for ordinary ops (not
    #: copy ops, function calls or ops running Python in their kernel). The C++ fast path
    #: then runs the op on the next stack itself and calls only `after_execute` (one
    #: Python call per op instead of `execute` and the stack's Python below it), inside
    #: the hook's frame (`self.next` is valid), with `inputs` and `outputs` the
    #: representations (tensors of the next stack) as lists it may keep. Its return value
    #: is ignored; an exception it raises reaches the user unchanged. The fast path passes
    #: a physical input as it is when the next stack is PHYSICAL, so `copy_on` must leave
    #: such a tensor unchanged (the default does). Other cases take `execute`.
    after_execute = None

    #: Set to a method ``source_gradient(source, gradient) -> tensor`` to choose how the
    #: gradient an `oh.GradientTape` returns for a source on this handler's stack is
    #: represented: `source` is the source (a variable's resource handle for a variable),
    #: `gradient` the dense gradient computed for it (a tensor of the same stack); the
    #: result must have the same value. oh.Mesh gives the gradient the source's layout,
    #: which the computation may have lost (a sum's gradient is a broadcast, replicated).
    source_gradient = None

    #: Set to a function ``handles_copy(op) -> bool`` to receive copy ops (CopyOn,
    #: CopyOnGrad, CopyOff, CopyOffGrad) placed on this handler's stack in `execute`,
    #: like any op, instead of the stack running them through `copy_on`/`copy_off`.
    #: A recording tape does, so that it records copies and their outputs stay on it.
    #: ``True`` (not a function): every copy op, which the C++ per-op path then runs
    #: through `execute` as it does other ops (no Python stack frames around it).
    handles_copy = None

    #: Whether a function call op placed on this handler is replayed op by op through it
    #: (RFC "Replay before function execution"; core/functions). A handler that sets
    #: this to False takes call ops whole in `execute`, like any op (a tape records the
    #: call with TensorFlow's function gradient; a parallel handler runs it per
    #: component). It may also be a method ``replays_functions(op) -> bool`` deciding
    #: per call (oh.ParallelHandler replays only functions that pack or unpack); such a
    #: handler, like one that sets False, cannot be opened inside a function being traced.
    replays_functions = True

    #: Whether a function replayed through this handler is instantiated with the
    #: context's graph optimizer options, as TensorFlow's own call is (grappler;
    #: core/functions/call.py `CompiledCall(optimized=...)`). A handler whose replays
    #: measure slower optimized sets False (oh.Mesh).
    optimize_replays = True

    #: None, or a method ``iterator_element(value) -> representation``: a function
    #: replayed from this handler's stack that reads the next element of a dataset
    #: iterator it takes as an argument (at the body's top level: Keras's compiled train
    #: step) then has that read run eagerly on the stack just before the call, and each
    #: output component, `value` (this handler's representation), enters the replay as an
    #: argument represented by what this returns (same value; core/functions/
    #: iterator_reads.py): its shape is then known, as an eager argument's. oh.Mesh shards
    #: it along its `batch_dim`. None: the read runs inside the replay, its shape as traced.
    iterator_element = None

    #: Whether `execute` may return `oh.OffStack(tensor)` outputs that leave the stack
    #: as they are (a parallel handler's unpack gives ordinary component tensors): True
    #: for any op, or the op types that may (the others then take the C++ per-op path
    #: around the hook, as with False).
    returns_off_stack = False

    #: Whether this handler lets the handler below decide which inputs are copied on
    #: (`needs_copy` of the next stack), as a tape does: it only records, so a parallel
    #: pack below it still receives its components as they are. Handlers with the
    #: default `copy_on` defer automatically.
    defers_needs_copy = False

    #: None, or a function ``physical_copy_on(tensor) -> representation`` that gives
    #: what `copy_on` gives for a physical tensor when the next stack is PHYSICAL, running
    #: no ops. The C++ fast path then calls it instead of `copy_on`, without a hook frame
    #: (oh.vectorized_map: the tensor as an unbatched value). It stands in for the
    #: `copy_on` defined beside it only: a subclass or an instance that sets its own
    #: `copy_on` without its own `physical_copy_on` has its `copy_on` called
    #: (core/fast_decision.py `physical_copy_of` decides, once per stack).
    physical_copy_on = None

    #: Whether `copy_on_grad` combines the parts of a representation into one value (a
    #: parallel handler sums its components: the gradient of a broadcast). A sparse
    #: gradient (tf.IndexedSlices) reaching a CopyOnGrad on a stack with such a handler
    #: is made dense first: its indices and dense shape cannot be summed part by part.
    copy_on_grad_reduces = False

    #: None, or a method ``values_released() -> bool`` of a transparent handler whose
    #: representation is the next stack's tensor (it changes no values): while it
    #: returns True (e.g. no scope of the handler is open), an op that reaches one of
    #: its stacks by type-based dispatch runs on the stack below instead, so its results
    #: behave as the next stack's tensors (a tape's results are plain tensors once its
    #: scope closed, as tf.GradientTape's, and results of two tapes combine). Ops placed
    #: by a scope (re-entering the handler) still see its tensors as its own.
    values_released = None

    #: Whether the handler keeps the state of its open scope on the instance (not per
    #: thread), so that one instance serves one thread at a time: while a scope of it is
    #: open on one thread, opening one on another thread raises `oh.HandlerError` (use
    #: one instance per thread). False: its scopes may be open on several threads at once
    #: (its hooks are then called from those threads concurrently).
    one_thread_at_a_time = False

    #: The kind of automatic differentiation this handler does, for handlers that must
    #: treat differentiation specially without importing its modules (oh.Recompute keeps
    #: a function call whole under one): "reverse" for a tape recording its scope's ops
    #: for a later backward pass (oh.GradientTape), "forward" for one computing tangents
    #: as ops run (oh.ForwardAccumulator), None otherwise. A subclass inherits it.
    differentiates = None

    #: Whether this handler's `execute` may change what an op computes: run another op,
    #: dtype or layout in its place (a substitute: Relu as LeakyRelu, a MatMul in
    #: bfloat16, fake quantization). While a TensorFlow tape (`tf.GradientTape`,
    #: `tf.autodiff.ForwardAccumulator`) records, the execute hook of such a handler is
    #: run with a recording of what it runs below, and those tapes differentiate that,
    #: not the registered gradient of the op the user called. True (the safe default)
    #: costs that recording, under TensorFlow tapes only; a handler whose execute
    #: computes exactly the op it got (forwards it, logs, checks, records, batches,
    #: shards or defers it) declares False and keeps the fast paths. A handler keeping
    #: the default `execute` never substitutes, whatever this says.
    changes_computation = True

    #: Whether an `oh.GradientTape` may seed the backward pass of a target on this
    #: handler's stack with a cached ones tensor copied onto the stack (instead of a
    #: Shape and a Fill run through the handler): True when a constant entering the
    #: stack is what ``tf.ones_like`` there gives (oh.vectorized_map: an unbatched value).
    constant_seeds = False

    #: Whether gradients recorded on this handler's stack take the reduction axes of
    #: broadcasting ops (Add, Sub, ...) from the static shapes the handler reports
    #: (`value_shape`), as TensorFlow's graph gradients do, instead of from runtime
    #: shapes: True when those static shapes are what the program sees (oh.vectorized_map:
    #: the per-example shape) and a runtime shape would be the handler's own.
    static_shape_gradients = False

    #: Whether a recording tape above this handler passes a physical input it does not
    #: track to this handler's `execute` as it is, instead of through its own `copy_on`
    #: (core/recording.py `copy_through`): True for a handler that copies such inputs on
    #: itself in a way the tape need not record (oh.vectorized_map: unbatched). Read by
    #: the C++ record path under this name.
    tape_copies_through = False

    #: Whether TensorFlow's counterpart of this handler runs the ops of its scope as a
    #: traced function (tf.vectorized_map traces the mapped function), so that handlers
    #: matching TensorFlow's results treat ops reaching them through an open scope of
    #: this handler as ops of a function (the forward accumulator's JVPs below it).
    counterpart_traces = False

    #: Set by a handler whose common ops the C++ per-op path records itself (no Python
    #: frame per op; cc/handlers/lazy/fast_lazy.cc): the class's `execute` is then called only for the
    #: ops C hands over. Read on the class by core/fast_decision.py; a subclass that
    #: overrides `execute` must reset it to False.
    _oh_records_in_c = False

    #: None, or a method ``holds_variable(variable) -> bool`` of a handler whose
    #: variables live per device (one buffer per component or device, created in its
    #: scope): a Keras optimizer step in its scope is checked before it writes anything
    #: (core/per_device.py), and a variable the step writes that the handler does not
    #: hold raises `oh.PlacementError` with the text of `misplaced_write`.
    holds_variable = None

    def misplaced_write(self, optimizer, variable):
        """The message of the `oh.PlacementError` a Keras optimizer step raises in this
        handler's scope before writing `variable`, which the handler does not hold
        (see `holds_variable`)."""
        return ("%s: %s.apply would write variable %r, created outside the scope; "
                "nothing was written. Make the optimizer inside the scope."
                % (self.debug_string(), type(optimizer).__name__,
                   getattr(variable, "path", None) or variable.name))

    def is_recording(self):
        """For a handler that `differentiates`: whether it records the ops reaching it
        now (inside its scope, not paused, stopped or used up). `oh.extend`'s
        `recording_handlers` reads it; the default is False."""
        return False

    #: The device type in this handler's stack names (default: the class name in upper
    #: case), e.g. ``"PARALLEL"`` gives ``/job:localhost/replica:0/task:0/device:PARALLEL:0``.
    TYPE_NAME = None

    # -- identity ---------------------------------------------------------------------------

    @classmethod
    def type_name(cls):
        """Device type in stack names ``/job:localhost/replica:0/task:0/device:TYPE:N``."""
        return cls.TYPE_NAME or cls.__name__.upper()

    def debug_string(self):
        """How this handler is named in error messages."""
        return "%s()" % type(self).__name__

    def __repr__(self):
        return "<%s>" % self.debug_string()

    @property
    def next(self):
        """The stack this handler executes on; valid inside its hooks.

        (`oh.next_stack()` gives the same for the running hook without the search a
        handler nested in its own hooks needs.)
        """
        frames = _state.frames
        if frames and frames[-1].handler is self:
            return frames[-1].next
        for stack in reversed(frames):
            if stack.handler is self:
                return stack.next
        raise errors.HandlerError(
            "%s.next is only defined inside one of its hooks" % self.debug_string())

    # -- hooks ------------------------------------------------------------------------------

    @_default_hook
    def execute(self, op, inputs):
        """Runs `op` on `inputs` (this handler's representations) -> representations.

        The default forwards the op to the next stack unchanged (and calls
        `after_execute` when the handler defines it).
        """
        outputs = self.next.execute(op, inputs)
        if self.after_execute is not None:
            self.after_execute(op, list(inputs), list(outputs))
        return outputs

    @_default_hook
    def copy_on(self, tensor):
        """Representation of `tensor`, which lives elsewhere (RFC CopyOn).

        `tensor` is a physical tensor or one from another stack. The default moves it onto
        the next stack. A tensor of this handler from an earlier merge is taken directly
        (RFC "Re-entering a merged handler stack"): its representation is moved onto
        this merge's next stack without a copy off this handler (one that is not a
        tensor by its `function_input` parts, rebuilt with `function_output`).
        """
        return move_onto(self, self.next, tensor)

    def copy_off(self, value, device):
        """A tensor on the next stack for `value`, on its way to physical `device`.

        Raise (e.g. `oh.CopyOffError`) to refuse copies off this handler.
        """
        return value

    def represented_value(self, value):
        """The tensor of the next stack that carries `value` (a representation that is
        not a tensor), for a handler below asking which of its values that is
        (`oh.representation_of(h, t, carrier=True)`). Default: `copy_off(value, "")`;
        a handler that refuses to copy some values off names the tensor they are part
        of (oh.vectorized_map: the batched tensor of a per-example value)."""
        return self.copy_off(value, "")

    def copy_on_grad(self, value, original_device):
        """CopyOnGrad: maps a gradient back off this handler. Default: as copy_off."""
        return self.copy_off(value, original_device)

    def merge(self, next_stack):
        """The handler state for this handler executing on `next_stack` (default: self)."""
        return self

    def value_dtype(self, value):
        """The dtype of a representation (override for non-tensor representations)."""
        dtype = getattr(value, "dtype", None)
        if dtype is None:
            raise errors.HandlerOutputError(
                "%s produced %r, which is not a tensor: a handler whose representation is "
                "not a tensor must override value_dtype (and num_dims/dim)"
                % (self.debug_string(), value))
        return dtype

    #: None, or a function ``value_shape(value) -> tuple`` giving a representation's whole
    #: shape at once (None for an unknown dim; None for an unknown rank), consistent with
    #: `num_dims`/`dim`: TensorFlow's rank query then answers the following dim queries
    #: without a hook call each, and oh.GradientTape's static-shape gradients read it
    #: (oh.vectorized_map: the per-example shape). An answer that is not such a tuple falls
    #: back to `num_dims`/`dim`.
    value_shape = None

    #: None, or a function ``refine_shape(value, shape)`` called when the program gives a
    #: tensor of this handler whose shape is not fully known a more specific shape
    #: (``t.set_shape(shape)``, which then has graph semantics: `shape` is the merge of
    #: the two, already checked compatible): the handler keeps it in the representation
    #: so that `num_dims`/`dim` and the ops that use the tensor see it (oh.eval_shape).
    #: None: only that Python tensor object shows the merged shape.
    refine_shape = None

    def num_dims(self, value):
        """Rank of a representation that is not a tensor (-1 if unknown)."""
        rank = value.shape.rank
        return -1 if rank is None else rank

    def dim(self, value, index):
        """Axis length of a representation that is not a tensor (-1 if unknown)."""
        d = value.shape[index]
        return -1 if d is None else int(d)

    def static_value(self, value):
        """A numpy value known without running anything, or None (tf.get_static_value)."""
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        return tf.get_static_value(value) if isinstance(value, tf.Tensor) else None

    def device_string(self, value, stack):
        """What ``tensor.device`` shows for a tensor of this handler."""
        if self.transparent and hasattr(value, "device"):
            return value.device
        return stack.name

    def tensor_debug_string(self, value):
        """Text shown for the value by ``repr``/``str`` of a tensor of this handler.

        Transparent handlers show the value as TensorFlow would; others prefix their
        type name.
        """
        from tensorflow.python.framework import ops  # pylint: disable=import-outside-toplevel
        text = ops.value_text(value) if hasattr(value, "_id") else repr(value)
        return text if self.transparent else "%s: %s" % (self.type_name(), text)

    # -- functions (RFC "Op handlers inside functions and control flow") ------------------

    @_default_hook
    def function_input(self, value):
        """FunctionInput: how a representation crosses a function boundary.

        Returns ``(summary, tensors)``: a hashable summary (part of the replay cache key,
        so it must not hold tensors) and the tensors of the next stack that carry `value`.
        It is asked for the arguments of a replayed call (exterior values), for its
        results inside the replay (interior values), and likewise for the inputs and
        outputs of control-flow branches and loop bodies. The default suits a
        representation that is a tensor of the next stack.
        """
        return None, [value]

    @_default_hook
    def function_output(self, summary, tensors):
        """FunctionOutput: the representation rebuilt from `function_input`'s parts on the
        other side of the boundary (symbolic tensors inside a replay, the results of the
        replayed call outside)."""
        (tensor,) = tensors
        return tensor

    def function_join(self, summaries):
        """The summary a value must have where control flow merges values of these
        `summaries` (the branches of a cond, a loop's inputs and its body's results).
        The default accepts only equal summaries."""
        first = summaries[0]
        if any(s != first for s in summaries[1:]):
            raise errors.HandlerError(
                "%s: values with different function summaries (%r) meet in control flow; "
                "the handler must implement function_join and function_coerce"
                % (self.debug_string(), list(summaries)))
        return first

    def function_coerce(self, value, summary):
        """`value` converted to a representation with `summary` (from `function_join`),
        e.g. a tangent of zeros added, or a value broadcast over a batch."""
        raise errors.HandlerError(
            "%s cannot convert %r to function summary %r (implement function_coerce)"
            % (self.debug_string(), value, summary))

    def function_call_join(self, summaries):
        """The summary every argument of a replayed call on this handler's stack is
        converted to (`function_coerce`) inside the replay, given the arguments'
        `summaries`, or None (the default) to leave them as they are. The forward
        accumulator gives a zero tangent to every floating-point argument when one has a
        tangent: TensorFlow's JVP of a call fills the others with zeros, so a result
        computed from them has a zero JVP rather than None."""
        return None

    def function_gradients_dense(self, summary):
        """Whether the gradients of a replayed tf.function call with an argument of this
        `summary` (from `function_input`) are dense: TensorFlow converts a call's
        tf.IndexedSlices gradients to tensors when forward-mode tangents reach its
        arguments (ConcreteFunction, ``input_tangents``), so the forward accumulator says
        True for an argument with a tangent. The default is False."""
        return False

    def function_cache_key(self):
        """What identifies this handler in the replay cache (with the inputs' summaries).

        The default is the handler itself, so a new handler replays a function again
        and sees its ops (an op log). Handlers whose replay depends only on the
        summaries return a value shared between instances, so a handler of the next
        training step reuses the replay (RFC: "same summary function").
        """
        token = self.__dict__.get("_oh_cache_token")
        if token is None:
            token = self.__dict__["_oh_cache_token"] = _CacheToken(self)
        return token

    # -- scopes -----------------------------------------------------------------------------

    def scope_entered(self):
        """Called when a scope opens this handler (`with h:`, `oh.handler(...)`).

        Scopes that re-enter a stack already containing the handler do not call it. A
        tape uses it to record only inside its scopes, as `tf.GradientTape` does.
        """

    def scope_exited(self):
        """Called when the scope that opened this handler closes."""

    def __enter__(self):
        _scope_functions[0](self)
        return self

    def __exit__(self, *exc_info):
        _scope_functions[1](self)
        return False
