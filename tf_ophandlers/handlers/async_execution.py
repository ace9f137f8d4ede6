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
import threading
import weakref

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context as _context
from tensorflow.python.eager import executor as _executor
from tensorflow.python.framework import ops as _ops

from tf_ophandlers.core import functions as _functions
from tf_ophandlers.core import shapes
from tf_ophandlers.core.cache import BoundedCache
from tf_ophandlers.core.handler import OpHandler
from tf_ophandlers.core.op import Op
from tf_ophandlers.core.stack import PHYSICAL, next_stack, stack_of, tensor_key

_RESOURCE = tf.resource
_RESOURCE_ENUM = _RESOURCE.as_datatype_enum
_EagerTensor = _ops.EagerTensor


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


class AsyncValue:
    """The representation: a tensor of the next stack, maybe not computed yet, its
    inferred spec (None when unknown: reading its shape then waits) and, for a small
    integer tensor that came from outside (an axis, a shape), its value."""

    __slots__ = ("tensor", "spec", "known", "part")

    def __init__(self, tensor, spec=None, known=None, part=None):
        self.tensor = tensor
        self.spec = spec
        self.known = known
        self.part = part  # its part of an op signature (see _infer); None if unknown

    dtype = property(lambda self: self.tensor.dtype)  # known without waiting
    device = property(lambda self: self.tensor.device)

    def __repr__(self):
        return "AsyncValue(%s, %s)" % (self.tensor.dtype.name, self.spec)


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

    @staticmethod
    def needs_copy(op, index):
        # Inputs from elsewhere (constants, physical tensors) enter as they are.
        return False

    def execute(self, op, inputs):
        # Runs for every op of the scope: one pass over the inputs collects the tensors,
        # the signature parts (_infer) and whether a variable handle is among them.
        tensors, parts = [], []
        resource = False
        for v in inputs:
            if type(v) is AsyncValue:
                t = v.tensor
                part = v.part
                if part is None:
                    part = (t.dtype, None, None)
            else:  # from outside the handler (a constant, a physical tensor): computed
                t = v
                part = _outside_part(v)
            if part[0] is _RESOURCE:
                resource = True
            tensors.append(t)
            parts.append(part)
        active = getattr(_threads, "queues", None)
        queue = active[-1] if active else None  # None: outside every scope, it runs now
        try:
            outputs = next_stack().execute(op, tensors)  # queued, returns at once
        except tf.errors.OpError:
            # An earlier queued op failed (TensorFlow refuses new ops until the error is
            # read): this op reports it, and the handler keeps working after it.
            if queue is not None:
                queue.executor.clear_error()
            raise
        if resource and op.type == "ReadVariableOp" and type(inputs[0]) is not AsyncValue:
            return [AsyncValue(outputs[0], *self._read_spec(op, inputs[0], queue))]
        enums = op.output_dtype_enums
        if queue is not None and (resource or enums is None or op.type in _OPAQUE):
            _note_reshapes(queue, op, tensors)
        inferred = _infer(op, inputs, parts) if enums is not None else None
        if inferred is None:
            return [o if _is_resource(o) else AsyncValue(o) for o in outputs]
        if len(outputs) == 1:  # most ops
            (spec, part), = inferred
            o = outputs[0]
            return [o if part[0] is _RESOURCE else AsyncValue(o, spec, None, part)]
        return [o if part[0] is _RESOURCE else AsyncValue(o, spec, None, part)
                for o, (spec, part) in zip(outputs, inferred)]

    def _read_spec(self, op, handle, queue):
        """(spec, known, part) of a variable read, from the variable's shape.

        A variable's shape is not in its eager handle, and the read is queued: ask
        `VariableShape` on a synchronous executor, which waits only for the handle
        itself (a variable created in the scope). A variable whose shape a queued op may
        have changed (`_note_reshapes`) is read with an unknown shape: its users wait for
        the read itself, as for a variable whose shape cannot be read yet.
        """
        if queue is not None and (queue.opaque or tensor_key(handle) in queue.assigned):
            return None, None, None
        saved = _swap_executor(self._sync_executor.handle())
        try:
            # On physical devices directly: through the stacks below, an Async there
            # would turn reading the result into a synchronization of its queue.
            (shape,) = PHYSICAL.execute(_variable_shape_op(), [handle])
            dims = tuple(int(d) for d in shape.numpy())
        except tf.errors.OpError:
            return None, None, None
        finally:
            _restore_executor(saved)
        dtype = op.attrs["dtype"]
        return tf.TensorSpec(dims, dtype), None, (dtype, dims, None)

    def copy_on(self, tensor):
        source = stack_of(tensor)
        if source is not None and source.handler is self:
            # A tensor of this handler from an earlier merge: its tensor, moved onto
            # this merge's next stack (its spec stays; nothing waits).
            value = source.unwrap(tensor)
            return AsyncValue(next_stack().copy_on(value.tensor), value.spec,
                              value.known, value.part)
        # A tensor from outside the handler is computed (ops of the scope run here):
        # its shape is known without waiting.
        tensor = super().copy_on(tensor)
        spec = shapes.spec_of(tensor)
        return AsyncValue(tensor, spec.spec, spec.value, _part(tensor, spec.value))

    def copy_off(self, value, device):
        # A value leaving the handler (.numpy(), printing) waits for its op.
        return self._computed(value)

    def value_dtype(self, value):
        return value.tensor.dtype

    def num_dims(self, value):
        spec = value.spec
        if spec is not None and spec.shape.rank is not None:
            return spec.shape.rank
        return self._computed(value).shape.rank

    def dim(self, value, index):
        spec = value.spec
        if spec is not None and spec.shape.rank is not None and spec.shape[index] is not None:
            return spec.shape[index]
        d = self._computed(value).shape[index]
        return -1 if d is None else d

    def _computed(self, value):
        """`value`'s tensor once its op has run; the op's error (or an earlier one that
        poisoned it) raises here.

        Waits for this value only, not the whole queue: a `tf.py_function` body runs on
        the executor's own thread, where waiting for the queue would never return.
        """
        tensor = value.tensor
        try:
            tensor._shape_tuple()  # pylint: disable=protected-access
        except tf.errors.OpError:
            for queue in self._queues():
                queue.executor.clear_error()
            raise
        return tensor

    def static_value(self, value):
        return None

    def tensor_debug_string(self, value):
        return _ops.value_text(self._computed(value))  # printing waits for the value

    def function_input(self, value):
        return None, [value.tensor]

    def function_output(self, summary, tensors):
        (tensor,) = tensors
        return AsyncValue(tensor)


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


