"""TensorFlow's tapes over a handler that changes what ops compute (a substitute).

A handler may run another op, dtype or layout in place of the op it got (Relu as
LeakyRelu, a MatMul in bfloat16). A `tf.GradientTape` outside its scope records the op
the user called, with that op's registered gradient: it would differentiate what did
not run. For a handler that may substitute (`OpHandler.changes_computation`), while a
TensorFlow tape or accumulator records, core/stack.py hands the execute hook to
`run_recorded`: the hook runs over a private `oh.GradientTape` (the handler merged onto
the tape's stack, so the tape records every op the hook runs below, whether by
`self.next.execute`, TensorFlow calls or a C handler's `execute_next`), and the record
is attached to the outputs' representations. TensorFlow's gradient function (one patch)
finds it through the outputs it keeps for the op and returns the gradient of what ran.

An op whose registered gradient keeps none of its outputs (MatMul's needs only the
inputs, so TensorFlow's tape drops the outputs) leaves nothing to find the record by:
`run_recorded` raises `oh.HandlerError` for it, naming the handler and the op, rather
than let the tape apply the op's own gradient.
"""
import threading

from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import imperative_grad as _imperative_grad
from tensorflow.python.eager import tape as _tape_lib
from tensorflow.python.framework import constant_op
from tensorflow.python.framework.ops import EagerTensor as _EagerTensor
from tensorflow.python.ops import array_ops

from tf_ophandlers.extend import (
    BoundedCache, current_stack, errors, handler as _scope, Op, payload,
    physical as _physical, register_substitute_rule, registries as _registries,
    representation_of, retrace as _retrace, stack_of, state as _state, tf_patches)

_ATTR = "_oh_substitute"  # the record, on an output's representation (an EagerTensor)
_original_gradient_function = [None]
_original_jvp_function = [None]
_probe = threading.local()  # .seen: a list while _kept_outputs probes an op type
# op type -> tuple of bools: which outputs TensorFlow's tape keeps for the op's gradient
_kept = BoundedCache("substitutes.kept_outputs", 1024)


class _Recorded:
    """What one substituted op ran, as a private oh.GradientTape recorded it."""

    __slots__ = ("tape", "op_type", "sources", "targets", "handler")

    def __init__(self, tape, op_type, sources, targets, handler):
        self.tape = tape
        self.op_type = op_type
        self.sources = sources    # the hook's inputs (None: not differentiable)
        self.targets = targets    # the hook's outputs the tape made (None: another)
        self.handler = handler

    def gradients(self, out_grads, num_inputs):
        """The gradient of what ran, for TensorFlow's backward pass."""
        targets, output_gradients = [], []
        for t, g in zip(self.targets, out_grads):
            if t is None or not _differentiable(t):
                continue
            targets.append(t)
            output_gradients.append(array_ops.zeros_like(t) if g is None else _below(g))
        sources = [s for s in self.sources if s is not None]
        if not targets or not sources:
            return [None] * num_inputs
        got = iter(self.tape.gradient(targets, sources, output_gradients=output_gradients))
        return [None if s is None else next(got) for s in self.sources]


def _below(gradient):
    """A gradient of a handler tensor as the tensor of the stack below its handlers
    (what the recorded ops ran on); a physical one as it is."""
    p = payload(gradient)
    while p is not None and isinstance(p[1], _EagerTensor):
        gradient = p[1]
        p = payload(gradient)
    return gradient


def _record_of(tensor):
    """The record attached to `tensor`'s representation (through tensor-valued levels)."""
    p = payload(tensor)
    while p is not None:
        value = p[1]
        record = getattr(value, _ATTR, None) if isinstance(value, _EagerTensor) else None
        if record is not None:
            return record
        p = payload(value) if isinstance(value, _EagerTensor) else None
    return None


def _gradient_function(op_name, attr_tuple, num_inputs, inputs, outputs, out_grads,
                       skip_input_indices, forward_pass_name_scope):
    seen = getattr(_probe, "seen", None)
    if seen is not None and op_name == seen[0]:
        seen.append(tuple(o is not None for o in outputs or ()))
        return [None] * num_inputs
    mode = _state.mode
    if mode is not None and getattr(mode, "retracing", False):
        # The tape inside a function body re-traced under the handler (core/functions/
        # retrace.py): the record of what ran is kept by the replay.
        got = mode.substitute_gradients(op_name, num_inputs, inputs, outputs, out_grads)
        if got is not None:
            return got
    for o in outputs or ():
        if o is not None:
            record = _record_of(o)
            if record is not None and record.op_type == op_name:
                return record.gradients(out_grads, num_inputs)
    return _original_gradient_function[0](
        op_name, attr_tuple, num_inputs, inputs, outputs, out_grads, skip_input_indices,
        forward_pass_name_scope)


def _jvp_function(op_name, attr_tuple, inputs, outputs, tangents, use_batch=False):
    for o in outputs or ():
        record = _record_of(o) if o is not None else None
        if record is not None and record.op_type == op_name:
            # TensorFlow computes JVPs with functions it traces per op signature, where
            # the record (on eager representations) cannot be reached.
            raise errors.HandlerError(
                "%s ran something else in place of op %s, and a "
                "tf.autodiff.ForwardAccumulator records it: it would give %s's JVP, not "
                "that of what ran. Use oh.ForwardAccumulator outside the handler's scope."
                % (record.handler.debug_string(), op_name, op_name))
    return _original_jvp_function[0](op_name, attr_tuple, inputs, outputs, tangents,
                                     use_batch)


