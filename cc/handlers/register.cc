// tf-ophandlers: the shipped handlers' C++ registered with the fast path, through its one
// hook slot (cc/fast/handler_hooks.h). This file is the only place that lists them: the
// core (cc/boundary/, cc/fast/, cc/native/) calls what the slot holds and names none of
// them. Each entry's Python hook stays the reference, which runs whenever the C one
// declines (or, with OH_FAST_PATH=0, always: core/fast_decision.py).
#include "fast/handler_hooks.h"
#include "handlers/async_execution/async_execute.h"
#include "handlers/gradient_tape/tape_record.h"
#include "handlers/lazy/lazy.h"

namespace tf_ophandlers {
namespace fast {

bool RegisterHandlerHooks(HandlerHooks* hooks) {
  // oh.Lazy: its execute for common ops, recorded in C (the kind FAST_PLUGIN).
  hooks->run_plugin = RunLazy;
  // oh.Async: its execute for its common case, tried before the Python hook.
  hooks->execute_in_c = AsyncExecuteInC;
  // oh.GradientTape: its after_execute (FAST_AFTER_EXECUTE) and copy-on pass-through.
  hooks->after_execute_is_c = IsTapeAfterExecute;
  hooks->after_execute_c = TapeAfterExecuteDirect;
  hooks->copies_through = TapeCopiesThrough;
  for (PyMethodDef* table : {kLazyModuleMethods, kAsyncModuleMethods, kTapeModuleMethods}) {
    if (!hooks->AddMethods(table)) {
      PyErr_SetString(PyExc_SystemError,
                      "tf_ophandlers._C: the hook slot's method tables are full");
      return false;
    }
  }
  return true;
}

}  // namespace fast
}  // namespace tf_ophandlers
