/* tf-ophandlers C++ boundary: what the pieces of the per-op fast path share (internal
   header; the interface for the rest of the extension is fast_path.h, which describes
   what the fast path does). Private to:

     fast_path.cc      entry points (TryFastExecute, FastRunOn), RunOn (one level's
                       dispatch on its decision), RunPhysical, ExecuteOnPhysical,
                       fast_setup and the interned attribute names
     fast_decision.cc  Decide: the decision per (stack, op type), its two bounded
                       caches (per stack; shared per declaration signature) and their
                       counters; stacks_changed, fast_stats
     fast_forward.cc   UnwrapInputs (HandlerStack.execute's unwrap in C) and
                       RunForward (a level whose handler does not execute the op)
     fast_hook.cc      CallHook (HandlerStack.call_hook's frame) and RunHook (a Python
                       execute hook run from C, on the op's first stack)
     fast_record.cc    RunAfterExecute (a level with after_execute: forward, then
                       the handler's after_execute)
     handler_hooks.h   the slot through which handler-specific C++ (cc/handlers/)
                       provides C implementations of hooks (kPlugin, a C execute
                       tried by RunHook, a C after_execute)

   Everything lives in namespace tf_ophandlers::fast. Common contract, unless a function
   says otherwise:
   - GIL: held on entry and on return; released only around TFE_Execute (RunPhysical,
     ExecuteOnPhysical, and through them every Run*).
   - Handles: `in` arrays are borrowed; `outputs` receive new handles owned by the
     caller; `*num_outputs` is the capacity of `outputs` on entry and the count on
     success.
   - The Run* "handled" contract: a Run* returning false did nothing: no handle created
     or released, `status` untouched, no Python exception set; the caller takes the
     Python path (core/dispatch.py), which gives the same results and errors. Returning
     true means the op was handled: `status` tells whether it succeeded (a Python
     exception raised on the way is converted by StatusFromPyErr, none is left set).
   - References: "borrowed"/"new" describe Python references; a Decision's pointers are
     borrowed from the stack, which is alive while its op runs.
   - A function releases what it holds through owners (boundary/owners.h PyRef,
     boundary/op.h OpRef), in the reverse order of their declarations, on every exit.
*/
#ifndef TF_OPHANDLERS_FAST_INTERNAL_H_
#define TF_OPHANDLERS_FAST_INTERNAL_H_

#include <Python.h>

#include <cstdint>

#include "absl/container/inlined_vector.h"

#include "fast/fast_path.h"
#include "fast/handler_hooks.h"
#include "native/native_internal.h"
#include "boundary/op.h"
#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/tf_status.h"

