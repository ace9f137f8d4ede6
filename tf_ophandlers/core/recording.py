"""A tape's per-op recording in C (cc/tape_record.h), for handlers in the tape's role.

`recording(is_stopped, is_empty, trainable_dtype_enums)` returns ``(Record,
after_execute)``:

- ``Record(seq, op_type, op, backward, inputs, outputs, stack, skip)``: a C type with
  those read-only attributes (one recorded operation);
- ``after_execute``: an `OpHandler.after_execute` implemented in C for a handler whose
  state is a tape's (`_live`, `_tracked` and `_producer` dicts keyed by `tensor_key`, an
  int `_seq`), with `_after_execute_python(op, inputs, outputs)` doing the same in
  Python for the cases C hands over (a variable read whose handle is not tracked yet, a
  copy op, non-eager tensors) and `_bridge_to_tf_tapes(op, inputs, outputs)` called
  when TensorFlow's tape set (`is_empty()`) is not empty. It records nothing while
  `is_stopped()` (TensorFlow's `stop_recording`). The outputs whose dtype enum is in
  `trainable_dtype_enums` become tracked.

`oh.GradientTape` (handlers/gradient_tape.py) is the user; recording an op then enters
no Python frame.
"""
from tensorflow.python import pywrap_tfe

import tf_ophandlers._C as _C


def recording(is_stopped, is_empty, trainable_dtype_enums):
    """``(Record type, after_execute method)``; see the module docstring."""
    return _C.tape_setup(is_stopped, is_empty, frozenset(trainable_dtype_enums))


def record_on_tf_tapes(op, inputs, outputs):
    """Records `op` (an oh.Op run on a handler's representations) on TensorFlow's tapes,
    if any is active; they record it only if an input is one they watch. TensorFlow's
    tapes do not see the ops a handler runs on the next stack, so a tf.GradientTape
    around oh.GradientTape or oh.ForwardAccumulator would otherwise treat their results
    as constants."""
    if not pywrap_tfe.TFE_Py_TapeSetIsEmpty():
        pywrap_tfe.TFE_Py_RecordGradient(op.type, list(inputs), op.attr_tuple(),
                                         list(outputs), "")
