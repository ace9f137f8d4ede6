/* tf-ophandlers C++ boundary: handlers written against the public C ABI
   (include/tf_ophandlers/handler.h); internal header. Implementation: native_library.cc (loading,
   registration, module functions), native_type.cc (the Python type), native_execute.cc
   (the per-op path); what they share: native_internal.h.

   A loaded handler type is a `TypeRecord`; a handler instance is a Python object of a
   subclass of `_C.NativeHandlerBase` (tf_ophandlers.core.native.NativeHandler) that
   owns the handler state. Its hooks are called from two places:
   - the dispatcher's execute callback (through fast_path.h's TryFastExecute, which
     calls NativeStackRun), without any Python frame,
     for an eager op placed by a scope whose current stack is a native handler's, when
     every input is already on that stack or a physical tensor the default copy-on
     takes as it is;
   - the Python stack (HandlerStack.execute -> NativeHandler.execute ->
     `NativeHandlerBase._oh_execute`) in every other case: type-based dispatch, inputs
     to copy on, a Python handler above, function replay (symbolic tensors).
*/
#ifndef TF_OPHANDLERS_NATIVE_H_
#define TF_OPHANDLERS_NATIVE_H_

#include <Python.h>

#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/tf_status.h"

namespace tf_ophandlers {

// The type `_C.NativeHandlerBase`. Usable after ReadyNativeTypes() returned true.
extern PyTypeObject NativeHandlerBaseType;

// Readies NativeHandlerBaseType. Returns false with a Python exception set on failure.
// GIL: held (PyInit__C).
bool ReadyNativeTypes();

// The module functions of native_library.cc (load_handler_library, native_setup), appended to
// the module's method table by module.cc. Null-terminated.
extern PyMethodDef kNativeModuleMethods[];

// Executes `op` (type `type`, requested device `device`, `n_in` flat inputs `in`, all
// borrowed) on `stack`, whose handler is the native handler `handler` and whose next
// stack is `next` (both borrowed; the fast path's decision cache holds them per stack),
// in C when every input is already on `stack`, or is physical and taken as it is (next
// stack PHYSICAL, no copy_on hook). Returns false when it does not qualify (nothing was
// done, `status` untouched, no Python exception set): the caller takes another path.
// Returns true when it ran the op: `status` tells whether it succeeded, and on success
// `outputs` holds `*num_outputs` new handles (`*num_outputs` is the capacity on entry).
// Called by the fast path (fast_path.h). GIL: must be held; released around TFE_Execute.
bool NativeStackRun(PyObject* stack, PyObject* handler, PyObject* next, const TFE_Op* op,
                    const char* type, const char* device, int n_in, TFE_TensorHandle** in,
                    int* num_outputs, TFE_TensorHandle** outputs, TF_Status* status);

// Whether `stack`'s handler is native with a num_dims or dim hook: its tensors then
// answer rank and dims through those hooks, not from their representation. Never fails.
// GIL: must be held.
bool HasNativeShapeHooks(PyObject* stack);

}  // namespace tf_ophandlers

#endif  // TF_OPHANDLERS_NATIVE_H_