def _note_reshapes(queue, op, tensors):
    """Records on `queue` which variables the queued `op` may reshape."""
    if op.output_dtype_enums is None:
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
    """A computed tensor's part of an op signature."""
    return shapes.signature_part(tensor.dtype, tensor._shape_tuple(), known)  # pylint: disable=protected-access


# Dtypes whose tensors never carry a known value in a signature part (shapes.known_value
# reads small integer and bool tensors only), by enum: a float constant made afresh for
# every op (`x * 1.01`) is described without the cache below.
_VALUELESS = {d.as_datatype_enum: d for d in (
    tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.complex64, tf.complex128,
    tf.string)}

# id of a tensor from outside the handler -> (weak reference to it, its signature part):
# a constant or a captured tensor used by op after op is described once. The reference
# check makes a reused id harmless.
_outside_parts = BoundedCache("async.outside_parts", 1024)


def _outside_part(tensor):
    if type(tensor) is _EagerTensor:
        dtype = _VALUELESS.get(tensor._datatype_enum())  # pylint: disable=protected-access
        if dtype is not None:  # no value is carried (shapes.known_value): no cache
            return shapes.signature_part(dtype, tensor._shape_tuple(), None)  # pylint: disable=protected-access
    hit = _outside_parts.get(id(tensor))
    if hit is not None and hit[0]() is tensor:
        return hit[1]
    part = _part(tensor, shapes.known_value(tensor))
    try:
        _outside_parts[id(tensor)] = (weakref.ref(tensor), part)
    except TypeError:  # not weakly referenceable (a symbolic tensor): not cached
        pass
    return part


def _spec_part(spec):
    shape = spec.shape
    return shapes.signature_part(
        spec.dtype, None if shape.rank is None else tuple(shape.as_list()), None)


# op signature -> [(TensorSpec, part)] per output, or None (not inferable)
_inferred = BoundedCache("async.inferred", 16384)


def _infer(op, inputs, parts):
    """The outputs' specs and signature parts, from TensorFlow's shape functions (cached
    per op signature, with the parts precomputed so that a hit costs a lookup). `parts`:
    the inputs' signature parts (`Async.execute` collects them)."""
    key = (op.type, op.attrs_key(), tuple(parts))
    try:
        return _inferred[key]
    except KeyError:
        pass
    try:
        specs = [_input_spec(v) for v in inputs]
        if op.type != "EnsureShape" and shapes.assumes_success(specs):
            # (tf.ensure_shape declares the shape: it is the program's own assertion.)
            # The shape function would assume the op succeeds; shapes wait for the kernel.
            raise ValueError("inference would assume the op succeeds")
        specs = shapes.infer(op, specs)  # pylint: disable=protected-access
        result = [(s, _spec_part(s)) for s in specs]
    except Exception:  # pylint: disable=broad-except
        # Not inferable (or invalid: the kernel's error surfaces at the next
        # synchronization point, as the op's own error): shapes wait.
        result = None
    _inferred[key] = result
    return result


def _input_spec(value):
    """The shape-inference input for `value`, never waiting for a kernel."""
    if type(value) is AsyncValue:
        spec = value.spec
        if spec is None:
            spec = tf.TensorSpec(None, value.tensor.dtype)
        return shapes.Spec(spec, value.known)
    return shapes.spec_of(value)
