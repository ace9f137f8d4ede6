/* tf-ophandlers: the C++ boundary between TensorFlow's custom-device C API and handler
   logic written in Python (DESIGN.md decisions 1 and 2). Umbrella header of the
   extension tf_ophandlers._C; each part has its own header with the contracts of its
   functions:

     runtime.h         process-wide state set by _C.init, TensorFlow's private
                       EagerTensor symbols, small shared helpers
     status.h          Python exception <-> TF_Status (the stash and its marker)
     op.h              the Op Python type (_C.OpBase) and ExecuteOp
     handler_tensor.h  handler tensors: payload creation, rank/dim/summary methods,
                       deallocation and the pending-free queue
     device.h          the dispatcher device's execute/copy callbacks and the
                       validation of what handlers return
     fast_path.h       the per-op fast path the execute callback tries first: stacks
                       that need no Python for an op, Python hooks called from C, and
                       the bounded per-(stack, op type) decision cache
                       (its pieces: fast_internal.h)
     module.cc         the _C module (init and the functions tf_ophandlers.core calls)
     include/tf_ophandlers/payload.h   the payload layout

   Conventions used by every function:
   - GIL: TensorFlow callbacks may start with or without the GIL; each takes it with
     PyGILState_Ensure and releases it before returning. Blocking TensorFlow calls
     (TFE_Execute, shape queries on tensors that may be pending) are made with the GIL
     released, so that async execution and tf.py_function cannot deadlock. Functions
     called from Python run with the GIL held.
   - Status: a callback reports failure only through its TF_Status and returns with no
     Python exception set. A Python exception raised by a handler is stashed
     (StatusFromPyErr) and the status message carries a marker `[tf_ophandlers#N]`; when
     the status reaches the user, the original exception object (type, message,
     traceback) is raised instead (tf_ophandlers/core/errors.py). Functions called from
     Python report failure as a Python exception (null return).
   - Ownership: every TFE_TensorHandle* given to TensorFlow is a new handle
     (TFE_TensorHandleCopySharingTensor); Python objects handed to TensorFlow are never
     borrowed across a callback boundary. "Borrowed" and "new reference" in the headers
     have their CPython meaning.
*/
#ifndef TF_OPHANDLERS_DISPATCHER_H_
#define TF_OPHANDLERS_DISPATCHER_H_

#include "boundary/device.h"
#include "fast/fast_path.h"
#include "boundary/handler_tensor.h"
#include "boundary/op.h"
#include "boundary/runtime.h"
#include "boundary/status.h"

#endif  // TF_OPHANDLERS_DISPATCHER_H_
