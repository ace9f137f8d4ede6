"""`ParallelHandler`: every op runs on several devices at once (the RFC's running
parallel example; TensorFlow's experimental ParallelDevice is the prior art).

The representation of a tensor is a `ParallelValue`: one tensor of the next stack per
component device. An op placed on the handler runs once per component, on that
component's device; a tensor copied on is broadcast (CopyOn), and the gradient of that
broadcast sums the components back (CopyOnGrad), so a tape around or inside the handler
gives data-parallel gradients. Copying a multi-component tensor off is an error: use
`unpack`.

>>> import tensorflow as tf, tf_ophandlers as oh
>>> parallel = oh.ParallelHandler(["CPU:0", "CPU:1"])   # two logical CPUs
>>> with parallel:
...     x = parallel.pack([tf.constant(1.), tf.constant(2.)])
...     y = x * 10.
>>> [float(t) for t in parallel.unpack(y)]
[10.0, 20.0]

Components are device names: logical devices of this process
(`tf.config.set_logical_device_configuration`, configured before TensorFlow initializes)
or devices of TensorFlow's distributed runtime (`/job:worker/replica:0/task:1/device:CPU:0`
after `tf.config.experimental_connect_to_cluster`).
"""
import threading

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context as _context
from tensorflow.python.eager import record as _record
from tensorflow.python.framework import errors_impl as _error_codes
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import resource_variable_ops as _resource_variable_ops

from tf_ophandlers.extend import (
    body_op_types, BoundedCache, copies as _copies, current_stack, errors, LAUNCHES,
    next_stack, OffStack, Op, OpHandler, PHYSICAL, per_device as _per_device,
    registries as _registries, representation_of, scope as _scope, stack_of,
    state as _state)
from tf_ophandlers.handlers.parallel import collectives as _collectives
from tf_ophandlers.handlers.parallel import deadlines as _deadlines
from tf_ophandlers.handlers.parallel import fused_calls as _fused_calls
from tf_ophandlers.handlers.parallel import nest as _nest
from tf_ophandlers.handlers.parallel.fit import ensure_data_parallel_fit

_stack_of = stack_of
_PACKING_OPS = frozenset(("ParallelPack", "ParallelUnpack"))


class ParallelValue:
    """The handler's representation: one next-stack tensor per component device.

    `broadcast` marks a resource handle copied on from outside (a host variable): every
    component refers to the same buffer, so it may be read but not written.

    Examples:
        >>> parallel = oh.ParallelHandler(["CPU:0", "CPU:1"])
        >>> with parallel:
        ...     x = parallel.pack([tf.constant(1.0), tf.constant(2.0)])
        >>> _, value = oh.representation_of(parallel, x)
        >>> type(value).__name__, len(value.components)
        ('ParallelValue', 2)
    """

    __slots__ = ("components", "broadcast")

    def __init__(self, components, broadcast=False):
        self.components = tuple(components)
        self.broadcast = broadcast

    def __repr__(self):
        return "ParallelValue(%r)" % (self.components,)


def _copy_to(next_stack, tensor, device):
    """`tensor` as a tensor of `next_stack` on physical `device` (an Identity there)."""
    with _scope.on_device(device), LAUNCHES:
        (copy,) = next_stack.execute(Op.cached("Identity", T=tensor.dtype), [tensor])
    return copy


_thread = threading.local()


