/* tf-ophandlers C++ boundary: the per-op fast path (internal header). Implementation:
   fast_path.cc (entry points), fast_decision.cc, fast_forward.cc, fast_hook.cc and
   fast_record.cc; what those share, and each function's contract: fast_internal.h.
   Handler-specific C++ (cc/handlers/) plugs in through one slot, handler_hooks.h: this
   layer names no shipped handler. fast_trace.cc (kTraceModuleMethods, below) is
   TensorFlow's own op fast path without its stack capture, which stands in for it while
   a handler that asks for it (core/skip_trace.py) is open.

   The dispatcher's execute callback (device.cc) first offers every op to
   TryFastExecute, which runs it without any Python frame when every stack it passes
   through lets it:
   - PHYSICAL: every input is a physical tensor; the op is re-executed with
     TFE_Execute on `state.device` (as core/stack.py's PhysicalStack.execute does);
   - a stack whose handler does not run `execute` for this op type (a Python handler
     that leaves `execute` at its default, or whose `handles_ops` excludes the type):
     inputs on the stack are unwrapped in C, the op runs on the next stack, outputs are
     wrapped in C (HandlerStack.execute's forwarding path);
   - a stack of a C/C++ handler (native.h): its execute hook runs in C;
   - on the op's first stack only, a Python handler whose `execute` runs for the op:
     C does HandlerStack.execute's unwrap and copy-on (calling `_copy_on_value` and
     `wants_copy` for inputs that are not the stack's), `call_hook`'s frame, the wrap
     (WrapOutputs, or `_wrap_eager` when the next stack is not PHYSICAL) and the
     dispatcher's output validation (device.h TakeOutputs), so the hook is the only
     Python on the path.
   - at any depth, a Python handler that defines `after_execute` (OpHandler; a tape):
     inputs on the stack are unwrapped in C (a physical input passes as it is when the
     next stack is PHYSICAL), the op runs on the next stack, `after_execute(op, inputs,
     outputs)` is the one call, in the hook's frame, and the outputs are wrapped as for a
     forwarding level (RunAfterExecute, kind FAST_AFTER_EXECUTE); a handler whose
     after_execute is implemented in C (the hook slot's after_execute_c) is called
     without a hook frame.
   - on the op's first stack, a handler whose class declares a C implementation of its
     execute hook (FAST_PLUGIN): the hook slot's run_plugin runs the op, taking its
     common ops in C and handing the others to the hook as above.
   Copy ops run only on the op's first stack, through its execute hook, when the
   handler declares `handles_copy = True` (FAST_HOOK). Anything else (a function call
   op, other copy ops and `_EagerConst`, ops that run Python
   inside their kernel, a function being replayed, `returns_off_stack` handlers, a Python
   hook below a forwarding level, an input no level below owns) returns "not handled"
   before anything was done, and the callback takes the Python path
   (core/dispatch.py), which gives the same results and errors.

   The decision per (stack, op type) is asked once from Python
   (`HandlerStack._oh_fast(op_type)`) and kept in a bounded C++ cache keyed by the stack
   object and the op type. Python calls `_C.stacks_changed()` whenever a stack is built
   (HandlerStack.__init__); that clears the cache, so an entry can never outlive the
   stack it describes (a new stack at a dead one's address is built first). Handler
   attributes the decision reads (`execute` overridden, `handles_ops`, `copy_on`,
   `transient`) are read when the stack first sees an op type.

   A second bounded cache shares decisions between stacks: keyed by the stack's
   `_oh_sig` (core/fast_decision.py fast_signature: one canonical Python object per declaration,
   i.e. everything `_oh_fast` reads besides the op type and the next stack; None when the
   decision may depend on the instance) and the op type, holding a strong reference to
   the signature object (so its address cannot be reused while the entry lives). It keeps
   only the stack-independent part; the next stack is read from the stack on a hit. It
   survives stacks_changed, so a fresh handler per step does not ask Python again.
*/
#ifndef TF_OPHANDLERS_FAST_PATH_H_
#define TF_OPHANDLERS_FAST_PATH_H_

#include <Python.h>

#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/tf_status.h"

