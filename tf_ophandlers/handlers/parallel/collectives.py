"""Components of one op that must run at the same time (`oh.ParallelHandler`,
tf_ophandlers/handlers/parallel/handler.py): a TensorFlow collective (all-reduce, broadcast,
gather) or a function holding one waits in each component for all the others, so
dispatched one component after another the first would wait forever. TensorFlow's
ParallelDevice runs every op with a thread per device; the handler does so for these ops
only (other ops keep the cheaper one-thread dispatch).
"""
import contextlib
import queue
import threading

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context as _context
from tensorflow.python.eager import executor as _executor
from tensorflow.python.framework import errors_impl as _error_codes
from tensorflow.python.framework import op_def_registry as _op_def_registry

from tf_ophandlers.extend import (
    BoundedCache, functions as _functions, PHYSICAL as _PHYSICAL, scope as _scope,
    state as _state)

COLLECTIVE_PREFIXES = ("Collective", "Nccl")
# op type -> whether its components must run at the same time; function names are unique
# in the eager context, so an entry for a function never goes stale.
_meets = BoundedCache("parallel.meets", 4096)


_keys = []
_GROUP_KEY_START = 1 << 20


def collective_keys():
    """One key allocator per process: collective instance keys must never repeat. Its
    group keys start far above 1, where tf.distribute's own allocators start (a
    MirroredStrategy's collectives in the same process would otherwise share group and
    instance keys with ours, and TensorFlow refuses or mismatches the second use)."""
    if not _keys:
        from tensorflow.python.distribute import cross_device_utils  # pylint: disable=import-outside-toplevel
        _keys.append(cross_device_utils.CollectiveKeys(group_key_start=_GROUP_KEY_START))
    return _keys[0]


_instance_lock = threading.Lock()


def instance_key(handler):
    """A collective instance key for the components of `handler` (from the process's
    allocator, which keeps one counter per device: all of them are advanced at once, so
    that they stay in step)."""
    keys = collective_keys()
    devices = list(handler.components)
    group = keys.get_group_key(devices)
    with _instance_lock:
        instance = {keys.get_instance_key(group, d) for d in devices}
    if len(instance) != 1:
        raise RuntimeError("oh.ParallelHandler: collective instance keys out of step: %s"
                           % sorted(instance))
    return instance.pop()


def call_time_instance_key(handler):
    """An int32 scalar of the function being traced whose value is a new instance key at
    each call (as MirroredStrategy's collective launcher keys a traced collective).

    A key fixed when the function is traced would be reused by every call: two calls at
    once (two threads) would share one collective instance, and a call with another
    shape (a function traced with an unknown dimension) would be refused, since
    TensorFlow keeps the shape of an instance's first run. The key is fed when the function is called
    (`capture_call_time_value`, in the outermost function graph: a loop body cannot take
    such a capture; its iterations are told apart by their frame anyway)."""
    from tensorflow.python.framework import ops  # pylint: disable=import-outside-toplevel
    graph = ops.get_default_graph()
    while getattr(graph, "is_control_flow_graph", False):
        graph = graph.outer_graph

    def key():
        # Evaluated eagerly as the call starts, maybe in the handler's scope: a plain
        # host tensor, which the call broadcasts to every component.
        with _scope.physical():
            return tf.constant(instance_key(handler), tf.int32)

    with graph.as_default():
        return graph.capture_call_time_value(key, tf.TensorSpec([], tf.int32))


# The collective of a traced all_reduce's gradient is keyed from its forward call's key:
# key + _GRADIENT_KEY_OFFSET (and again per further order). Far above the keys the
# allocator hands out, below the key that forms a group (fused_calls.py).
_GRADIENT_KEY_OFFSET = 1 << 28