class ParallelHandler(OpHandler):
    """Runs each op on every component device (`components`: device names).

    Examples:
        >>> parallel = oh.ParallelHandler(["CPU:0", "CPU:1"])
        >>> with parallel:
        ...     x = parallel.pack([tf.constant(1.0), tf.constant(2.0)])
        ...     y = parallel.unpack(x * 10.0)
        >>> [float(v) for v in y]
        [10.0, 20.0]
    """

    transient = False  # variables created under it hold one buffer per component
    returns_off_stack = True  # unpack's outputs are ordinary tensors
    TYPE_NAME = "PARALLEL"

    def replays_functions(self, op):  # pylint: disable=method-hidden
        """A function call runs whole on each component, unless its body (or a function
        it calls) packs or unpacks: those ops have a meaning only on the handler (run
        whole, they fail on a local component and are unknown to a remote worker's
        server), so such a function is replayed op by op into one multi-device function
        of stock ops (a pack takes input i on component i; an unpack reads each
        component's tensor)."""
        return bool(_PACKING_OPS & body_op_types(op.type))

    def __init__(self, components, timeout_seconds=300.0):
        """`components`: distinct device names, each a logical device of this process or
        a device of a connected cluster (checked here: a repeated or unknown device would
        make a collective wait forever).

        `timeout_seconds`: how long a collective (`all_reduce`) waits for every component
        before raising `tf.errors.DeadlineExceededError` (a remote worker that died
        cannot join): TensorFlow's `CollectiveReduceV2` timeout with a remote component,
        the process's watchdog with local ones (see `_timed_collective`). None or 0
        waits without limit.
        """
        if isinstance(components, str):
            raise TypeError("oh.ParallelHandler: components must be a list of device names, "
                            "got the string %r" % (components,))
        components = list(components)
        if not components:
            raise ValueError("oh.ParallelHandler: needs at least one component device")
        self.components = _per_device.canonical_devices(components, "oh.ParallelHandler")
        if timeout_seconds is not None and not timeout_seconds >= 0:
            raise ValueError("oh.ParallelHandler: timeout_seconds must be None or >= 0, "
                             "got %r" % (timeout_seconds,))
        self.timeout_seconds = timeout_seconds
        _per_device.ensure_optimizer_check()
        ensure_data_parallel_fit()

    def debug_string(self):
        return "ParallelHandler(%s)" % ", ".join(self.components)

    def misplaced_write(self, optimizer, variable):
        return _per_device.misplaced_write_message(
            self, optimizer, variable, "component", "parallel",
            "; optimizer.build(model.trainable_variables)` before the first tf.function step")

    def holds_variable(self, variable):
        """Whether `variable` has one buffer per component here (created in the scope);
        a host variable is only broadcast for reading (see `check_optimizer_step`)."""
        stack = _stack_of(getattr(variable, "handle", None))
        return stack is not None and any(h is self for h in stack.handlers)

    # -- variables: one buffer per component, saved per component ------------------------

    def scope_entered(self):
        # Per thread: TensorFlow's variable creator stack is thread-local too.
        scopes = _thread.__dict__.setdefault("creator_scopes", {})
        depth, scope = scopes.get(id(self), (0, None))
        if depth == 0:
            scope = tf.variable_creator_scope(self._variable_creator)
            scope.__enter__()
        scopes[id(self)] = (depth + 1, scope)

    def scope_exited(self):
        scopes = _thread.__dict__.setdefault("creator_scopes", {})
        depth, scope = scopes.pop(id(self), (1, None))
        if depth > 1:
            scopes[id(self)] = (depth - 1, scope)
        elif scope is not None:
            scope.__exit__(None, None, None)

    def _variable_creator(self, next_creator, **kwargs):
        del next_creator  # as TensorFlow's parallel device: the variable type is ours
        if _ops.inside_function():
            # A tf.function's first call: its own variable creator (which would lift the
            # initial value out) runs after ours, so ours does what it does.
            return _function_variable_class()(oh_parallel=self, **kwargs)
        return ParallelVariable(oh_parallel=self, **kwargs)

    @property
    def device_ids(self):
        """A tensor of this handler whose component i is i (int32)."""
        return self.pack([tf.constant(i, tf.int32) for i in range(len(self.components))])

    # -- handler-specific ops -------------------------------------------------------------

    def _scope(self):
        """This handler's scope: within the current one if it already contains us."""
        if any(h is self for h in current_stack().handlers):
            return _NullScope()
        return _scope.handler(self)

    def pack(self, tensors):
        """One tensor of this handler whose component i is `tensors[i]` (differentiable).
        Structures (dicts, tuples, lists of tensors, nested) pack leaf by leaf:
        `pack([{"x": x0}, {"x": x1}])` is `{"x": pack([x0, x1])}`."""
        tensors = list(tensors)
        if len(tensors) != len(self.components):
            raise ValueError("oh.ParallelHandler.pack: got %d tensors for %d components"
                             % (len(tensors), len(self.components)))
        if _nest.is_structure(tensors):
            return _nest.pack(tensors, self.pack)
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        if len({t.dtype for t in tensors}) != 1:
            raise ValueError("oh.ParallelHandler.pack: components must have one dtype, got %s"
                             % [t.dtype.name for t in tensors])
        with self._scope():
            return _copies.parallel_pack(tensors)

    def unpack(self, tensor):
        """The components of a tensor of this handler, as ordinary tensors; of a
        structure of such tensors, one structure per component."""
        if not tf.is_tensor(tensor) and not isinstance(tensor, tf.Variable):
            return _nest.unpack(tensor, len(self.components), self.unpack)
        stack = _stack_of(tensor)
        if stack is not None and any(isinstance(h, ParallelHandler) for h in stack.handlers) \
                and not any(h is self for h in stack.handlers):
            raise errors.PlacementError(
                "oh.ParallelHandler.unpack: %s does not belong to %s but to %s"
                % (tensor.shape, self.debug_string(), stack))
        if stack is not None and any(h is self for h in stack.handlers):
            # Runs where the tensor lives (re-entered within the current scope), so the
            # handlers above this one (a tape) see the unpack too.
            with _scope.handler(stack):
                return _copies.parallel_unpack(tensor, len(self.components))
        with self._scope():
            return _copies.parallel_unpack(tensor, len(self.components))

    def all_reduce(self, tensor):
        """Sum over components, on every component: TensorFlow's collective all-reduce.

        Differentiable (the gradient of an all-reduce is an all-reduce of the gradient).
        """
        handlers = current_stack().handlers
        below = handlers[:next((i for i, h in enumerate(handlers) if h is self), None)]
        if any(getattr(h, "differentiates", None) == "reverse" and h.is_recording()
               for h in below):
            raise NotImplementedError(
                "oh.ParallelHandler.all_reduce: an oh.GradientTape opened outside the "
                "parallel scope cannot differentiate through all_reduce; open the tape "
                "inside the scope")

        if not tf.executing_eagerly():
            # In a function being traced: the call runs the collective per component.
            return _collectives.differentiable_traced_all_reduce(
                self, tensor, self.timeout_seconds)

        @tf.custom_gradient
        def reduce(t):
            parts = self.unpack(t)
            # The collective has no gradient of its own: this function provides it.
            with _scope.physical(), _record.stop_recording():
                try:
                    reduced = self._timed_collective(*parts)
                except tf.errors.DeadlineExceededError as e:
                    raise tf.errors.DeadlineExceededError(
                        e.node_def, e.op,
                        "oh.ParallelHandler.all_reduce: a component of %s did not join the "
                        "collective within timeout_seconds=%s (TensorFlow aborts the "
                        "process's collectives after this: restart the program). %s"
                        % (self.debug_string(), self.timeout_seconds, e.message)) from e
            return self.pack(reduced), lambda dy: self.all_reduce(dy)

        return reduce(tensor)

    def _timed_collective(self, *parts):
        """`_collective`, bounded by `timeout_seconds`. Components of this process run
        their members in one function call, so none can be missing while the call runs:
        TensorFlow's timeout (a sleeping OS thread per member and call, kept for the
        whole timeout) gives way to the process's watchdog, which aborts the
        collectives as TensorFlow's timeout does. A remote component keeps TensorFlow's
        timeout (its worker may have died), and so does a traced all_reduce (the
        collective runs when the traced function is called, outside this watch)."""
        if not (self.timeout_seconds and tf.executing_eagerly()
                and _fused_calls.all_local(self)):
            return self._collective(self.timeout_seconds or None, *parts)
        message = ("oh.ParallelHandler.all_reduce: the collective of %s did not complete "
                   "within timeout_seconds=%s" % (self.debug_string(), self.timeout_seconds))
        with _deadlines.deadline(self.timeout_seconds, lambda: _context.context(
                ).abort_collective_ops(_error_codes.DEADLINE_EXCEEDED, message)) as fired:
            try:
                return self._collective(None, *parts)
            except tf.errors.OpError as e:
                if not fired:
                    raise
                # The abort's status may reach the caller with another code (the
                # runtime's cancellation): the deadline is what happened.
                raise tf.errors.DeadlineExceededError(e.node_def, e.op, e.message) from e

    def _collective(self, timeout, *parts):
        """One collective all-reduce per component device, as one function call (all
        members run inside it, so that they meet), with TensorFlow's collective timeout
        `timeout` (None: none). One concrete function per timeout and signature of
        `parts` (dtypes and shapes; bounded), called directly: a tf.function retraced
        for each new shape would print TensorFlow's retracing warning for the library's
        own code."""
        key = (timeout,) + tuple((p.dtype, tuple(p.shape.as_list())) for p in parts)
        functions = self.__dict__.get("_collective_fns")
        if functions is None:
            functions = self.__dict__["_collective_fns"] = BoundedCache(
                "parallel.collectives.%x" % id(self), 64)
        fn = functions.get(key)
        if fn is None:
            fn = functions[key] = self._collective_function(
                timeout, [tf.TensorSpec(p.shape, p.dtype) for p in parts])
        return fn(*parts)

    def _collective_function(self, timeout, specs):
        """The all-reduce of `_collective` for `timeout` and arguments `specs`."""
        from tensorflow.python.distribute import collective_util  # pylint: disable=import-outside-toplevel
        from tensorflow.python.distribute import reduce_util  # pylint: disable=import-outside-toplevel
        collective = self.__dict__.get("_collective_launcher")
        if collective is None:
            # TensorFlow's launcher manages group/instance keys and the ordering of
            # collectives (its options have no timeout: each call passes its own).
            from tensorflow.python.distribute import cross_device_ops  # pylint: disable=import-outside-toplevel
            collective = self.__dict__["_collective_launcher"] = \
                cross_device_ops.CollectiveAllReduce(
                    devices=list(self.components), group_size=len(self.components),
                    options=collective_util.Options(),
                    collective_keys=_collectives.collective_keys())
        options = collective_util.Options(timeout_seconds=timeout)
        devices = self.components

        @tf.function(autograph=False, input_signature=specs)
        def fn(*parts):
            out = []
            for i, (device, part) in enumerate(zip(devices, parts)):
                with tf.device(device):
                    out.append(collective._all_reduce(  # pylint: disable=protected-access
                        reduce_util.ReduceOp.SUM, tf.identity(part), i, options))
            return out

        return fn.get_concrete_function()

    # -- hooks ----------------------------------------------------------------------------

    def needs_copy(self, op, index):  # pylint: disable=method-hidden
        return op.type != "ParallelPack"  # pack takes the per-component tensors as given

    def value_dtype(self, value):
        return value.components[0].dtype

    def num_dims(self, value):
        ranks = {c.shape.rank for c in value.components}
        rank = ranks.pop() if len(ranks) == 1 else None
        return -1 if rank is None else rank

    def dim(self, value, index):
        dims = {c.shape[index] for c in value.components}
        d = dims.pop() if len(dims) == 1 else None  # components may differ: unknown
        return -1 if d is None else int(d)

    def function_input(self, value):
        # A replayed function (see replays_functions) takes each component as a tensor.
        return ("components", len(value.components), value.broadcast), list(value.components)

    def function_output(self, summary, tensors):
        return ParallelValue(tensors, broadcast=summary[2])

    def static_value(self, value):
        # A value only if every component has the same static value (RFC).
        values = [tf.get_static_value(c) for c in value.components]
        if any(v is None for v in values):
            return None
        first = np.asarray(values[0])
        return first if all(np.array_equal(first, v) for v in values[1:]) else None

    def tensor_debug_string(self, value):
        parts = []
        for device, c in zip(self.components, value.components):
            parts.append('"%s": %s' % (device.rsplit("/", 1)[-1], _ops.value_text(c) if
                                       hasattr(c, "_id") else repr(c)))
        return "ParallelValue({%s})" % ", ".join(parts)

    def copy_on(self, tensor):
        below = next_stack()
        found, value = representation_of(self, tensor)
        if found:  # ours, from an earlier merge or under transparent handlers above us
            return ParallelValue(below.copy_on(c) for c in value.components)
        # A broadcast: one copy per component device.
        return ParallelValue((_copy_to(below, tensor, d) for d in self.components),
                             broadcast=tensor.dtype == tf.resource)

    copy_on_grad_reduces = True  # a sparse gradient of a broadcast is summed dense

    def copy_on_grad(self, value, original_device):
        # The gradient of a broadcast sums the components, on the original device.
        below = next_stack()
        op = Op.cached("AddN", N=len(value.components), T=value.components[0].dtype)
        with _scope.on_device(original_device or self.components[0]), LAUNCHES:
            (total,) = below.execute(op, list(value.components))
        return total

    def copy_off(self, value, device):
        # A tensor whose components are all equal has one value (RFC: as static_value);
        # TensorFlow reads some replicated values itself (variable initialization checks).
        first = value.components[0]
        if _registries.recording_handlers("reverse"):
            # A tape opened outside the scope taking this tensor as a target: one
            # component would silently stand for all (one replica's gradient).
            raise errors.CopyOffError(
                "oh.ParallelHandler: a tensor with %d components (one per device of %s) "
                "cannot be a target of an oh.GradientTape opened outside the scope; use "
                "tf.add_n(parallel.unpack(t)) (the sum over components, as the RFC's "
                "CopyOnGrad sums a broadcast's gradient), or open the tape inside the scope"
                % (len(value.components), ", ".join(self.components)))
        if first.shape.num_elements() is not None and first.shape.num_elements() <= 1024:
            # Inside a replayed function a component is a graph tensor: only a static
            # value can show that all components agree; otherwise refuse, so that control
            # flow takes its per-component path.
            values = [np.asarray(c) if isinstance(c, _ops.EagerTensor)
                      else tf.get_static_value(c) for c in value.components]
            if all(v is not None for v in values) and all(
                    np.shape(v) == np.shape(values[0]) and np.array_equal(v, values[0])
                    for v in values[1:]):
                return first
        raise errors.CopyOffError(
            "oh.ParallelHandler: a tensor with %d components (one per device of %s) cannot "
            "be copied off as one tensor; use parallel.unpack(t) to get the components"
            % (len(value.components), ", ".join(self.components)))

    changes_computation = False  # runs each op as it is, per component

    def execute(self, op, inputs):
        if op.type in _per_device.VARIABLE_READS and any(
                not v.broadcast and v.components[0].dtype == tf.resource for v in inputs):
            _per_device.refuse_tape_below(self, op, "component", "oh.ParallelHandler")
        below = next_stack()
        n = len(self.components)
        if op.type == "ParallelPack":
            out = []
            for i, (device, t) in enumerate(zip(self.components, inputs)):
                # A tensor already ours gives its own component i.
                out.append(t.components[i] if isinstance(t, ParallelValue)
                           else _copy_to(below, t, device))
            return [ParallelValue(out)]
        if op.type == "ParallelUnpack":
            (value,) = inputs
            return [OffStack(c) for c in value.components]
        for v in inputs:
            if v.broadcast and _writes_resource(op):
                raise errors.PlacementError(
                    "oh.ParallelHandler: op %s would write a variable created outside the "
                    "handler once per component (%d times); update it outside the "
                    "parallel scope, or create the variable inside the scope to get one "
                    "buffer per component. For a Keras model, build and compile it inside "
                    "the scope (with oh.ParallelHandler(devices): model = ...; "
                    "model.compile(...); model.fit(...)), so that its weights and its "
                    "optimizer's state are per device" % (op.type, n))
            if len(v.components) != n:
                raise errors.PlacementError(
                    "oh.ParallelHandler: op %s got a tensor with %d components on a handler "
                    "with %d" % (op.type, len(v.components), n))
        if n > 1 and _collectives.meets_across_components(op) and (
                _state.mode is None or not _state.mode.building()):
            fused = below is PHYSICAL and _fused_calls.fused_call(self, op)
            if fused:
                per_device = _fused_calls.run_fused(self, fused, op, inputs)
            else:
                per_device = _collectives.run_concurrently(self, below, op, inputs)
        else:
            # The launches take turns with other threads' (core/launch_lock.py:
            # TensorFlow mixes up the inputs of concurrent ops on a device otherwise).
            per_device = []
            with LAUNCHES:
                for i, device in enumerate(self.components):
                    with _scope.on_device(device):
                        per_device.append(below.execute(op, [v.components[i] for v in inputs]))
        return [ParallelValue(outs) for outs in zip(*per_device)]


