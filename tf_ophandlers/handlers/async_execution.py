"""`Async`: ops of the scope are queued on an asynchronous executor and control returns
to Python at once (RFC "Asynchronous execution").

>>> import tensorflow as tf, tf_ophandlers as oh
>>> with oh.Async() as runner:
...     y = tf.matmul(tf.ones([256, 256]), tf.ones([256, 256]))  # queued, returns at once
...     z = tf.reduce_sum(y)
>>> float(z)                           # a synchronization point: waits for the value
16777216.0

Every op placed on the handler (and the ops of the handlers inside it) is launched on
TensorFlow's asynchronous eager executor owned by the handler. Its outputs are tensors
of the handler whose shapes come from TensorFlow's shape functions (cached per op
signature, as `oh.ShapeInference`), so Python code that reads shapes — `tf.matmul`,
Keras layers — keeps issuing ops instead of waiting for the kernels; only a shape that
depends on computed values (`tf.reshape(x, tf.shape(y))` with `y` pending) waits. The
handler is transparent (`tensor.device` is the physical device).

An error — a bad shape, a failed check — does not interrupt the program where the op was
issued: it surfaces at the next synchronization point as the TensorFlow error of the
failing op, whose message names it. Synchronization points: reading a value that depends
on the failed op (`.numpy()`, printing, a Python decision), issuing the next op after
TensorFlow has seen the failure, `runner.sync()` and leaving the scope. After an error
the queue is cleared, so the handler can be used again. Queues are per thread, as
TensorFlow's executors are: nested `Async` scopes on a thread share the outermost one's
queue (program order and errors are kept), and a handler used by two threads keeps
their ops and errors apart; `sync()` waits for what the calling thread queued.
"""
import functools
import operator
import threading

import numpy as np
import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context as _context
from tensorflow.python.eager import executor as _executor
from tensorflow.python.framework import dtypes as _dtypes
from tensorflow.python.framework import op_def_registry
from tensorflow.python.framework import ops as _ops

from tf_ophandlers.extend import (
    async_hook_in_c, BoundedCache, CopyOffError, execute_physical, functions as _functions,
    never_copy, next_stack, Op, OpHandler, PHYSICAL, shapes, stack_of, state, tensor_key)

_RESOURCE = tf.resource
_RESOURCE_ENUM = _RESOURCE.as_datatype_enum
_EagerTensor = _ops.EagerTensor


def _enum_of(t):
    """The dtype enum of `t` (a tensor of the next stack)."""
    if type(t) is _EagerTensor:
        return t._datatype_enum()  # pylint: disable=protected-access
    return t.dtype.as_datatype_enum


def _is_resource(t):
    """Whether `t` (a tensor of the next stack) is a resource handle, cheaply for eager
    tensors (their `dtype` property is Python; this runs per input and output of every
    op)."""
    if type(t) is _EagerTensor:
        return t._datatype_enum() == _RESOURCE_ENUM  # pylint: disable=protected-access
    return t.dtype is _RESOURCE


def _swap_executor(handle):
    """Makes `handle` this thread's executor; returns the previous one (a raw handle).

    Raw handles, not `context().executor`: that property returns a new `Executor`
    wrapper whose `__del__` waits for every op queued on it, a hidden synchronization.
    """
    ctx = _context.context()
    ctx.ensure_initialized()
    previous = pywrap_tfe.TFE_ContextGetExecutorForThread(ctx._handle)  # pylint: disable=protected-access
    pywrap_tfe.TFE_ContextSetExecutorForThread(ctx._handle, handle)  # pylint: disable=protected-access
    return previous


def _restore_executor(previous):
    ctx = _context.context()
    pywrap_tfe.TFE_ContextSetExecutorForThread(ctx._handle, previous)  # pylint: disable=protected-access
    pywrap_tfe.TFE_DeleteExecutor(previous)  # the wrapper only: the executor is the context's


@functools.cache
def _variable_shape_op():
    return Op.create("VariableShape", out_type=tf.int64)


# A signature part describes one input of an op for the shape-inference cache:
# ``(dtype enum, dims, value)`` with dims a tuple (None entries for unknown axes) or None
# (unknown rank), and value the bytes of a small integer tensor's value (an axis, a
# shape) or None. Enums, not `tf.DType`s: a DType's hash is a call into pybind11, and the
# cache key hashes every part of every op.
_AS_DTYPE = {d.as_datatype_enum: d for d in _dtypes._INTERN_TABLE.values()}  # pylint: disable=protected-access

