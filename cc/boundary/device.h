/* tf-ophandlers C++ boundary: the dispatcher device's callbacks (internal header).
   Implementation: device.cc.

   One custom device, `/job:localhost/replica:0/task:0/device:OPHANDLER:0`, is registered
   per process. TensorFlow routes to it (a) every op executed inside a handler scope (the
   scope places ops on it) and (b) every op with an input on it (type-based dispatch).
   Each callback enters Python with PyGILState_Ensure and calls one dispatcher function
   registered by tf_ophandlers.core.dispatch; everything about *which* handler runs is
   decided there. The callbacks own what must never be wrong: references, the GIL, the
   validation of what a handler returns, and the mapping of errors (status.h).
*/
#ifndef TF_OPHANDLERS_DEVICE_H_
#define TF_OPHANDLERS_DEVICE_H_

#include <Python.h>

#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/tf_status.h"

namespace tf_ophandlers {

// Registers the dispatcher device `device_name` in `ctx` (not owned) with the callbacks
// of device.cc. On failure `status` is set and nothing is registered.
// GIL: not needed (held by the caller, _C.init). Status: the only error report.
void RegisterDispatcherDevice(TFE_Context* ctx, const char* device_name, TF_Status* status);

// The dispatcher's execute callback for an op the caller built on this thread with the
// GIL held, placed on the dispatcher by its device name (skip_trace_execute,
// fast_trace.cc), run without TFE_Execute: TensorFlow's routing of such an op
// (CustomDeviceOpHandler::Execute) only finds the dispatcher by that name and calls the
// callback with the same op and output capacity, so the GIL is neither released for
// TFE_Execute nor taken back by the callback. Only when TensorFlow's placement rules
// could not send the op elsewhere: no input is a resource or a tensor of another custom
// device; and not when the callback would run without the GIL (this thread's no-GIL
// plan, NativeNoGilMayRun) or with a Python exception set. Returns false when it does
// not qualify (nothing done, `status` untouched: call TFE_Execute); true when the
// callback ran (`status` and `outputs` as TFE_Execute leaves them). `op` borrowed.
// GIL: must be held.
bool ExecuteOnDispatcherHeld(TFE_Op* op, int* num_outputs, TFE_TensorHandle** outputs,
                             TF_Status* status);

struct OpObject;

// Checks what an execute hook's stack returned for `op` (`result`: a list or tuple of
// EagerTensors, borrowed) against the op's OpDef (`tfe_op`, borrowed; count and dtypes)
// and `*num_outputs` (the capacity TensorFlow gave), and on success stores new handles
// sharing the tensors in `outputs` and sets `*num_outputs`. Returns false with `status`
// set (a HandlerOutputError naming the handler and op, via dispatch.output_error) on any
// mismatch; `outputs` then holds nothing. GIL: must be held.
bool TakeOutputs(OpObject* op, const TFE_Op* tfe_op, PyObject* result, int* num_outputs,
                 TFE_TensorHandle** outputs, TF_Status* status);

// Makes `op` (borrowed, may be null) the op CurrentOpType() names on this thread and
// returns the previous one (restore it when the hook returns). GIL: must be held.
OpObject* SwapCurrentOp(OpObject* op);

// The type (a borrowed str) of the op of the innermost execute callback running on this
// thread, or null outside any execute callback. Valid while that callback runs.
// Used to name the op in errors about outputs wrapped by `_C.wrap_outputs`.
// GIL: must be held.
PyObject* CurrentOpType();

}  // namespace tf_ophandlers

#endif  // TF_OPHANDLERS_DEVICE_H_
