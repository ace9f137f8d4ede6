/* tf-ophandlers C++ boundary: oh.GradientTape's per-op recording (internal header).
   Implementation: tape_record.cc.

   `GradientTape.after_execute(op, inputs, outputs)` (OpHandler.after_execute; the C++
   fast path calls it for every op the tape executes, fast_record.cc RunRecord) is
   implemented here, so recording an op enters no Python frame. It does what the Python
   reference `GradientTape._after_execute_python` (tf_ophandlers/handlers/gradient_tape.py)
   does, on the tape's own Python state (`_live`, `_tracked`, `_producer`, `_seq`): an op
   one of whose inputs is tracked and one of whose outputs is differentiable becomes a
   record, `_C.TapeRecord(seq, op_type, op, backward, inputs, outputs, stack, skip)`.
   Every case it does not take (no input tracked on a variable read, a copy op, inputs or
   outputs that are not EagerTensors, a state it cannot read) is handed, before anything
   changed, to that Python reference. TensorFlow's tape set is asked through the
   callables given to `tape_setup`.
*/
#ifndef TF_OPHANDLERS_TAPE_RECORD_H_
#define TF_OPHANDLERS_TAPE_RECORD_H_

#include <Python.h>

namespace tf_ophandlers {

// tape_setup(is_stopped, is_empty, trainable_dtype_enums) -> (TapeRecord type,
// after_execute method): appended to the module's method table by module.cc.
// Null-terminated.
extern PyMethodDef kTapeModuleMethods[];

}  // namespace tf_ophandlers

#endif  // TF_OPHANDLERS_TAPE_RECORD_H_
