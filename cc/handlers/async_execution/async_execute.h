/* tf-ophandlers: oh.Async's execute hook in C for its common case (internal header).
   Implementation: fast_async.cc. Registered with the fast path through its hook slot
   (cc/fast/handler_hooks.h `execute_in_c`) by cc/handlers/register.cc; the Python hook
   (handlers/async_execution.py) is the reference and runs whenever this declines.
   Contracts as cc/fast/fast_internal.h's (GIL held, `in` borrowed, the Run* contract).
*/
#ifndef TF_OPHANDLERS_HANDLERS_ASYNC_EXECUTION_ASYNC_EXECUTE_H_
#define TF_OPHANDLERS_HANDLERS_ASYNC_EXECUTION_ASYNC_EXECUTE_H_

#include <Python.h>

#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/tf_status.h"

namespace tf_ophandlers {
namespace fast {

// Whether `execute` (a handler's bound `execute`, borrowed) is oh.Async's hook, whose
// common case AsyncExecute runs in C. False until async_setup ran. GIL: held.
bool AsyncHookIs(PyObject* execute);

// oh.Async's execute hook in C, with RunHook's wrap and output check, for `type` on
// `stack` (whose next stack is PHYSICAL, no replay running), from the op's inputs `in`
// (borrowed). Returns false when the Python hook must run instead (nothing done, no
// Python exception set); true when the op was queued: `status` tells whether its outputs
// were made (the Run* contract). GIL: held; released around TFE_Execute.
bool AsyncExecute(PyObject* stack, const TFE_Op* src, const char* type, int n_in,
                  TFE_TensorHandle** in, int* num_outputs, TFE_TensorHandle** outputs,
                  TF_Status* status);

// The hook slot's `execute_in_c`: AsyncExecute when `execute` is oh.Async's hook
// (AsyncHookIs), else false (nothing done).
bool AsyncExecuteInC(PyObject* execute, PyObject* stack, const TFE_Op* src, const char* type,
                     int n_in, TFE_TensorHandle** in, int* num_outputs,
                     TFE_TensorHandle** outputs, TF_Status* status);

// async_setup(execute, op_kinds, implied, inferred, resource, valueless): the tables of
// handlers/async_execution.py AsyncExecute reads; async_stats() -> {"c_ops": ops
// AsyncExecute ran}. Added to `_C` through the hook slot. Null-terminated.
extern PyMethodDef kAsyncModuleMethods[];

}  // namespace fast
}  // namespace tf_ophandlers

#endif  // TF_OPHANDLERS_HANDLERS_ASYNC_EXECUTION_ASYNC_EXECUTE_H_