def _wrap(slot, replacement):
    def wrap(original):
        slot[0] = original
        return replacement
    return wrap


tf_patches.subscribe("registered gradient function", "substitute gradients",
                     _wrap(_original_gradient_function, _gradient_function))
tf_patches.subscribe("registered JVP function", "substitute gradients",
                     _wrap(_original_jvp_function, _jvp_function))


def _kept_outputs(op, n_in):
    """Which outputs of `op` TensorFlow's tape keeps for its gradient (it drops those its
    gradient does not read: pywrap_tfe's OpGradientUnusedOutputIndices, which Python
    cannot query): learnt once per op type by recording the op type on a private tape
    over placeholder scalars and running its backward pass into `_gradient_function`."""
    kept = _kept.get(op.type)
    if kept is not None:
        return kept
    with _physical():
        return _probe_kept(op, n_in)


def _probe_kept(op, n_in):
    n_out = op.num_outputs
    ins = [constant_op.constant(0.0) for _ in range(max(n_in, 1))]
    outs = [constant_op.constant(0.0) for _ in range(n_out)]
    tape = _tape_lib.push_new_tape(persistent=False, watch_accessed_variables=False)
    try:
        _tape_lib.watch(tape, ins[0])
        pywrap_tfe.TFE_Py_RecordGradient(op.type, ins, (), outs, "")
    finally:
        _tape_lib.pop_tape(tape)
    _probe.seen = seen = [op.type]
    try:
        _imperative_grad.imperative_grad(tape, outs, [ins[0]], output_gradients=outs)
    finally:
        _probe.seen = None
    kept = seen[1] if len(seen) > 1 else (True,) * n_out
    _kept[op.type] = kept
    return kept


def _differentiable(value):
    return isinstance(value, _EagerTensor) and (value.dtype.is_floating or value.dtype.is_complex)


def run_recorded(stack, op, values):
    """`stack`'s execute hook on `values` for `op`, recorded for TensorFlow's tapes (the
    rule core/stack.py calls; see the module docstring)."""
    handler = stack.handler
    tf_patches.ensure("substitute gradients")
    for v in values:
        if not isinstance(v, _EagerTensor):
            raise errors.HandlerError(
                "%s may change what op %s computes (changes_computation) and a TensorFlow "
                "tape is recording, but its representation %r is not a tensor of the "
                "stack below it, on which the tape could differentiate what it runs; "
                "declare changes_computation = False if it computes %s unchanged"
                % (handler.debug_string(), op.type, type(v).__name__, op.type))
    tape = _registries.tape_class("reverse")(persistent=True, watch_accessed_variables=False)

    def run():
        with tape:
            below = current_stack()  # the private tape over the handler's next stack
            sources = [v if _differentiable(v) else None for v in values]
            tape.watch([s for s in sources if s is not None])
            inputs = [below.copy_on(v) for v in values]
            with _scope(handler):
                hook_stack = current_stack()  # the handler over the private tape
            outputs = hook_stack.call_hook(handler.execute, op, inputs)
        return below, sources, outputs

    below, sources, outputs = stack.call_hook(run)
    if type(outputs) not in (list, tuple):
        return outputs  # HandlerStack.execute's check names the handler
    ran = tape._recorded_ops()  # pylint: disable=protected-access
    # The hook ran the op it got, as it got it (or nothing differentiable ran on
    # nothing differentiable): the op's registered gradient is that of what ran.
    unchanged = (len(ran) == 1 and ran[0].type == op.type
                 and ran[0].attrs_key() == op.attrs_key()) or (
                     not ran and not any(s is not None for s in sources))
    result, targets = [], []
    for o in outputs:
        if isinstance(o, _EagerTensor) and stack_of(o) is below:
            found, value = representation_of(tape, o)
            result.append(value if found else o)
            targets.append(value if found else None)
        else:
            result.append(o)  # left the stacks below (a resource handle): as it is
            targets.append(None)
    if unchanged or not any(_differentiable(o) for o in result):
        return result  # the op's own gradient is the gradient of what ran (or none is)
    if op.num_outputs and not any(_kept_outputs(op, len(values))):
        raise errors.HandlerError(
            "%s may change what op %s computes (changes_computation), and a TensorFlow "
            "tape is recording, whose gradient of %s keeps none of its outputs: it cannot "
            "be given the gradient of what the handler runs. Take this gradient with "
            "oh.GradientTape (its scope around the handler's), or declare "
            "changes_computation = False if the handler computes %s unchanged."
            % (handler.debug_string(), op.type, op.type, op.type))
    record = _Recorded(tape, op.type, sources, targets, handler)
    below_handler = stack.next
    for i, value in enumerate(result):
        if targets[i] is not None:
            # The record goes on a new tensor of the value (an Identity below the
            # handler): on the value itself it would be a cycle through the private
            # tape's record of it, which the garbage collector cannot free.
            (value,) = below_handler.execute(Op.cached("Identity", T=value.dtype), [value])
            setattr(value, _ATTR, record)
            result[i] = value
    return result


register_substitute_rule(run_recorded)
_retrace.on_retrace(lambda: tf_patches.ensure("substitute gradients"))
