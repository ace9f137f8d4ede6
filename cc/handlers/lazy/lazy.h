/* tf-ophandlers: oh.Lazy's C++ (internal header): its common ops recorded in C
   (fast_lazy.cc, the hook slot's kPlugin: cc/fast/handler_hooks.h `run_plugin`) and the
   pass over pending nodes of a value request (fast_lazy_plan.cc). Registered with the
   fast path by cc/handlers/register.cc; handlers/lazy/handler.py is the reference.
   Contracts as cc/fast/fast_internal.h's (GIL held, `in` borrowed, the Run* contract;
   the Py* functions follow the Python C-API contract: a new reference, or null with an
   exception set).
*/
#ifndef TF_OPHANDLERS_HANDLERS_LAZY_LAZY_H_
#define TF_OPHANDLERS_HANDLERS_LAZY_LAZY_H_

#include <Python.h>

#include "fast/fast_internal.h"

namespace tf_ophandlers {
namespace fast {

// The hook slot's run_plugin (kPlugin), on the op's first stack: oh.Lazy's execute for a
// stateless op over PHYSICAL with known output dtypes, a cached signature and inputs
// that are the stack's LazyValues or physical non-resource tensors, recorded in C (the
// hook's _Node and LazyValues, appended to the handler's `_pending`); anything else runs
// RunHook. Always handled (returns true): errors through `status`.
bool RunLazy(PyObject* stack, const Decision& d, const TFE_Op* src, const char* type,
             const char* device, int n_in, TFE_TensorHandle** in, int* num_outputs,
             TFE_TensorHandle** outputs, TF_Status* status);

// What lazy_setup registered (strong references, for the process), null before it;
// shared by fast_lazy.cc (recording) and fast_lazy_plan.cc (value requests).
struct LazyTypes {
  PyTypeObject* value = nullptr;  // LazyValue
  PyTypeObject* node = nullptr;   // _Node
  PyObject* sequence = nullptr;   // lazy._sequence (an itertools.count)
  PyObject* sigs = nullptr;       // lazy_compile.sigs: (op type, enums) -> signature
  PyObject* dtypes = nullptr;     // lazy._dtypes: enum -> tf.DType
  PyObject* stateful = nullptr;   // lazy._stateful: op type -> whether it runs eagerly
  PyObject* s_pending = nullptr;  // "_pending"
  PyObject* s_chunk_ops = nullptr;
  PyObject* s_recorded = nullptr;
  PyObject* s_live_nodes = nullptr;
  PyObject* s_prune = nullptr;
  // Slot offsets (LazyValue: node, index, dtype, value; _Node: the rest).
  Py_ssize_t v_node = 0, v_index = 0, v_dtype = 0, v_value = 0;
  Py_ssize_t n_seq = 0, n_sig = 0, n_op = 0, n_device = 0, n_inputs = 0, n_outputs = 0,
             n_values = 0, n_specs = 0, n_next = 0, n_failed = 0;
};
extern LazyTypes g_lazy;
extern bool g_lazy_ready;

// Slot `offset` of a `__slots__` object (may be null: unset).
inline PyObject*& Slot(PyObject* o, Py_ssize_t offset) {
  return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + offset);
}

// ---- fast_lazy_plan.cc: the value requests (Lazy._run) ------------------------------

// lazy_upstream(roots) -> list: the pending nodes `roots` depend on through pending
// producers, roots included, in recording order (Lazy._run). Python C-API contract.
PyObject* PyLazyUpstream(PyObject*, PyObject* args);

// lazy_plan(order, needed, specs, want_plan) -> (plan, key, kept, external, ext_specs):
// Lazy._run's pass over the pending nodes `order` (handlers/lazy/handler.py says what each is;
// `key` one bytes object encoding every node's op type, attributes, wiring, device and
// live outputs; `plan` None unless `want_plan`; `ext_specs` the external inputs' (dtype
// enum, shape) when `specs`, else None). Python C-API contract. GIL: held.
PyObject* PyLazyPlan(PyObject*, PyObject* args);

// lazy_computed(order): marks the nodes computed (inputs None, releasing them).
PyObject* PyLazyComputed(PyObject*, PyObject* args);

// lazy_setup(LazyValue, _Node, sequence, sigs, dtypes, stateful) (handlers/lazy/handler.py
// at import): the types and caches RunLazy uses; lazy_plan, lazy_upstream,
// lazy_computed (above). Added to `_C` through the hook slot. Null-terminated.
extern PyMethodDef kLazyModuleMethods[];

}  // namespace fast
}  // namespace tf_ophandlers

#endif  // TF_OPHANDLERS_HANDLERS_LAZY_LAZY_H_