def _writes_resource(op):
    t = op.type
    return (t.startswith(("Assign", "ResourceApply", "ResourceSparseApply", "ResourceScatter",
                          "ResourceStridedSliceAssign"))
            or t in ("DestroyResourceOp",))


class _PerComponentSaving:
    """Saves and restores a variable of an oh.ParallelHandler scope per component."""

    def _oh_bind(self, oh_parallel):
        stack = _stack_of(self.handle)
        # Created under tf.init_scope (or by a hook below the handler): an ordinary one.
        self._oh_parallel = oh_parallel if stack is not None and any(
            h is oh_parallel for h in stack.handlers) else None

    def _serialize_to_tensors(self):
        if self._oh_parallel is None:
            return super()._serialize_to_tensors()
        parts = self._oh_parallel.unpack(self.read_value())  # pylint: disable=protected-access
        return {"component_%d" % i: t for i, t in enumerate(parts)}

    def _restore_from_tensors(self, restored_tensors):
        parallel = self._oh_parallel  # pylint: disable=protected-access
        if parallel is None:
            return super()._restore_from_tensors(restored_tensors)
        parts = [restored_tensors["component_%d" % i] for i in range(len(parallel.components))]
        if _ops.inside_function():
            # TensorFlow restores in a tf.function when the saved tensors live on several
            # tasks (components on the workers of a cluster), called outside the scope:
            # that function assigns each component's buffer through its own handle.
            with tf.init_scope():
                handles = parallel.unpack(self.handle)
            return tf.group(*[_resource_variable_ops.assign_variable_op(h, p)
                              for h, p in zip(handles, parts)])
        return self.assign(parallel.pack(parts))


