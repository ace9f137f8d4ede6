/* tf-ophandlers fast path: the one slot through which handler-specific C++ (cc/handlers/)
   registers with the core (internal header). Implementation: the table lives in
   fast_path.cc; cc/handlers/register.cc fills it.

   The core (cc/boundary/, cc/fast/, cc/native/) names no shipped handler. Where a handler
   may have a C implementation of one of its hooks, the core calls what this table holds;
   a null entry means there is none, and the core takes its generic path (RunHook, or
   the `after_execute` call in the hook's frame), which gives the same results. Each
   entry has at most one implementation: a handler file fills only its own entries.

   Lifetime: the table is filled once, at module init (PyInit__C calls
   InstallHandlerHooks, fast_path.h, which calls RegisterHandlerHooks and adds `methods`
   to the module), before any op can reach the fast path; it is only read afterwards, so
   reads take no lock. Every function it holds follows fast_internal.h's common contract
   (GIL held on entry and return, `in` borrowed, `outputs` new handles owned by the
   caller, the Run* "handled" contract) unless its entry says otherwise.
*/
#ifndef TF_OPHANDLERS_FAST_HANDLER_HOOKS_H_
#define TF_OPHANDLERS_FAST_HANDLER_HOOKS_H_

#include <Python.h>

#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/tf_status.h"

namespace tf_ophandlers {
namespace fast {

struct Decision;

struct HandlerHooks {
  // kPlugin, on the op's first stack: a handler's execute hook implemented in C (its
  // class declares it, core/fast_decision.py). Always handled (returns true): an op it
  // does not take itself it hands to RunHook; errors through `status`. Null: kPlugin
  // runs RunHook.
  bool (*run_plugin)(PyObject* stack, const Decision& d, const TFE_Op* src, const char* type,
                     const char* device, int n_in, TFE_TensorHandle** in, int* num_outputs,
                     TFE_TensorHandle** outputs, TF_Status* status) = nullptr;

  // Tried by RunHook before it calls the Python execute hook `execute` (the handler's
  // bound `execute`, borrowed) of `stack`, whose next stack is PHYSICAL: false when
  // `execute` has no C implementation or that one declines (nothing done, no Python
  // exception set); true when it ran the op (`status` tells whether its outputs were
  // made). GIL: held; released around TFE_Execute.
  bool (*execute_in_c)(PyObject* execute, PyObject* stack, const TFE_Op* src, const char* type,
                       int n_in, TFE_TensorHandle** in, int* num_outputs,
                       TFE_TensorHandle** outputs, TF_Status* status) = nullptr;

  // kAfterExecute: whether `fn` (an `after_execute` as found on a handler's class,
  // unbound, borrowed) is implemented in C. Never sets an exception.
  bool (*after_execute_is_c)(PyObject* fn) = nullptr;
  // That implementation, called for `handler` (whose class's after_execute passed
  // after_execute_is_c, not replaced on the instance) without a hook frame: `stack` is
  // the handler's stack, `next` the one its op ran on; `op`, `inputs`, `outputs` are
  // after_execute's arguments. Arguments borrowed. Returns a new reference, or null with
  // a Python exception set.
  PyObject* (*after_execute_c)(PyObject* handler, PyObject* stack, PyObject* next, PyObject* op,
                               PyObject* inputs, PyObject* outputs) = nullptr;
  // Whether foreign input `h` of an op on `handler`'s stack (a handler with a C
  // after_execute), whose next stack `next` runs the op through a Python execute hook,
  // may go to that hook as it is instead of through `handler`'s copy-on (which would
  // record nothing). 1 or 0, or -1 with a Python exception set. Arguments borrowed.
  int (*copies_through)(PyObject* handler, PyObject* next, TFE_TensorHandle* h) = nullptr;

  // Module functions of the handler-specific files (their setup and statistics
  // functions), each a null-terminated PyMethodDef table with static storage, added to
  // `_C` at module init. AddMethods returns false when the table is full.
  static constexpr int kMaxMethodTables = 8;
  PyMethodDef* methods[kMaxMethodTables] = {};
  bool AddMethods(PyMethodDef* table) {
    for (PyMethodDef*& slot : methods) {
      if (slot == nullptr) {
        slot = table;
        return true;
      }
    }
    return false;
  }
};

// The slot (fast_path.cc). Filled at module init, read-only afterwards.
extern HandlerHooks g_handler_hooks;

// Fills `hooks` with the handler-specific C++ compiled into the extension: defined by
// cc/handlers/register.cc, called once by InstallHandlerHooks. Returns false with a
// Python exception set when it cannot. GIL: held.
bool RegisterHandlerHooks(HandlerHooks* hooks);

}  // namespace fast
}  // namespace tf_ophandlers

#endif  // TF_OPHANDLERS_FAST_HANDLER_HOOKS_H_