# The representation of a tensor of the handler: a plain tuple ``(tensor, part, dtype)``
# of a tensor of the next stack (maybe not computed yet), its signature part (dims None:
# its shape is not known without waiting) and its `tf.DType`. A tuple, built without a
# Python call: the hook makes one per output of every op.
TENSOR, PART, DTYPE = 0, 1, 2


def async_value(tensor, part):
    """A representation for `tensor` described by `part`."""
    return (tensor, part, _AS_DTYPE[part[0]])


class _Queue:
    """An asynchronous executor and what is known of the ops queued on it since the last
    synchronization: which variables may have changed shape."""

    __slots__ = ("executor", "assigned", "opaque")

    def __init__(self):
        self.executor = _executor.new_executor(enable_async=True)
        self.assigned = set()  # tensor keys of variable handles a queued op may reshape
        self.opaque = False    # a queued op may assign any variable (a function call)

    def wait(self):
        try:
            self.executor.wait()
        finally:
            self.executor.clear_error()
            self.assigned.clear()
            self.opaque = False


_threads = threading.local()  # .queues: the queues of this thread's open Async scopes


def _active_queues():
    queues = getattr(_threads, "queues", None)
    if queues is None:
        queues = _threads.queues = []
    return queues


class Async(OpHandler):
    """Runs the ops of its scope asynchronously; errors surface at synchronization.

    Args:
      sync_on_exit: wait for the queued ops (and raise their error) when the outermost
        scope of the handler closes. Default True, as a `with` block reads sequentially.

    Examples:
        >>> with oh.Async():
        ...     y = tf.matmul(tf.ones([2, 2]), tf.ones([2, 2]))   # queued
        ...     print(y.shape)                                     # known at once
        (2, 2)
        >>> y.numpy().tolist()
        [[2.0, 2.0], [2.0, 2.0]]
    """

    transparent = True
    replays_functions = False  # a function call is one queued op
    TYPE_NAME = "ASYNC"

    def __init__(self, sync_on_exit=True):
        self.sync_on_exit = sync_on_exit
        self._sync_executor = _executor.new_executor(enable_async=False)
        # Per thread (TensorFlow's executors are per thread, and so are the queues, so
        # that one thread's failure never surfaces on another): `own`, this handler's
        # queue on the thread; `queue`, the one its latest scope used (its own, or that
        # of an enclosing Async); `depth`; `saved`, the executor to restore.
        self._local = threading.local()

    def _queues(self):
        """The queues this handler issued to on this thread."""
        local = self._local
        candidates = (getattr(local, "own", None), getattr(local, "queue", None))
        return list(dict.fromkeys(q for q in candidates if q is not None))

    def debug_string(self):
        return "Async()"

    def scope_entered(self):
        local = self._local
        depth = getattr(local, "depth", 0)
        if depth == 0:
            # The executor is per thread: ops issued here, including those the dispatcher
            # runs for handlers inside this one, go to this queue. Inside another Async
            # scope, the queue is that one's: one queue keeps program order, and each
            # handler's synchronization waits for everything issued before it.
            active = _active_queues()
            if active:
                local.queue = active[-1]
            else:
                if getattr(local, "own", None) is None:
                    local.own = _Queue()
                local.queue = local.own
            local.saved = _swap_executor(local.queue.executor.handle())
            active.append(local.queue)
        local.depth = depth + 1

    def scope_exited(self):
        local = self._local
        local.depth -= 1
        if local.depth == 0:
            _active_queues().pop()
            _restore_executor(local.saved)
            if self.sync_on_exit:
                self.sync()

    def sync(self):
        """Waits for every op this thread queued through the handler; raises the first
        error of a failed op (the queue is then cleared, so the handler keeps working)."""
        error = None
        for queue in self._queues():
            try:
                queue.wait()
            except tf.errors.OpError as e:
                error = error or e
        if error is not None:
            raise error

    # -- the handler ----------------------------------------------------------------------

    #: Inputs from elsewhere (constants, physical tensors) enter as they are; with
    #: `never_copy` the stack answers the C++ path's per-input question in C.
    needs_copy = staticmethod(never_copy)

    changes_computation = False  # runs each op as it is, later

    def execute(self, op, inputs):
        # Runs for every op of the scope (the C++ per-op path calls it): one pass over
        # the inputs collects the tensors and their signature parts.
        op_type = op.type
        kind = _op_kinds.get(op_type) or _op_kind(op_type)
        tensors, parts = [], []
        resource = False
        for v in inputs:
            if type(v) is tuple:  # a representation
                tensors.append(v[0])
                parts.append(v[1])
                continue
            # From outside the handler (a constant, a physical tensor): computed.
            tensors.append(v)
            if type(v) is _EagerTensor and v._datatype_enum() in _VALUELESS:  # pylint: disable=protected-access
                # No value is carried (shapes.known_value): a float constant made afresh
                # for every op (`x * 1.01`) is described directly.
                part = (v._datatype_enum(), v._shape_tuple(), None)  # pylint: disable=protected-access
            else:
                part = _outside_part(v)
                if part[0] == _RESOURCE_ENUM:
                    resource = True
            parts.append(part)
        st = state
        below = st.frames[-1].next  # next_stack()
        try:
            if below is PHYSICAL and st.mode is None:
                # PHYSICAL.execute without its frame (copy ops never reach execute).
                outputs = execute_physical(op, tensors, st.device)  # queued, returns at once
            else:
                outputs = below.execute(op, tensors)
        except tf.errors.OpError:
            # An earlier queued op failed (TensorFlow refuses new ops until the error is
            # read): this op reports it, and the handler keeps working after it.
            active = getattr(_threads, "queues", None)
            if active:
                active[-1].executor.clear_error()
            raise
        if resource or kind >= _FUNCTION:
            active = getattr(_threads, "queues", None)
            queue = active[-1] if active else None  # None: outside every scope
            if resource and op_type == "ReadVariableOp" and type(inputs[0]) is not tuple:
                return [async_value(outputs[0], self._read_part(op, inputs[0], queue))]
            if queue is not None:
                _note_reshapes(queue, op, tensors, kind == _FUNCTION)
        if kind == _FUNCTION:
            inferred = None
        else:
            key = (op_type, None if kind == _IMPLIED else op.attrs_key(), tuple(parts))
            inferred = _inferred.get(key, _MISS)
            if inferred is _MISS:
                inferred = _infer(op, key, parts)
        if inferred is None:
            return [o if _is_resource(o) else async_value(o, (_enum_of(o), None, None))
                    for o in outputs]
        if len(outputs) == 1:  # most ops
            part, dtype = inferred[0]
            o = outputs[0]
            return [o if dtype is _RESOURCE else (o, part, dtype)]
        return [o if dtype is _RESOURCE else (o, part, dtype)
                for o, (part, dtype) in zip(outputs, inferred)]

    def _read_part(self, op, handle, queue):
        """The signature part of a variable read, from the variable's shape.

        A variable's shape is not in its eager handle, and the read is queued: ask
        `VariableShape` on a synchronous executor, which waits only for the handle
        itself (a variable created in the scope). A variable whose shape a queued op may
        have changed (`_note_reshapes`) is read with an unknown shape: its users wait for
        the read itself, as for a variable whose shape cannot be read yet.
        """
        unknown = (op.attrs["dtype"].as_datatype_enum, None, None)
        if queue is not None and (queue.opaque or tensor_key(handle) in queue.assigned):
            return unknown
        saved = _swap_executor(self._sync_executor.handle())
        try:
            # On physical devices directly: through the stacks below, an Async there
            # would turn reading the result into a synchronization of its queue.
            (shape,) = PHYSICAL.execute(_variable_shape_op(), [handle])
            dims = tuple(int(d) for d in shape.numpy())
        except tf.errors.OpError:
            return unknown
        finally:
            _restore_executor(saved)
        return (unknown[0], dims, None)

    def copy_on(self, tensor):
        source = stack_of(tensor)
        if source is not None and source.handler is self:
            # A tensor of this handler from an earlier merge: its tensor, moved onto
            # this merge's next stack (its description stays; nothing waits).
            value = source.unwrap(tensor)
            return (next_stack().copy_on(value[TENSOR]),) + value[1:]
        # A tensor from outside the handler is computed (ops of the scope run here):
        # its shape is known without waiting.
        tensor = super().copy_on(tensor)
        return async_value(tensor, _outside_part(tensor))

    def copy_off(self, value, device):
        # A value leaving the handler (.numpy(), printing) waits for its op.
        return self._computed(value)

    #: ``value_dtype(value)``, the dtype of a representation: a C item getter (wrapping
    #: every output of every op asks it).
    value_dtype = operator.itemgetter(DTYPE)

    def num_dims(self, value):
        dims = value[PART][1]
        if dims is not None:
            return len(dims)
        return self._computed(value).shape.rank

    def dim(self, value, index):
        dims = value[PART][1]
        if dims is not None and dims[index] is not None:
            return dims[index]
        d = self._computed(value).shape[index]
        return -1 if d is None else d

    def _computed(self, value):
        """`value`'s tensor once its op has run; the op's error (or an earlier one that
        poisoned it) raises here.

        Waits for this value only, not the whole queue: a `tf.py_function` body runs on
        the executor's own thread, where waiting for the queue would never return.
        """
        tensor = value[TENSOR]
        try:
            tensor._shape_tuple()  # pylint: disable=protected-access
        except tf.errors.OpError:
            for queue in self._queues():
                queue.executor.clear_error()
            raise
        return tensor

    def static_value(self, value):
        return None

    def device_string(self, value, stack):
        return value[TENSOR].device  # transparent: the physical device

    def tensor_debug_string(self, value):
        return _ops.value_text(self._computed(value))  # printing waits for the value

    def function_input(self, value):
        return None, [value[TENSOR]]

    def function_output(self, summary, tensors):
        (tensor,) = tensors
        return async_value(tensor, (_enum_of(tensor), None, None))


