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

The innermost subscriber of the `record.record_operation` patch (core/tf_patches/eager.py)
does the second; `call` notes each replayed forward call (`note_replayed_call`).

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
from tensorflow.python.eager import context as _context
from tensorflow.python.framework import indexed_slices as _indexed_slices
from tensorflow.python.framework import ops as _ops

from tf_ophandlers.core import scope as _scope
from tf_ophandlers.core import tf_patches
from tf_ophandlers.core.cache import BoundedCache
from tf_ophandlers.core.recording import notify_record
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

    __slots__ = ("dense", "nested_dense", "segment", "outer", "tangents")

    def __init__(self, dense, segment=(), outer=None, tangents=()):
        self.dense = dense
        self.tangents = tangents  # positions of its outputs that are forward-mode tangents
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
def replay_run(dense, segment=(), tangents=()):
    """Around the run of a replayed function on a tape's stack; yields its `ReplayRun`."""
    saved = _local.run
    run = _local.run = ReplayRun(dense, segment, saved, tangents)
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

    # The replayed call a tape records carries the accumulator's tangents as outputs
    # too: differentiated from tangent outputs only, an input none of them reads gets
    # None, as in TensorFlow, whose tapes get the JVP ops apart from the call (not the
    # zeros a call's backward function gives its inputs that other outputs read).
    tangents = run.tangents if run is not None and run.dense else ()
    reached = _outputs_reached(op_type) if tangents else None

    def backward(*args, missing=(), **kwargs):
        grads = backward_function(*args, **kwargs)
        if isinstance(grads, (list, tuple)):
            grads = [_densify(g) for g in grads]
            given = {k for k, a in enumerate(args) if a is not None and k not in missing}
            if reached is not None and len(reached) == len(grads) and given <= tangents:
                grads = [g if r & given else None for g, r in zip(grads, reached)]
            return grads
        return _densify(grads)
    # oh.GradientTape passes `missing`: the outputs it filled with zeros (TensorFlow's
    # backward of a call cannot fill an unknown shape itself).
    backward.reads_missing = reached is not None
    return backward


# forward function name -> per input, the output positions it reaches (or None).
_reached_cache = BoundedCache("functions.call_outputs_reached", 256)


def _outputs_reached(op_type):
    """For each input of function `op_type`, the frozenset of its outputs that read it
    (through any node: conservative for nodes with several outputs), or None."""
    if op_type in _reached_cache:
        return _reached_cache[op_type]
    try:
        fdef = _context.context().get_function_def(op_type)
    except Exception:  # pylint: disable=broad-except
        fdef = None
    result = None
    if fdef is not None:
        args = {a.name: i for i, a in enumerate(fdef.signature.input_arg)}
        nodes = {n.name: n for n in fdef.node_def}
        memo = {}

        def sources(ref):  # the inputs `ref` ("arg", "node:out:i", "^node") reads
            name = ref.lstrip("^").split(":")[0]
            if name in args:
                return frozenset((args[name],))
            if name not in memo:
                memo[name] = frozenset()  # (no cycles in a FunctionDef's data edges)
                memo[name] = frozenset().union(*[
                    sources(r) for r in nodes[name].input if not r.startswith("^")]) \
                    if name in nodes else frozenset()
            return memo[name]

        reached = [set() for _ in args]
        for k, out in enumerate(fdef.signature.output_arg):
            for i in sources(fdef.ret[out.name]):
                reached[i].add(k)
        result = [frozenset(r) for r in reached]
    _reached_cache[op_type] = result
    return result


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
    _record_on_tapes(op_type, output_tensors, input_tensors, backward_function,
                     forward_function)
    # Then the handlers that act on such records (an oh.ForwardAccumulator's JVP of a
    # tf.custom_gradient), as TensorFlow's accumulators do when the op is recorded.
    notify_record(op_type, output_tensors, input_tensors, backward_function,
                  forward_function)


def _record_on_tapes(op_type, output_tensors, input_tensors, backward_function,
                     forward_function):
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


def _wrap_record_operation(next_record):
    _previous[0] = next_record
    return _record_operation


tf_patches.subscribe("record.record_operation", "function call records",
                     _wrap_record_operation)