namespace tf_ophandlers {

// Runs `op` (type `type`, requested device `device`, `num_inputs` flat inputs, all
// borrowed) without entering Python if every stack on its way allows it (see above).
// Returns false when it does not: nothing was done, `status` is untouched and no Python
// exception is set; the caller takes the Python path. Returns true when it ran the op:
// `status` tells whether it succeeded (a kernel's or a C handler's error, as TensorFlow
// or the handler reported it), and on success `outputs` holds `*num_outputs` new handles
// (`*num_outputs` is the capacity on entry). GIL: must be held; released around
// TFE_Execute.
bool TryFastExecute(const TFE_Op* op, const char* type, const char* device, int num_inputs,
                    int* num_outputs, TFE_TensorHandle** outputs, TF_Status* status);

// The fast path's run of `op` on `stack` when `stack` is not the op's first stack (a C/C++
// handler's execute_next, native_execute.cc): PHYSICAL, a forwarding level or a C/C++
// handler run in C; a level whose Python execute hook runs for the op is declined.
// Same contract as TryFastExecute (`in` borrowed handles; false: nothing done, `status`
// untouched, no Python exception set). GIL: held; released around TFE_Execute.
bool FastRunOn(PyObject* stack, const TFE_Op* op, const char* type, const char* device,
               int n_in, TFE_TensorHandle** in, int* num_outputs, TFE_TensorHandle** outputs,
               TF_Status* status);

// Runs `type` with `src`'s attributes on the physical `device` (a C string; "" lets
// TensorFlow place it) with the physical handles `in` (borrowed), reusing this thread's
// TFE_Op. The one physical execution of both C paths (a forwarding level's PHYSICAL and
// a C/C++ handler's execute_next). `*num_outputs` is the capacity of `outputs` on entry;
// on success they hold `*num_outputs` new handles. Failures go to `status` (OK on
// entry). GIL: held and released around TFE_Execute; or, with `gil_held` false, not
// held at all (the no-GIL path, NativeNoGilExecute).
void ExecuteOnPhysical(const TFE_Op* src, const char* type, const char* device, int n_in,
                       TFE_TensorHandle** in, int* num_outputs, TFE_TensorHandle** outputs,
                       TF_Status* status, bool gil_held = true);

// Whether ops on `stack` must take the Python path now: a handler of it may change what
// ops compute (HandlerStack._substituting, OpHandler.changes_computation) and a TensorFlow
// tape or accumulator is recording, so HandlerStack.execute records what the handler
// runs for that tape. False at the cost of one atomic load while no such stack lives.
// GIL: must be held.
bool SubstitutesUnderTape(PyObject* stack);
// Whether `stack` has such a handler (whatever the tapes): the no-GIL path, which cannot
// ask for the tapes, never adopts it. GIL: must be held.
bool MaySubstitute(PyObject* stack);

// A counter every stacks_changed advances (a stack was built, so a dead stack's address
// may now name another stack). Facts remembered about a stack by its address are valid
// while it is unchanged. GIL: not needed (an atomic load).
uint64_t StacksGeneration();

// Wraps what an execute hook of `stack` returned (`values`, borrowed: a list or tuple)
// as handler tensors of `stack`, as `_C.wrap_outputs` does: a tensor gives its own dtype,
// another representation asks `value_dtype(value)` (borrowed callable); with
// `transient`, resource tensors are returned as they are. `op_type` (borrowed str, may
// be null) names the op in errors. Returns a new list, or null with a HandlerOutputError
// naming the handler, the hook and the op. Defined in module.cc. GIL: must be held.
PyObject* WrapOutputs(PyObject* stack, PyObject* values, bool transient,
                      PyObject* value_dtype, PyObject* op_type);

// Fills the fast path's hook slot (handler_hooks.h) with the handler-specific C++
// compiled into the extension and adds their module functions to `module` (borrowed).
// Called once by PyInit__C, before any op runs. Returns false with a Python exception
// set. GIL: held.
bool InstallHandlerHooks(PyObject* module);

// The module functions of the fast path (fast_setup, stacks_changed, fast_stats), appended
// to the module's method table by module.cc. Null-terminated.
extern PyMethodDef kFastModuleMethods[];
// skip_trace_setup / skip_trace_execute (fast_trace.cc): TensorFlow's op fast path
// without its stack capture, for ops placed on the dispatcher while a handler that asks
// for it is open (core/skip_trace.py).
extern PyMethodDef kTraceModuleMethods[];

}  // namespace tf_ophandlers

#endif  // TF_OPHANDLERS_FAST_PATH_H_