class ParallelVariable(_PerComponentSaving, _resource_variable_ops.ResourceVariable):
    """A variable created in an oh.ParallelHandler scope: one buffer per component device,
    saved and restored per component.

    The handler's variable creator constructs it directly, as TensorFlow's own parallel
    device does (parallel_device/saving.py), instead of changing a live variable's class.

    Examples:
        >>> parallel = oh.ParallelHandler(["CPU:0", "CPU:1"])
        >>> with parallel:
        ...     v = tf.Variable(parallel.pack([tf.constant(1.0), tf.constant(2.0)]))
        ...     print(type(v).__name__, [float(c) for c in parallel.unpack(v.read_value())])
        ParallelVariable [1.0, 2.0]
    """

    def __init__(self, oh_parallel, **kwargs):
        super().__init__(**kwargs)
        self._oh_bind(oh_parallel)


def _function_variable_class():
    """`ParallelFunctionVariable`, made on first use (TensorFlow's tf.function variable
    class lives in a module the handler otherwise does not need)."""
    cls = globals().get("ParallelFunctionVariable")
    if cls is None:
        from tensorflow.python.eager.polymorphic_function import polymorphic_function  # pylint: disable=import-outside-toplevel

        class ParallelFunctionVariable(_PerComponentSaving,
                                       polymorphic_function.UnliftedInitializerVariable):
            """A variable a tf.function creates on its first call in an oh.ParallelHandler
            scope: as tf.function's own variables, its buffers are made outside the
            function (one per component) and initialized in it, under
            `tf.cond(is_initialized)`, so an initial value computed in the function
            (`tf.Variable(tf.zeros(...))`, from the function's inputs' components) needs
            no lifting out of it."""

            def __init__(self, oh_parallel, **kwargs):
                super().__init__(**kwargs)
                self._oh_bind(oh_parallel)

        cls = globals()["ParallelFunctionVariable"] = ParallelFunctionVariable
    return cls


