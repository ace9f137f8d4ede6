"""A tape's per-op recording in C (cc/handlers/gradient_tape/tape_record.h), for handlers in the tape's role.

`recording(trainable_dtype_enums, used_indices)` returns
``(Record, after_execute)``:

- ``Record(seq, op_type, op, backward, inputs, outputs, stack, skip, ids)``: a C type
  with those read-only attributes (one recorded operation; `ids` is ``(input ids,
  output ids, output specs)``, the links of the recorded graph);
- ``after_execute``: an `OpHandler.after_execute` implemented in C for a handler whose
  state is a tape's (`_live`; `_tracked`, a dict from `tensor_key` to ``(tensor or
  weakref to it, id)``; `_producer`, a dict from output id to record; an int `_seq`), with `_after_execute_python(op, inputs, outputs)` doing the same in
  Python for the cases C hands over (a variable read whose handle is not tracked yet, a
  copy op, non-eager tensors) and `_bridge_to_tf_tapes(op, inputs, outputs)` called
  when TensorFlow's tape set is not empty. It records nothing while TensorFlow's tape
  set is stopped (`stop_recording`). A `_tracked` of 1024 entries or more calls
  `_sweep_tracked()` when its size reaches the int `_sweep_at`. The outputs whose dtype enum is in
  `trainable_dtype_enums` become tracked (by weak reference, with id ``(seq << 20) |
  index``). Unless TensorFlow's tape set is recording, a record keeps only the inputs
  and outputs `used_indices(op_type)` names (``(inputs, outputs)``, each a set of
  indices or None for all); the others are None in the record (cc/handlers/gradient_tape/tape_record.h).

`oh.GradientTape` (handlers/gradient_tape/handler.py) is the user; recording an op then enters
no Python frame.
"""
from tensorflow.python import pywrap_tfe

import tf_ophandlers._C as _C


def recording(trainable_dtype_enums, used_indices):
    """``(Record type, after_execute method)``; see the module docstring."""
    return _C.tape_setup(frozenset(trainable_dtype_enums), used_indices)


def copy_through(copy_on):
    """Registers the tape's `copy_on` (GradientTape.copy_on) with the C record path:
    over a Python execute hook whose handler declares ``tape_copies_through = True``
    (oh.vectorized_map), an input that copy_on would only pass to the stack below (a
    tensor of that stack; a physical tensor, not a resource handle, that the tape does
    not track, while no TensorFlow tape records) goes to the hook as it is, which copies
    it on by its own rules (cc/handlers/gradient_tape/tape_record.h TapeCopiesThrough)."""
    _C.tape_copy_setup(copy_on)


def record_on_tf_tapes(op, inputs, outputs):
    """Records `op` (an oh.Op run on a handler's representations) on TensorFlow's tapes,
    if any is active; they record it only if an input is one they watch. TensorFlow's
    tapes do not see the ops a handler runs on the next stack, so a tf.GradientTape
    around oh.GradientTape or oh.ForwardAccumulator would otherwise treat their results
    as constants."""
    if not pywrap_tfe.TFE_Py_TapeSetIsEmpty():
        pywrap_tfe.TFE_Py_RecordGradient(op.type, list(inputs), op.attr_tuple(),
                                         list(outputs), "")


# Handlers that act on gradients recorded from Python (`record.record_operation`:
# tf.custom_gradient, tf.recompute_grad), which reach no handler hook. Each is called as
# ``fn(op_type, output_tensors, input_tensors, backward_function, forward_function)``
# after TensorFlow recorded the operation (core/functions/call_records.py owns the patch).
_record_subscribers = []


def subscribe_records(fn):
    """Adds `fn` to the subscribers of Python-recorded gradients (idempotent)."""
    if fn not in _record_subscribers:
        _record_subscribers.append(fn)


def notify_record(op_type, output_tensors, input_tensors, backward_function,
                  forward_function):
    """Calls the subscribers (an exception, e.g. raised by a custom gradient function
    a subscriber runs, reaches the caller of record_operation, as in TensorFlow)."""
    for fn in _record_subscribers:
        fn(op_type, output_tensors, input_tensors, backward_function, forward_function)