# Ops on variables that never change a variable's shape. Any other op with a variable
# input may (AssignVariableOp of a variable created with an unknown shape).
_SHAPE_KEEPING = frozenset((
    "ReadVariableOp", "AssignAddVariableOp", "AssignSubVariableOp", "VariableShape",
    "VarIsInitializedOp", "ResourceGather", "ResourceGatherNd", "DestroyResourceOp",
    "ResourceStridedSliceAssign"))
_SHAPE_KEEPING_PREFIXES = ("ResourceApply", "ResourceSparseApply", "ResourceScatter")
# Ops that run arbitrary Python, which may assign any variable.
_OPAQUE = frozenset(("EagerPyFunc", "PyFunc", "PyFuncStateless"))
_ASSIGNS = frozenset(("AssignVariableOp", "AssignVariableXlaConcatND"))


def _may_reshape(op_type, attrs):
    """Whether an op with a variable input may change the variable's shape. An
    assignment may not when TensorFlow validates the shape (`validate_shape`, which
    `Variable.assign` sets for a variable of fully defined shape)."""
    if op_type in _ASSIGNS:
        validate = attrs.get("validate_shape")
        return not getattr(validate, "b", validate)
    return not (op_type in _SHAPE_KEEPING or op_type.startswith(_SHAPE_KEEPING_PREFIXES))


