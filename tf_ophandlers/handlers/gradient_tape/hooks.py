"""TensorFlow's Python-recorded gradients for oh.GradientTape (part of gradient_tape).

Some gradients are not attached to ops but recorded from Python: custom gradients
(tf.custom_gradient, tf.recompute_grad) and tf.function calls. TensorFlow sends them to
its own tape set; these hooks (the use "tape hooks" of core/tf_patches/) also send them
to the oh.GradientTapes of the current scope, at each tape's level.

>>> import tensorflow as tf, tf_ophandlers as oh
>>> x = tf.constant(2.0)
>>> with oh.GradientTape() as tape:
...     tape.watch(x)
...     y = tf.function(lambda v: v * v)(x)
>>> float(tape.gradient(y, x))
4.0
"""
from tensorflow.python import pywrap_tfe
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import gradients_util

from tf_ophandlers.extend import (
    CopyOffError, current_stack, densified, Op, PHYSICAL, replayed_call, stack_of,
    tf_patches)
from tf_ophandlers.handlers.gradient_tape.exclusions import tracked_entry

_EagerTensor = _ops.EagerTensor


_USE = "tape hooks"
# What each hook wraps (TensorFlow's function or the subscriber below: core/tf_patches/).
_original_record_operation = [None]
_original_record_backprop_only = [None]
_original_could_possibly_record = [None]
_original_possible_gradient_types = [None]


def _record_operation(op_type, output_tensors, input_tensors, backward_function,
                      forward_function=None):
    replayed, backward_for_tapes = _for_tapes(op_type, backward_function)
    _original_record_operation[0](op_type, output_tensors, input_tensors, backward_function,
                                  forward_function)
    _record_on_tapes(op_type, output_tensors, input_tensors, backward_for_tapes, replayed)


def _record_operation_backprop_only(op_type, output_tensors, input_tensors,
                                    backward_function):
    # TensorFlow's record of a call with tangents from a tf.autodiff.ForwardAccumulator
    # on its arguments (ConcreteFunction; its backward function is already dense).
    replayed, backward_for_tapes = _for_tapes(op_type, backward_function)
    _original_record_backprop_only[0](op_type, output_tensors, input_tensors,
                                      backward_function)
    _record_on_tapes(op_type, output_tensors, input_tensors, backward_for_tapes, replayed)


def _for_tapes(op_type, backward_function):
    # A call replayed by handlers: the tapes on its stack recorded the replayed function
    # (core/functions/call_records.py), not this record of the original one. Its
    # gradients are dense if tangents of an oh.ForwardAccumulator reached its arguments
    # (the replayed call, or the original one for a tape above the accumulator), as
    # TensorFlow's for the same nesting.
    return replayed_call(op_type), densified(op_type, backward_function)


def _record_on_tapes(op_type, output_tensors, input_tensors, backward_for_tapes, replayed):
    if not all(isinstance(t, _EagerTensor) for t in output_tensors):
        return  # a record made while tracing a function: only TensorFlow's tapes use it
    for tape in _active_tapes():
        if replayed is not None and replayed.recorded_by(tape):
            continue
        inputs = [tape._level_of(t) for t in input_tensors]  # pylint: disable=protected-access
        tracked = tape._tracked  # pylint: disable=protected-access
        if any(tracked_entry(tracked, t) is not None for t in inputs):
            outputs = [tape._level_of(t) for t in output_tensors]  # pylint: disable=protected-access
            below = _scope_below(tape)
            _copy_on_reducing_stack(tape, below, inputs)
            tape._record(op_type, None, backward_for_tapes, inputs, outputs,  # pylint: disable=protected-access
                         below, ())


def _copy_on_reducing_stack(tape, below, inputs):
    """For a call recorded on a stack whose handler reduces in CopyOnGrad
    (ParallelHandler: a host variable captured by a tf.function runs whole per
    component): replaces each tracked physical input by its copy onto that stack and
    records the CopyOn, as op by op, so that its gradient is summed by CopyOnGrad
    instead of staying one gradient per component."""
    if below is PHYSICAL or not any(getattr(h, "copy_on_grad_reduces", False)
                                    for h in below.handlers):
        return
    tracked = tape._tracked  # pylint: disable=protected-access
    for i, t in enumerate(inputs):
        known = tracked_entry(tracked, t)
        if known is None or stack_of(t) is not None:
            continue
        known = known[0]
        copied = below.copy_on(known)
        op = Op.cached("CopyOn", T=copied.dtype)
        if tape._record("CopyOn", op, None, [known], [copied], below, ()):  # pylint: disable=protected-access
            inputs[i] = copied