class _NullScope:
    def __enter__(self):
        return None

    def __exit__(self, *exc_info):
        return False


@_ops.RegisterGradient("ParallelPack")
def _parallel_pack_gradient(op, grad):
    n = op.get_attr("N")
    parts = _copies.parallel_unpack(grad, n)
    out = []
    for i, (x, g) in enumerate(zip(op.inputs, parts)):
        # An input on the handler gave only its component i to the packed tensor: its
        # other components get a zero gradient, not copies of component i's. A symbolic
        # input is one of a function the handler replays, where every tensor is on it.
        masked = lambda: _copies.parallel_pack(
            [g if j == i else tf.zeros_like(g) for j in range(n)])
        stack = _stack_of(x)
        if stack is not None:
            with _scope.handler(stack):
                out.append(masked())
        elif isinstance(x, _ops.EagerTensor):
            out.append(g)
        else:
            out.append(masked())
    return out


@_ops.RegisterGradient("ParallelUnpack")
def _parallel_unpack_gradient(op, *grads):
    grads = [tf.zeros_like(o) if g is None else g for o, g in zip(op.outputs, grads)]
    # The gradients are ordinary tensors: pack them on the stack the forward input lived
    # on (a tf.GradientTape may run this outside every scope).
    stack = _stack_of(op.inputs[0])
    if stack is None or all(any(h is c for c in current_stack().handlers)
                            for h in stack.handlers):
        return _copies.parallel_pack(grads)
    with _scope.handler(stack):
        return _copies.parallel_pack(grads)