def differentiable_traced_all_reduce(handler, tensor, timeout, key=None):
    """`traced_all_reduce` whose gradient is an all-reduce of the output gradient.

    The gradient's collective cannot take a call-time key of its own: in a backward
    function TensorFlow counts a call-time capture among its captured inputs but not among
    its inputs, so a tape outside the function recorded the call with no outputs and the
    gradient came back None. It is keyed from the forward call's key instead, a tensor
    the backward function receives from the forward call as TensorFlow's gradient
    functions receive any forward value."""
    if key is None:
        key = call_time_instance_key(handler)

    @tf.custom_gradient
    def reduce(t):
        def grad(dy):
            return differentiable_traced_all_reduce(handler, dy, timeout,
                                                    key + _GRADIENT_KEY_OFFSET)
        return traced_all_reduce(handler, t, timeout, key), grad

    return reduce(tensor)


def traced_all_reduce(handler, tensor, timeout, key=None):
    """The sum over the components of `handler` of `tensor`, a tensor of a function being
    traced in its scope: one `CollectiveReduceV2` on the tensor itself, which the call
    runs once per component (as TensorFlow's ParallelDevice runs a collective on a
    parallel tensor), each member on its component's device with the same call-time
    instance key.

    Not a call of the two-member function eager `all_reduce` uses, on the tensor's
    unpacked components: in a function called in the scope, the instance keys fed to that
    call are broadcast to the handler, so its collectives ran once per component, two
    members per device with one key, and TensorFlow's rendezvous failed at random
    ("Second consumer arrived for key", then every collective of the process)."""
    from tensorflow.python.ops import collective_ops  # pylint: disable=import-outside-toplevel
    devices = list(handler.components)
    return collective_ops.all_reduce_v2(
        tensor, group_size=len(devices), group_key=collective_keys().get_group_key(devices),
        instance_key=call_time_instance_key(handler) if key is None else key,
        merge_op="Add", final_op="Id",
        timeout=timeout or 0)


def meets_across_components(op):
    """Whether the components of `op` wait for each other: a collective op (all-reduce,
    broadcast, gather), or a function whose body or callees hold one. Run one after the
    other, the first component would wait forever for the second."""
    t = op.type
    meets = _meets.get(t)
    if meets is None:
        if t.startswith(COLLECTIVE_PREFIXES):
            meets = True
        elif _op_def_registry.get(t) is None:  # a function call op
            meets = any(b.startswith(COLLECTIVE_PREFIXES)
                        for b in _functions.body_op_types(t))
        else:
            meets = False
        _meets[t] = meets
    return meets


# After a component failed, how long the others may still take before they are taken to
# wait for it in a collective.
_FAILURE_GRACE_SECONDS = 2.0