namespace tf_ophandlers {
namespace fast {

// How a stack runs an op type (HandlerStack._oh_fast; the values are core/stack.py's).
enum Kind : int {
  kPython = 0,   // the Python path (a Python execute hook, or unknown)
  kForward = 1,  // the handler does not execute this op: forward it to the next stack
  kNative = 2,   // a C/C++ handler (native.h)
  kHook = 3,     // a Python execute hook, called from C (the op's first stack only)
  kAfterExecute = 4,  // forward to the next stack, then after_execute (RunAfterExecute)
  kPlugin = 5,   // the handler's execute in C (HandlerHooks::run_plugin), else as kHook
};

// One stack's decision for one op type. Callers copy it before running anything that may
// decide again (a nested Decide may clear the cache the pointer points into).
struct Decision {
  int kind = kPython;
  PyObject* next = nullptr;  // borrowed: the stack holds it, and the stack is alive
  PyObject* handler = nullptr;  // kNative: the stack's handler, borrowed (the stack holds it)
  bool transient = true;     // resource outputs stay on the next stack
  bool default_copy_on = false;  // the handler's copy_on is OpHandler's (a move)
  bool copy_all = true;      // every foreign input is copied on (no needs_copy, no deferral)
  // kForward of a type outside the handler's handles_ops: an op with an input whose
  // representation is not a tensor runs the execute hook (RunHook) instead of Python.
  bool hook_objects = false;
};

// Which inputs that are not `stack`'s an unwrap passes down as they are.
enum class Pass {
  kNone,      // none (each needs the handler's copy_on hook: Python)
  kAny,       // every one (the default copy_on moves it to the next stack: RunForward)
  kPhysical,  // physical ones, when the next stack is PHYSICAL (after_execute: RunAfterExecute)
};

// The deepest level RunOn descends to before declining (the Python path then runs).
constexpr int kMaxDepth = 64;

// The runtime state and interned names shared with the native path (native_internal.h).
using native_internal::g_physical;
using native_internal::g_state;
using native_internal::s_current;
using native_internal::s_device;
using native_internal::s_execute;
using native_internal::s_frames;
using native_internal::s_handler;
using native_internal::s_mode;
using native_internal::s_next;
using native_internal::StateGet;

// Interned attribute names of the fast path: set once by fast_setup (fast_path.cc; one
// reference per process, never released), null before it.
extern PyObject* s_fast;           // "_oh_fast"
extern PyObject* s_value_dtype;    // "value_dtype"
extern PyObject* s_wants_copy;     // "wants_copy"
extern PyObject* s_copy_on_value;  // "_copy_on_value"
extern PyObject* s_below;          // "_below"
extern PyObject* s_not_a_list;     // "_raise_not_a_list"
extern PyObject* s_wrap_eager;     // "_wrap_eager"
extern PyObject* s_after_execute;  // "after_execute"
extern PyObject* s_sig;            // "_oh_sig"
extern PyObject* s_physical_copy;  // "_physical_copy_on" (HandlerStack: physical_copy_of)

// Set once a stack that may take the fast path exists (stacks_changed); g_fast_ops
// counts the ops TryFastExecute handled (fast_stats). Guarded by the GIL. Defined in
// fast_decision.cc.
extern bool g_enabled;
extern uint64_t g_fast_ops;

// ---- fast_decision.cc ---------------------------------------------------------------

// The decision for `stack` and `type`, from this thread's few last hits, the per-stack
// cache, the shared cache (by the stack's `_oh_sig`), or asked from Python
// (`stack._oh_fast(type)`) on a miss; a C/C++ handler's stack is decided in C. Returns a
// pointer into the cache, valid until the next Decide or stacks_changed (copy it), or
// null when the stack cannot be asked (the Python path then decides). GIL: held; never
// leaves a Python exception set (an exception of `_oh_fast` is cleared: null).
const Decision* Decide(PyObject* stack, const char* type);

// stacks_changed(enable) and fast_stats() (kFastModuleMethods). Python C-API contract:
// a new reference, or null with an exception set. GIL: held.
PyObject* PyStacksChanged(PyObject*, PyObject* arg);
PyObject* PyFastStats(PyObject*, PyObject*);

// ---- fast_path.cc ---------------------------------------------------------------------

// Runs the op on `stack` at nesting `depth` (0: the op's first stack) as its decision
// says: PHYSICAL (RunPhysical), kForward, kNative (NativeStackRun), kAfterExecute, or kHook
// and kPlugin (depth 0 only). The Run* "handled" contract above.
bool RunOn(PyObject* stack, const TFE_Op* src, const char* type, const char* device,
           int n_in, TFE_TensorHandle** in, int* num_outputs, TFE_TensorHandle** outputs,
           TF_Status* status, int depth);

// Runs `type` on PHYSICAL at `state.device`: declines (false) when an input is a handler
// tensor (a copy-off: Python) or the device cannot be read; otherwise ExecuteOnPhysical
// (true, the result in `status`).
bool RunPhysical(const TFE_Op* src, const char* type, int n_in, TFE_TensorHandle** in,
                 int* num_outputs, TFE_TensorHandle** outputs, TF_Status* status);

// RunAfterExecute's physical TFE_Op, handed over instead of copied (EndBorrow): after
// KeepNextPhysicalOp, the next ExecuteOnPhysical on this thread that succeeds leaves its
// TFE_Op, inputs released, for TakeKeptPhysicalOp (which also cancels a keep that no
// execution took), owned by the caller; ReturnPhysicalOp gives an op not kept back to
// the thread's cache (or deletes it). GIL: held (thread-local state).
void KeepNextPhysicalOp();
TFE_Op* TakeKeptPhysicalOp();
void ReturnPhysicalOp(TFE_Op* op);

// ---- fast_forward.cc ------------------------------------------------------------------

// HandlerStack.execute's unwrap in C: `values[i]` (n_in slots) gets the physical handle
// of each input that is a Python payload of `stack` holding an EagerTensor (borrowed from
// the payload; `own[i]`, when `own` is not null, the payload's value, borrowed, else
// null), and `in[i]` itself for an input `pass` lets through. Returns false (nothing
// done) when an input needs Python: a payload of `stack` that is not an EagerTensor, or a
// foreign input needing a copy_on hook, unless `foreign` is not null: such an input then
// gets `values[i]` = `in[i]` (`own[i]` null) and its index is appended to `*foreign`, for
// the caller to copy on (RunAfterExecute over a Python execute hook). On false, `*foreign` may
// hold indices of inputs seen before the one that declined. `in` borrowed. Never fails
// otherwise; no Python exception set. GIL: held.
bool UnwrapInputs(PyObject* stack, Pass pass, bool next_physical, int n_in,
                  TFE_TensorHandle** in, TFE_TensorHandle** values, PyObject** own,
                  absl::InlinedVector<int, 4>* foreign = nullptr);

// HandlerStack.execute's forwarding path for a handler that does not execute `type`
// (kForward): unwrap in C, RunOn the next stack, wrap the outputs that stay on the
// stacks as payloads of `stack` (no EagerTensor made). Forwarding levels right below
// that take every input as it is (kForward, transient, default copy_on) are skipped:
// their unwrap runs here, the op runs on the first level below them, and the payloads
// record them (payload.h `lazy`; their tensors are made by PayloadValue when Python asks).
// The Run* "handled" contract.
bool RunForward(PyObject* stack, const Decision& d, const TFE_Op* src, const char* type,
                const char* device, int n_in, TFE_TensorHandle** in, int* num_outputs,
                TFE_TensorHandle** outputs, TF_Status* status, int depth);

// ---- fast_hook.cc ---------------------------------------------------------------------

// Whether foreign input `index` (handle `h`) of `op` is copied onto `stack` before its hook
// runs, as HandlerStack.execute decides: always for a tensor of a stack built on this one
// (its representation here: a recording handler over one that takes foreign inputs as
// they are must still see the tensor it recorded, not the wrapper of a handler above);
// else as `stack.wants_copy(op, index)` says. Returns 1 or 0, or -1 with a Python error
// set. Arguments borrowed. GIL: held.
int WantsCopy(PyObject* stack, PyObject* op, int index, TFE_TensorHandle* h);


// Runs `fn(a, b[, c])` as HandlerStack.call_hook does: `stack` pushed on state.frames and
// state.current set to `next` meanwhile (restored on failure too, keeping the error).
// Arguments borrowed. Returns a new reference, or null with a Python exception set.
// GIL: held.
PyObject* CallHook(PyObject* stack, PyObject* next, PyObject* fn, PyObject* a, PyObject* b,
                   PyObject* c = nullptr);

// kHook, on the op's first stack: HandlerStack.execute for a Python handler whose
// execute hook runs for the op (unwrap and copy-on, the hook, the wrap, the dispatcher's
// output validation), only the hooks in Python. Always handled (returns true): errors
// are reported through `status` as the Python path raises them.
bool RunHook(PyObject* stack, const Decision& d, const TFE_Op* src, const char* type,
             const char* device, int n_in, TFE_TensorHandle** in, int* num_outputs,
             TFE_TensorHandle** outputs, TF_Status* status);

// ---- fast_record.cc -------------------------------------------------------------------

// kAfterExecute: forward (as RunForward), then one call of the handler's
// `after_execute(op, inputs, outputs)` (in the hook's frame, or its C implementation
// from the hook slot, handler_hooks.h), then wrap. Returns false
// (nothing done) for inputs that need a copy_on hook; once the op ran, always handled,
// an exception of after_execute reaching the user through `status`.
bool RunAfterExecute(PyObject* stack, const Decision& d, const TFE_Op* src, const char* type,
               const char* device, int n_in, TFE_TensorHandle** in, int* num_outputs,
               TFE_TensorHandle** outputs, TF_Status* status, int depth);

// ---- fast_convert.cc: skip_trace_execute's non-tensor inputs (fast_trace.cc) ----------

// kNumber: a Python int or float; kList: a list or tuple of them (nested); kObject: an
// object with `__tf_tensor__` that is not a resource variable (a Keras variable).
enum class InputKind { kTensor, kNumber, kList, kObject, kOther };
// Never sets an exception. GIL: held.
InputKind ClassifyInput(PyObject* value);
// `value` (of `kind`, not kTensor/kOther) as TensorFlow's conversion for the op makes it,
// with dtype `want` (0: inferred), on `device_name`: a new handle, or null with no
// exception set (TensorFlow's function then converts it, raising its error). GIL: held.
TFE_TensorHandle* ConvertInput(PyObject* value, InputKind kind, TF_DataType want,
                               const char* device_name);
// Imports what ClassifyInput and ConvertInput use; false with an exception set.
bool SetupConvert();

}  // namespace fast
}  // namespace tf_ophandlers

#endif  // TF_OPHANDLERS_FAST_INTERNAL_H_
