"""How tapes outside a replaying handler record a replayed function call.

When a tape watches an argument of a `tf.function` call, TensorFlow's ConcreteFunction
call path runs the function's *forward* function (``__forward_f_123``) with recording
stopped and then records the call itself (`record.record_operation`) with the
*original* function's backward function. Under a handler that replays the call and
changes representations (DataFormat keeps data channels-last, Mesh shards it,
vectorized_map batches it), that record is wrong for every tape that sees the
handler's physical tensors, and fragile for one that sees its logical tensors:

- **Tapes at or below the replay's bottom** (`oh.GradientTape` under the handler) must
  see the *replayed* function, whose inputs and outputs are the tensors they track:
  `call` runs the replayed ConcreteFunction with recording on there, so TensorFlow's
  function gradient machinery records it with the replayed function's forward and
  backward functions. The record of the original call that follows is then skipped
  for those tapes (`replayed_call`, asked by the tape hooks).
- **TensorFlow's tapes** (`tf.GradientTape`, recording the logical tensors): the record
  of the original call is kept, but its backward function runs on the stack the call
  ran on, so it is replayed through the same handlers (the backward's channels-first
  kernels become channels-last ones), whatever stacks the gradients live on.

A "runtime" patch of `record.record_operation` (registered in core/tf_patches.py) does
the second; `call` notes each replayed forward call (`note_replayed_call`).

Dense gradients: TensorFlow converts a call's tf.IndexedSlices gradients to tensors when
forward-mode tangents reach its arguments (ConcreteFunction's ``input_tangents``). A
replay under an `oh.ForwardAccumulator` passes tangents as plain tensors, so TensorFlow
would not; `call` asks the segment's handlers (`function_gradients_dense`) and the
records of both the original call and the replayed one get a backward function that
densifies (`densified`, also used by the oh.GradientTape hooks). The flag belongs to
one replayed call (`ReplayRun`, around its run on a tape's stack): a call replayed
inside that run (by handlers below the tape) has its own, and tells the enclosing run
if its gradients are dense (tangents of an accumulator further down reached it, so they
reached the enclosing call too).
"""
import contextlib
import threading

from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import record as _record
from tensorflow.python.framework import indexed_slices as _indexed_slices
from tensorflow.python.framework import ops as _ops

from tf_ophandlers.core import scope as _scope
from tf_ophandlers.core import tf_patches
from tf_ophandlers.core.stack import PHYSICAL, current_stack

_FORWARD_PREFIX = "__forward_"  # TensorFlow's forward functions (ConcreteFunction)


class _Local(threading.local):
    def __init__(self):
        super().__init__()
        self.noted = None  # the last replayed forward call, until TensorFlow records it
        self.recording = None  # the call whose record is being made
        self.run = None  # the ReplayRun of the replayed call being run on a tape's stack


_local = _Local()


class ReplayedCall:
    """A replayed forward call about to be recorded: its op type and the stack it ran
    on (whose tapes recorded the replayed function already)."""

    __slots__ = ("op_type", "stack", "dense")

    def __init__(self, op_type, stack, dense=False):
        self.op_type = op_type
        self.stack = stack
        self.dense = dense  # its gradients are densified (tangents on its arguments)

    def recorded_by(self, handler):
        """Whether `handler` (a tape) is on the call's stack, so it recorded the replay."""
        return any(h is handler for h in self.stack.handlers)


def is_forward_call(op_type):
    """Whether `op_type` is the forward function TensorFlow runs for a call it records."""
    return op_type.startswith(_FORWARD_PREFIX)


@contextlib.contextmanager
def recording_restarted():
    """Lets tapes record inside TensorFlow's function call (which stops recording)."""
    stopped = pywrap_tfe.TFE_Py_TapeSetIsStopped()
    if stopped:
        pywrap_tfe.TFE_Py_TapeSetRestartOnThread()
    try:
        yield
    finally:
        if stopped:
            pywrap_tfe.TFE_Py_TapeSetStopOnThread()