def run_concurrently(handler, below, op, inputs):
    """Each component of `op` on its own thread (as TensorFlow's ParallelDevice runs
    every op), for ops whose components meet in a collective. The threads see the
    calling hook's dispatch state; each runs on a synchronous executor, so an
    asynchronous caller (`tf.experimental.async_scope`) does not queue a component
    behind another that waits for it."""
    n = len(handler.components)
    frames, current, mode, device = list(_state.frames), _state.current, _state.mode, \
        _state.device
    results, failures = [None] * n, [None] * n
    finished = queue.SimpleQueue()
    first_done = threading.Event()  # component 0, run on the calling thread, returned
    aborted = []

    def abort_if_first_waits():
        # A component failed while component 0 may wait for it in a collective on the
        # calling thread, which cannot watch: abort (as the watch below does).
        if not first_done.wait(_FAILURE_GRACE_SECONDS):
            _abort(handler)
            aborted.append(True)

    def run(i):
        st = _state  # this worker thread's own
        st.frames, st.current, st.mode, st.device = list(frames), current, mode, device
        try:
            with _sync_executor(), _scope.on_device(handler.components[i]):
                results[i] = below.execute(op, [v.components[i] for v in inputs])
        except BaseException as e:  # pylint: disable=broad-except
            failures[i] = e
            abort_if_first_waits()
        finally:
            st.frames, st.current, st.mode, st.device = [], _PHYSICAL, None, ""

    for i in range(1, n):
        _submit(run, i, finished.put)
    # Component 0 on the calling thread (one thread hand-off less per op).
    try:
        with _sync_executor(), _scope.on_device(handler.components[0]):
            results[0] = below.execute(op, [v.components[0] for v in inputs])
    except BaseException as e:  # pylint: disable=broad-except
        failures[0] = e
    first_done.set()
    finished.put(0)
    pending, failed = n, None  # failed: the component that failed first
    while pending and failed is None:
        i = finished.get()
        pending -= 1
        if failures[i] is not None:
            failed = i
    while pending:
        try:
            finished.get(timeout=_FAILURE_GRACE_SECONDS)
            pending -= 1
        except queue.Empty:
            # The rest wait in a collective for the failed component: abort TensorFlow's
            # collectives (as tf.distribute does when a peer fails) rather than hang.
            _abort(handler)
            aborted.append(True)
            deadline = _FAILURE_GRACE_SECONDS * 30  # they fail now; a thread stuck
            while pending:                          # elsewhere is left behind
                try:
                    finished.get(timeout=deadline)
                    pending -= 1
                except queue.Empty:
                    pending = 0
    if failed is not None:
        first = failures[failed]
        if isinstance(first, tf.errors.OpError):
            message = "oh.ParallelHandler: op %s failed on component %s of %s%s: %s" % (
                op.type, handler.components[failed], handler.debug_string(),
                " (the other components waited for it in a collective; TensorFlow's "
                "collectives are aborted for this process after this: restart the "
                "program)" if aborted else "", first.message)
            # The same exception class (its code), with the handler, op and component.
            raise _error_codes.exception_type_from_error_code(first.error_code)(
                first.node_def, first.op, message) from first
        raise first
    return results


def _abort(handler):
    _context.context().abort_collective_ops(
        _error_codes.UNAVAILABLE, "oh.ParallelHandler: a component of %s failed"
        % handler.debug_string())


class _Worker:
    """A daemon thread that runs the components handed to it, one at a time. Workers are
    kept between ops (starting a thread per component cost more than a small training
    step's whole function call) and a component always gets an idle worker (a new one
    if none is idle), so a component never queues behind another that may wait for it
    in a collective (two threads using handlers at once)."""

    def __init__(self):
        self.tasks = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True,
                         name="oh.ParallelHandler component").start()

    def _loop(self):
        while True:
            fn, arg, done = self.tasks.get()
            try:
                fn(arg)
            finally:
                # Idle again before the caller learns the component finished: its next
                # op then finds this worker instead of starting another thread.
                with _idle_lock:
                    _idle.append(self)
                done(arg)


_idle = []  # workers waiting for a component
_idle_lock = threading.Lock()


def _submit(fn, arg, done):
    """Runs `fn(arg)` on an idle worker thread, then `done(arg)` once that worker can
    take the next component."""
    with _idle_lock:
        worker = _idle.pop() if _idle else None
    if worker is None:
        worker = _Worker()
    worker.tasks.put((fn, arg, done))


@contextlib.contextmanager
def _sync_executor():
    """A synchronous executor for this thread if its executor is asynchronous.

    Through raw executor handles, not `context().is_async()` / `executor_scope`: those
    make an `Executor` wrapper whose `__del__` waits for every op pending on the
    executor, which the threads share. Ops on a remote device (a task of a connected
    cluster) stay pending there while they run, so one component's thread would wait
    for another's function call, and that call waits in its collective for this one.
    """
    ctx = _context.context()
    ctx.ensure_initialized()
    handle = ctx._handle  # pylint: disable=protected-access
    current = pywrap_tfe.TFE_ContextGetExecutorForThread(handle)
    try:
        if not pywrap_tfe.TFE_ExecutorIsAsync(current):
            yield
            return
        sync = _executor.new_executor(enable_async=False)
        pywrap_tfe.TFE_ContextSetExecutorForThread(handle, sync.handle())
        try:
            yield
        finally:
            pywrap_tfe.TFE_ContextSetExecutorForThread(handle, current)
    finally:
        pywrap_tfe.TFE_DeleteExecutor(current)  # the wrapper only: the executor stays