# function name -> "opaque", "reshapes" or None (a name is one function for the context's
# life).
_function_effects = BoundedCache("async.function_effects", 4096)


def _function_effect(name):
    """What a call of function `name` (and of the functions it calls) may do to the
    shapes of the variables it is given."""
    effect = _function_effects.get(name, False)
    if effect is not False:
        return effect
    nodes = [n for fdef in _functions.function_library([name]) for n in fdef.node_def]
    if any(n.op in _OPAQUE for n in nodes):
        effect = "opaque"
    elif any(n.op in _ASSIGNS and _may_reshape(n.op, n.attr) for n in nodes):
        effect = "reshapes"
    else:
        effect = None
    _function_effects[name] = effect
    return effect


def _note_reshapes(queue, op, tensors, function_call):
    """Records on `queue` which variables the queued `op` may reshape."""
    if function_call:
        # A function call: captured variables are its inputs; what its body (and the
        # functions it calls) may do to them decides.
        effect = _function_effect(op.type)
        if effect is None:
            return
        if effect == "opaque":
            queue.opaque = True
            return
    elif op.type in _OPAQUE:
        queue.opaque = True
        return
    elif not any(_is_resource(t) for t in tensors) or not _may_reshape(op.type, op.attrs):
        return
    for t in tensors:
        if _is_resource(t):
            queue.assigned.add(tensor_key(t))


def _part(tensor, known):
    """A computed tensor's signature part; `known` its small value (numpy) or None."""
    return (tensor.dtype.as_datatype_enum, tensor._shape_tuple(),  # pylint: disable=protected-access
            None if known is None else (known.dtype.str, known.tobytes(), known.shape))


# Dtypes whose tensors never carry a known value in a signature part (shapes.known_value
# reads small integer and bool tensors only), by enum: a float constant made afresh for
# every op (`x * 1.01`) is described without the cache below.
_VALUELESS = frozenset(d.as_datatype_enum for d in (
    tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.complex64, tf.complex128,
    tf.string, tf.variant))  # (resource handles too, but they are told apart)