def _scope_below(tape):
    """The stack `tape` executes on in the current scope."""
    stack = current_stack()
    while stack.handler is not None and stack.handler is not tape:
        stack = stack.next
    return stack.next if stack.handler is tape else stack


def _could_possibly_record():
    return _original_could_possibly_record[0]() or bool(_active_tapes())


def _possible_gradient_types(tensors):
    tapes = _active_tapes()
    if tapes and not pywrap_tfe.TFE_Py_TapeSetIsEmpty():
        for tape in tapes:  # first: TensorFlow's tapes then see the arguments they know
            _link_on_tf_tapes(tensors, tape)
    kind = _original_possible_gradient_types[0](tensors)
    for tape in tapes:
        tape._harvest_variables()  # a function's captured variables were just read  # pylint: disable=protected-access
        tracked = tape._tracked  # pylint: disable=protected-access
        if any(_maybe_tracked(tape, t, tracked) for t in tensors):
            kind = (gradients_util.POSSIBLE_GRADIENT_TYPES_FIRST_ORDER if kind == 0
                    else gradients_util.POSSIBLE_GRADIENT_TYPES_HIGHER_ORDER)
    return kind


def _identity_gradient(gradient):
    return [gradient]


def _link_on_tf_tapes(tensors, tape):
    """Before a function call on `tensors` (TensorFlow asks which tapes could record it):
    records on TensorFlow's tapes each argument that is another Python object of a
    tensor `tape` tracks (same handle, or its representation) as that tensor,
    the object the tape recorded and bridged to TensorFlow's tapes. TensorFlow's tapes
    know tensors by Python object, and a call replayed by handlers above the tape runs
    on new wrappers of the arguments: a tf.GradientTape around the tape did not connect
    the call the tape records to what it watches (and took its first-order forward
    function, which keeps the saved tensors off its tape), so its gradient of the tape's
    gradient was None."""
    tracked = tape._tracked  # pylint: disable=protected-access
    for t in tensors:
        if not isinstance(t, _EagerTensor):
            continue
        known = tracked_entry(tracked, t)
        if known is None:
            # An argument on the tape's own stack (the call replayed at its level, on a
            # value computed under the handler above): the tape tracks its
            # representation, which the bridge connected on TensorFlow's tapes (without
            # this the outer second order through it was None or partial).
            stack = stack_of(t)
            if stack is None or stack.handler is not tape:
                continue
            try:
                known = tracked_entry(tracked, tape._level_of(t))  # pylint: disable=protected-access
            except CopyOffError:
                continue
        if known is not None and known[0] is not t and isinstance(known[0], _EagerTensor):
            # TensorFlow's tapes only (the unpatched record): on an oh.GradientTape, t
            # has known[0]'s key, so the record would replace its entry and cut the
            # ops recorded on it before the call off the gradient.
            _original_record_backprop_only[0]("Identity", [t], [known[0]],
                                              _identity_gradient)


def _maybe_tracked(tape, tensor, tracked):
    try:
        return tracked_entry(tracked, tape._level_of(tensor)) is not None  # pylint: disable=protected-access
    except CopyOffError:
        # A tensor of a handler above with no tensor at the tape's level (a per-example
        # value of vectorized_map): a function call on it is replayed, and the tape
        # records the replayed function (core/functions/call_records.py); TensorFlow
        # must take its recording path for that.
        return True


_active_tapes = None  # set by register: the recording oh.GradientTapes, innermost first


def _wrap(slot, replacement):
    def wrap(original):
        slot[0] = original
        return replacement
    return wrap


def register(active_tapes):
    """Called by gradient_tape with its `_active_tapes`: subscribes the hooks (the hooks
    module cannot import gradient_tape, which imports it)."""
    global _active_tapes  # pylint: disable=global-statement
    _active_tapes = active_tapes
    tf_patches.subscribe("record.record_operation", _USE,
                         _wrap(_original_record_operation, _record_operation))
    tf_patches.subscribe("record.record_operation_backprop_only", _USE,
                         _wrap(_original_record_backprop_only, _record_operation_backprop_only))
    tf_patches.subscribe("record.could_possibly_record", _USE,
                         _wrap(_original_could_possibly_record, _could_possibly_record))
    tf_patches.subscribe("gradients_util.PossibleTapeGradientTypes", _USE,
                         _wrap(_original_possible_gradient_types, _possible_gradient_types))
