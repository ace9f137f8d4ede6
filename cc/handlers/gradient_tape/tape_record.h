/* tf-ophandlers: oh.GradientTape's per-op recording (internal header).
   Implementation: tape_record.cc. Registered with the fast path through its hook slot
   (cc/fast/handler_hooks.h: after_execute_is_c, after_execute_c, copies_through) by
   cc/handlers/register.cc.

   `GradientTape.after_execute(op, inputs, outputs)` (OpHandler.after_execute; the C++
   fast path calls it for every op the tape executes, fast_record.cc RunAfterExecute) is
   implemented here, so recording an op enters no Python frame. It does what the Python
   reference `GradientTape._after_execute_python` (tf_ophandlers/handlers/gradient_tape/handler.py)
   does, on the tape's own Python state (`_live`, `_tracked`, `_producer`, `_seq`, read
   from its instance dict: plain attributes, no class-level descriptors): an op
   one of whose inputs is tracked and one of whose outputs is differentiable becomes a
   record, `_C.TapeRecord(seq, op_type, op, backward, inputs, outputs, stack, skip, ids)`.

   Memory contract (as TensorFlow's TFE_Py_RecordGradient with its generated
   OpGradientUnusedInputIndices / OpGradientUnusedOutputIndices): a record holds only the
   inputs and outputs the op's registered gradient function reads, as named by the
   `used_indices(op_type)` callable given to `tape_setup` (asked once per op type, cached
   in a bounded dict); the others are None in the record's `inputs` / `outputs` (resource
   and variant outputs are always kept). When TensorFlow's tape set is not empty (a
   tf.GradientTape or accumulator may differentiate the gradient computation) the record
   keeps everything. The tape's `_tracked` holds recorded outputs by weak reference, as
   `key -> (weakref, id)`; an entry whose tensor is gone counts as untracked (its key, a
   handle address, may be a new tensor's). The graph is linked by ids, never by
   tensors: `ids` is `(input ids (None if untracked), output ids ((seq << 20) | index),
   output specs)`, output specs None or per output `(dtype enum, dims)` of a dropped
   output of a multi-output op (None for kept ones), for the zeros of its gradient.
   Every case it does not take (no input tracked on a variable read, a copy op, inputs or
   outputs that are not EagerTensors, a state it cannot read) is handed, before anything
   changed, to that Python reference. TensorFlow's tape set is asked through
   pywrap_tfe's C functions (TFE_Py_TapeSetIsStopped / IsEmpty), not their Python
   wrappers. A `_tracked` of kSweepMin entries or more is swept of dead entries
   (`_sweep_tracked()`) when it reaches `_sweep_at`, which the sweep sets to twice what
   remains, so a long persistent tape does not grow by the outputs it no longer tracks.
*/
#ifndef TF_OPHANDLERS_TAPE_RECORD_H_
#define TF_OPHANDLERS_TAPE_RECORD_H_

#include <Python.h>

#include "tensorflow/c/eager/c_api.h"

namespace tf_ophandlers {

// tape_setup(trainable_dtype_enums, used_indices) -> (TapeRecord type, after_execute
// method) and tape_copy_setup(copy_on): added to `_C` through the hook slot.
// Null-terminated.
extern PyMethodDef kTapeModuleMethods[];

// Whether `fn` (a function: an `after_execute` as found on a handler's class, unbound) is
// the C after_execute of a tape. GIL: held.
bool IsTapeAfterExecute(PyObject* fn);

// The tape `tape`'s after_execute(op, inputs, outputs), called by the fast path's record
// path (fast_record.cc) without a hook frame: `stack` is the tape's stack, `next` the one
// its op ran on. Pushes the frame (fast::CallHook) only for the Python methods it calls.
// Returns a new reference, or null with an exception set. GIL: held.
PyObject* TapeAfterExecuteDirect(PyObject* tape, PyObject* stack, PyObject* next, PyObject* op,
                                 PyObject* inputs, PyObject* outputs);

// Whether foreign input `h` of an op on the stack of tape `tape`, whose next stack `next`
// runs the op through a Python execute hook (fast_record.cc RunAfterExecute), may go to that
// hook as it is instead of through the tape's copy-on, because the tape's copy-on
// would only hand it to `next.copy_on` and record nothing: `tape`'s copy_on is
// GradientTape.copy_on (tape_copy_setup) and its needs_copy None (neither set on the
// instance), `h` is not a resource handle (its copy-on may harvest the tape's variable
// watcher), and `h` is either a tensor of `next` (copy_on returns it as it is) or a
// physical tensor that the tape does not track, while
// TensorFlow's tape set is empty, under a handler declaring `tape_copies_through = True`
// (the hook then copies it on by its own rules: the tape defers its copies to them).
// 1 or 0, or -1 with a Python exception set. GIL: held.
int TapeCopiesThrough(PyObject* tape, PyObject* next, TFE_TensorHandle* h);

}  // namespace tf_ophandlers

#endif  // TF_OPHANDLERS_TAPE_RECORD_H_