# tensor_key (the TensorFlow handle) of a small integer tensor from outside the handler
# -> (the tensor, its signature part): a constant used by op after op (an axis, a shape)
# has its value read once. An outside tensor reaches `execute` as a new Python object
# sharing the handle at every op, hence the handle as key. The entry holds the tensor, so
# its handle cannot be freed and reused by another tensor while the entry lives.
_outside_parts = BoundedCache("async.outside_parts", 1024)


def _outside_part(tensor):
    """The signature part of a tensor from outside the handler (computed, or symbolic)."""
    if type(tensor) is not _EagerTensor:
        return _part(tensor, shapes.known_value(tensor))
    enum = tensor._datatype_enum()  # pylint: disable=protected-access
    if enum in _VALUELESS or enum == _RESOURCE_ENUM:  # no value is carried: no cache
        return (enum, tensor._shape_tuple(), None)  # pylint: disable=protected-access
    key = tensor_key(tensor)
    hit = _outside_parts.get(key)
    if hit is not None:
        return hit[1]
    try:
        known = shapes.known_value(tensor)
    except CopyOffError:
        # A tensor of a handler below that has no single value (oh.vectorized_map's
        # per-example ids): described by shape only, as a symbolic one.
        return (enum, tensor._shape_tuple(), None)  # pylint: disable=protected-access
    part = _part(tensor, known)
    if known is not None:
        _outside_parts[key] = (tensor, part)
    return part


# What the hook needs to know of an op type, asked once per type: op type ->
_IMPLIED = 1   # an op whose attributes all follow from its inputs' dtypes and count
_ATTRS = 2     # an op whose signature includes its attributes
_FUNCTION = 3  # a function call (no OpDef): not inferred; its body may reshape variables
_RUNS_PYTHON = 4  # tf.py_function and friends: may assign any variable
_op_kinds = BoundedCache("async.op_kinds", 4096)


def _op_kind(op_type):
    op_def = op_def_registry.get(op_type)
    if op_def is None:
        kind = _FUNCTION
    elif op_type in _OPAQUE:
        kind = _RUNS_PYTHON
    else:
        kind = _IMPLIED if _implied_by_inputs(op_def) else _ATTRS
    _op_kinds[op_type] = kind
    return kind


def _implied_by_inputs(op_def):
    """Whether every attribute of `op_def` is an input's type, type list or count, with
    at most one list input (so the flat inputs' dtypes and count determine them all):
    Tanh, Mul, AddV2 (only `T`) need no attribute bytes in their signature."""
    implied, lists = set(), 0
    for arg in op_def.input_arg:
        if arg.number_attr or arg.type_list_attr:
            lists += 1
        implied.update(a for a in (arg.type_attr, arg.type_list_attr, arg.number_attr) if a)
    return lists <= 1 and all(a.name in implied for a in op_def.attr)


# op signature (op type, attribute bytes or None, the inputs' parts) -> [(part, dtype)]
# per output, or None (not inferable)
_inferred = BoundedCache("async.inferred", 16384)
_MISS = object()


def _infer(op, key, parts):
    """Caches and returns the outputs' `(part, dtype)` for signature `key`, from
    TensorFlow's shape functions. `parts`: the inputs' signature parts."""
    try:
        specs = [_input_spec(p) for p in parts]
        if key[0] != "EnsureShape" and shapes.assumes_success(specs):
            # (tf.ensure_shape declares the shape: it is the program's own assertion.)
            # The shape function would assume the op succeeds; shapes wait for the kernel.
            raise ValueError("inference would assume the op succeeds")
        result = [(_spec_part(s), s.dtype) for s in shapes.infer(op, specs)]
    except Exception:  # pylint: disable=broad-except
        # Not inferable (or invalid: the kernel's error surfaces at the next
        # synchronization point, as the op's own error): shapes wait.
        result = None
    _inferred[key] = result
    return result


def _spec_part(spec):
    shape = spec.shape
    return (spec.dtype.as_datatype_enum,
            None if shape.rank is None else tuple(shape.as_list()), None)


def _input_spec(part):
    """The shape-inference input (`shapes.Spec`) of a signature part."""
    enum, dims, known = part
    value = None
    if known is not None:
        np_dtype, data, shape = known
        value = np.frombuffer(data, dtype=np.dtype(np_dtype)).reshape(shape)
    return shapes.Spec(tf.TensorSpec(dims, _AS_DTYPE[enum]), value)


# The C++ per-op path runs the hook's common case (an _IMPLIED op over PHYSICAL whose
# signature is in `_inferred`) in C from these tables (cc/handlers/async_execution/fast_async.cc).
async_hook_in_c(Async.execute, _op_kinds, _IMPLIED, _inferred, _RESOURCE, _VALUELESS)