def note_replayed_call(op_type, stack, dense=False):
    """Called by `call` after a replayed forward call `op_type` ran on `stack`."""
    _local.noted = ReplayedCall(op_type, stack, dense)
    if dense and _local.run is not None:
        _local.run.nested_dense = True  # the enclosing call's tangents reached this one


class ReplayRun:
    """One replayed call running on a tape's stack: whether the record of it that
    TensorFlow makes then densifies its gradients (`dense`), and whether a call replayed
    inside the run had dense gradients (`nested_dense`)."""

    __slots__ = ("dense", "nested_dense", "segment", "outer")

    def __init__(self, dense, segment=(), outer=None):
        self.dense = dense
        self.nested_dense = False
        self.segment = segment  # the stacks that replayed it (their handlers above)
        self.outer = outer  # the run this one runs in, if any


def replays_running():
    """The `ReplayRun`s running on this thread, innermost first."""
    run = _local.run
    while run is not None:
        yield run
        run = run.outer


@contextlib.contextmanager
def replay_run(dense, segment=()):
    """Around the run of a replayed function on a tape's stack; yields its `ReplayRun`."""
    saved = _local.run
    run = _local.run = ReplayRun(dense, segment, saved)
    try:
        yield run
    finally:
        _local.run = saved


def _densify(gradient):
    if isinstance(gradient, _indexed_slices.IndexedSlices):
        return _ops.convert_to_tensor(gradient)
    return gradient


def densified(op_type, backward_function, original=True):
    """`backward_function` of a record of `op_type` being made, converting
    tf.IndexedSlices gradients to tensors if the record is of a call with tangents on
    its arguments (as TensorFlow does for such calls): the replayed call a tape below
    the handlers records, and with `original` the original call (TensorFlow's tapes)."""
    noted = replayed_call(op_type) if original else None
    run = _local.run  # (only TensorFlow's record of the call run, a forward function's)
    if not ((run is not None and run.dense and is_forward_call(op_type))
            or (noted is not None and noted.dense)):
        return backward_function

    def backward(*args, **kwargs):
        grads = backward_function(*args, **kwargs)
        if isinstance(grads, (list, tuple)):
            return [_densify(g) for g in grads]
        return _densify(grads)
    return backward


def replayed_call(op_type):
    """The `ReplayedCall` TensorFlow is recording now as `op_type`, or None."""
    for noted in (_local.recording, _local.noted):
        if noted is not None and noted.op_type == op_type:
            return noted
    return None


def _placed(stack):
    current = current_stack()
    if stack is current or all(any(h is c for c in current.handlers) for h in stack.handlers):
        return contextlib.nullcontext()
    return _scope.handler(stack)


def _on_stack(backward_function, stack):
    def backward(*args, **kwargs):
        with _placed(stack):
            return backward_function(*args, **kwargs)
    return backward


_previous = [None]


def _record_operation(op_type, output_tensors, input_tensors, backward_function,
                      forward_function=None):
    backward_function = densified(op_type, backward_function)
    noted = _local.noted
    if noted is not None and noted.op_type == op_type:
        _local.noted = None
        if noted.stack is not PHYSICAL:
            backward_function = _on_stack(backward_function, noted.stack)
    else:
        noted = None
    saved = _local.recording
    _local.recording = noted
    try:
        return _previous[0](op_type, output_tensors, input_tensors, backward_function,
                            forward_function)
    finally:
        _local.recording = saved


def _install():
    _previous[0] = _record.record_operation
    _record.record_operation = _record_operation


tf_patches.register(
    "function call records", "tensorflow.python.eager.record.record_operation",
    "TensorFlow records a tf.function call with the original function's backward "
    "function; for a call replayed by handlers it must run on the stack the call ran on "
    "(replayed through the same handlers), and tapes under the handlers must not get "
    "that record (they recorded the replayed function).", "runtime", _install, None)
