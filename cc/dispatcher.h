/* tf-ophandlers: the C++ boundary between TensorFlow's custom-device C API and handler
   logic written in Python (DESIGN.md decisions 1 and 2).

   One custom device, `/job:localhost/replica:0/task:0/device:OPHANDLER:0`, is registered
   per process. TensorFlow routes to it (a) every op executed inside a handler scope (the
   scope places ops on it) and (b) every op with an input on it (type-based dispatch).
   Each callback enters Python with `PyGILState_Ensure` and calls one dispatcher function
   registered by `tf_ophandlers.core.dispatch`; everything about *which* handler runs is
   decided there. This file owns what must never be wrong: references, the GIL, the
   validation of what a handler returns, and the mapping of errors.

   Conventions used by every function below:
   - GIL: callbacks may start with or without the GIL; each takes it with
     PyGILState_Ensure and releases it before returning. Blocking TensorFlow calls
     (TFE_Execute, shape queries on tensors that may be pending) are made with the GIL
     released, so that async execution and tf.py_function cannot deadlock.
   - Status: a callback reports failure only through its TF_Status. A Python exception
     raised by a handler is stashed by the dispatcher (`stash_error`) and the status
     message carries a marker `[tf_ophandlers#N]`; the patched status-to-exception
     conversion in Python re-raises the original exception object (type, message,
     traceback) when the status reaches the user.
   - Ownership: every TFE_TensorHandle* given to TensorFlow is a new reference
     (TFE_TensorHandleCopySharingTensor); Python objects handed to TensorFlow are never
     borrowed across a callback boundary.
*/
#ifndef TF_OPHANDLERS_DISPATCHER_H_
#define TF_OPHANDLERS_DISPATCHER_H_

#include <Python.h>

#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/eager/c_api_experimental.h"
#include "tf_ophandlers/payload.h"

namespace tf_ophandlers {

// --- Op objects -----------------------------------------------------------------------
//
// An `Op` describes one operation a handler is asked to execute: its type, attributes,
// requested device and expected outputs. Inside the execute callback the Op *borrows*
// TensorFlow's `const TFE_Op*` (no copy: the pass-through path pays nothing for
// attributes). When the callback returns, an Op that Python still references (a tape
// that recorded it, a lazy trace) *detaches*: it takes its own copy of the attributes.
// An Op is therefore always safe to keep.
struct OpObject {
  PyObject_HEAD
  const TFE_Op* borrowed;  // Valid only while the execute callback runs. Not owned.
  TFE_Op* owned;           // Owned attribute template (no inputs). May be null.
  PyObject* type;          // str, owned.
  PyObject* device;        // str, owned: the device TensorFlow recorded for the op.
  int num_outputs;         // Expected number of flat outputs.
  PyObject* output_dtypes; // tuple[int] of TF_DataType, None if unknown; owned, lazy.
  PyObject* dict;          // __dict__ for the Python subclass; owned.
};

// Returns the attribute source of `op` (borrowed or owned), or null with a Python
// exception set if the Op is neither (which indicates a bug).
// GIL: must be held.
const TFE_Op* OpAttrSource(OpObject* op);

// --- Handler tensors ------------------------------------------------------------------

// Creates a handler tensor on the dispatcher device whose payload refers to `stack` and
// `value` (new references are taken). Returns a new EagerTensor, or null with a Python
// exception set. GIL: must be held.
PyObject* WrapHandlerTensor(PyObject* stack, PyObject* value, TF_DataType dtype);

// Returns the payload of `handle` if it lives on the dispatcher device, else null.
// Never sets an error. GIL: not needed.
TFOH_Payload* PayloadOf(TFE_TensorHandle* handle);

// --- Execution ------------------------------------------------------------------------

// Executes `op` (its type and attributes) on `inputs` (a sequence of EagerTensors), on
// `device` ("" lets TensorFlow place it; inside a callback always name one). Returns a
// new list of EagerTensors, or null with a Python exception set (the original handler
// exception where the failure came from a nested handler).
// GIL: must be held; it is released around TFE_Execute.
PyObject* ExecuteOp(OpObject* op, PyObject* inputs, const char* device);

}  // namespace tf_ophandlers

#endif  // TF_OPHANDLERS_DISPATCHER_H_
