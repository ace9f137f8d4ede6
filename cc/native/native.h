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
// `first_stack`: `stack` is the op's first stack (the fast path's depth 0); such a stack
// over PHYSICAL is remembered for this thread's no-GIL path (NativeNoGilExecute).
// Called by the fast path (fast_path.h). GIL: must be held; released around TFE_Execute.
bool NativeStackRun(PyObject* stack, PyObject* handler, PyObject* next, const TFE_Op* op,
                    const char* type, const char* device, int n_in, TFE_TensorHandle** in,
                    int* num_outputs, TFE_TensorHandle** outputs, TF_Status* status,
                    bool first_stack = false);

// The no-GIL path (native_nogil.cc), tried by the dispatcher's execute callback
// (device.cc) before it takes the GIL. Runs `op` without the GIL when it is this thread's
// op on the stack of this thread's plan: a stack directly over PHYSICAL that is
// state.current, whose handler is a C/C++ handler (NativeStackRun remembers it) or
// forwards ops of this type (RunForward at the op's first stack remembers the type: a
// pass-through level, C++ or Python); the plan is valid until StacksGeneration changes.
// Also: no function is being replayed, no payload is queued for release, and every
// input is physical (taken as it is: no copy_on hook) or a handler tensor of that stack
// whose value is a physical TensorFlow handle. The execute hook (if any) and the
// physical execution run without the GIL, and so do the outputs' handler tensors when
// they are plain handles of an op type the plan has interned (NewAnchoredHandle); else
// the GIL is taken once, to wrap them (and inside execute_next for anything but a
// physical execution). Returns false when it does not qualify (nothing done, `status`
// untouched); true when it ran the op (`status` tells whether it succeeded; on success
// `outputs` holds `*num_outputs` new handles). GIL: must NOT be held (false is returned
// if it is).
bool NativeNoGilExecute(const TFE_Op* op, int* num_outputs, TFE_TensorHandle** outputs,
                        TF_Status* status);

// Whether this thread has a current no-GIL plan, so that NativeNoGilExecute may take an
// op (a caller holding the GIL then lets TensorFlow's TFE_Execute call the dispatcher
// without it: ExecuteOnDispatcherHeld). GIL: any (thread-local state).
bool NativeNoGilMayRun();

// Remembers `stack` (its C/C++ handler `handler`, next stack PHYSICAL) as this thread's
// no-GIL plan if it is state.current. GIL: must be held.
void RememberNoGilStack(PyObject* stack, PyObject* handler);

// Remembers that `stack` forwards ops of `type` to PHYSICAL (a kForward decision with
// these `transient` and `default_copy_on`; `skipped`: null when its next stack is
// PHYSICAL, else that next stack, a forwarding level RunForward skips), in this thread's
// no-GIL plan, if it is state.current. GIL: must be held.
void RememberNoGilForward(PyObject* stack, const char* type, bool transient,
                          bool default_copy_on, PyObject* skipped = nullptr);

// `_C.nogil_forget()`: drops this thread's no-GIL plan and with it the plan's hold on its
// stack (core/scope.py calls it when a scope closes: a plan keeps its stack alive until
// then, or until the thread remembers another stack; a thread that exits inside a scope
// leaks that hold). Python C-API contract. GIL: must be held.
PyObject* PyNoGilForget(PyObject*, PyObject*);

// How many ops NativeNoGilExecute ran with an execute hook (fast_stats' nogil_ops) and as
// a forwarding level (nogil_forward_ops); both included in fast_ops.
uint64_t NativeNoGilOps();
uint64_t NativeNoGilForwardOps();

// Whether `stack`'s handler is native with a num_dims or dim hook: its tensors then
// answer rank and dims through those hooks, not from their representation. Never fails.
// GIL: must be held.
bool HasNativeShapeHooks(PyObject* stack);

}  // namespace tf_ophandlers

#endif  // TF_OPHANDLERS_NATIVE_H_
