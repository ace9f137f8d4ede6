// tf-ophandlers: the per-op fast path's entry points (TryFastExecute, FastRunOn),
// its dispatch per level (RunOn) and the physical execution. Contracts: fast_path.h,
// fast_internal.h.
#define PY_SSIZE_T_CLEAN
#include "fast/fast_path.h"
#include "fast/fast_internal.h"

#include <atomic>
#include <cstring>
#include <string>
#include <unordered_map>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "boundary/device.h"
#include "boundary/handler_tensor.h"
#include "native/native.h"
#include "native/native_internal.h"
#include "boundary/op.h"
#include "boundary/runtime.h"
#include "boundary/status.h"
#include "tensorflow/c/eager/immediate_execution_operation.h"
#include "tensorflow/c/eager/tfe_op_internal.h"

// TensorFlow's tape-set query (pywrap_tfe.h; lib_pywrap_tensorflow_common.so).
PyObject* TFE_Py_TapeSetIsEmpty();

namespace tf_ophandlers {

// Live stacks with a handler that may change what ops compute (substituting_stacks).
std::atomic<int> g_substituting{0};

bool MaySubstitute(PyObject* stack) {
  if (g_substituting.load(std::memory_order_relaxed) <= 0) return false;
  static PyObject* name = PyUnicode_InternFromString("_substituting");
  PyObject* v = name != nullptr ? PyObject_GetAttr(stack, name) : nullptr;
  if (v == nullptr) {
    PyErr_Clear();
    return true;  // unknown: the Python path decides
  }
  int t = PyObject_IsTrue(v);
  Py_DECREF(v);
  if (t < 0) PyErr_Clear();
  return t != 0;
}

bool SubstitutesUnderTape(PyObject* stack) {
  if (!MaySubstitute(stack)) return false;
  PyObject* empty = TFE_Py_TapeSetIsEmpty();
  if (empty == nullptr) {
    PyErr_Clear();
    return true;
  }
  int t = PyObject_IsTrue(empty);
  Py_DECREF(empty);
  return t != 1;
}

namespace fast {

HandlerHooks g_handler_hooks;

// Set by fast_setup (core/stack.py at import). Interned attribute names of the fast path.
PyObject* s_fast = nullptr;
PyObject* s_value_dtype = nullptr;
PyObject* s_wants_copy = nullptr;
PyObject* s_copy_on_value = nullptr;
PyObject* s_below = nullptr;
PyObject* s_not_a_list = nullptr;
PyObject* s_wrap_eager = nullptr;
PyObject* s_after_execute = nullptr;
PyObject* s_sig = nullptr;
PyObject* s_physical_copy = nullptr;
PyObject* s_releases = nullptr;

// Runs `type` on PHYSICAL: every input must be physical. GIL: held; released around
// TFE_Execute.
bool RunPhysical(const TFE_Op* src, const char* type, int n_in, TFE_TensorHandle** in,
                 int* num_outputs, TFE_TensorHandle** outputs, TF_Status* status) {
  for (int i = 0; i < n_in; ++i) {
    if (PayloadOf(in[i]) != nullptr) return false;  // to copy off: Python
  }
  PyObject* dev_obj = StateGet(s_device);  // borrowed; no Python runs before its use
  const char* device = dev_obj != nullptr ? PyUnicode_AsUTF8(dev_obj) : nullptr;
  if (device == nullptr) {
    PyErr_Clear();
    return false;
  }
  ExecuteOnPhysical(src, type, device, n_in, in, num_outputs, outputs, status);
  return true;  // ran (or failed like the Python path's TFE_Execute would)
}

// Whether an input is a Python payload of `stack` holding no tensor. GIL: held.
bool HasObjectInput(PyObject* stack, int n_in, TFE_TensorHandle** in) {
  for (int i = 0; i < n_in; ++i) {
    TFOH_Payload* p = PayloadOf(in[i]);
    if (p != nullptr && p->kind == TFOH_PAYLOAD_PYTHON &&
        reinterpret_cast<PyObject*>(p->stack) == stack && PayloadTensorHandle(p) == nullptr) {
      return true;
    }
  }
  return false;
}

bool IsCopyOp(const char* type) {
  return std::strncmp(type, "Copy", 4) == 0 &&
         (!std::strcmp(type, "CopyOn") || !std::strcmp(type, "CopyOff") ||
          !std::strcmp(type, "CopyOnGrad") || !std::strcmp(type, "CopyOffGrad"));
}

bool RunOn(PyObject* stack, const TFE_Op* src, const char* type, const char* device,
           int n_in, TFE_TensorHandle** in, int* num_outputs, TFE_TensorHandle** outputs,
           TF_Status* status, int depth) {
  // A copy op runs here only on the op's first stack, through the Python execute hook
  // of a handler taking every copy op like any op (`handles_copy = True`, decided
  // FAST_HOOK by fast_decision); elsewhere it has the stacks' copy rules (Python).
  const bool copy_op = IsCopyOp(type);
  if (copy_op && (stack == g_physical || depth > 0)) return false;
  if (stack == g_physical) return RunPhysical(src, type, n_in, in, num_outputs, outputs, status);
  if (depth > kMaxDepth) return false;
  const Decision* d = Decide(stack, type);
  if (d == nullptr) return false;
  if (copy_op && d->kind != kHook) return false;
  switch (d->kind) {
    case kForward: {
      Decision copy = *d;  // the cache may be cleared by nested decisions
      if (RunForward(stack, copy, src, type, device, n_in, in, num_outputs, outputs, status,
                     depth)) {
        return true;
      }
      // Nothing done. An input of this stack whose representation is not a tensor (a
      // handler's own object) makes HandlerStack.execute call the hook for a type
      // outside handles_ops: the C hook path does the same around it.
      if (!copy.hook_objects || depth > 0 || !HasObjectInput(stack, n_in, in)) return false;
      return RunHook(stack, copy, src, type, device, n_in, in, num_outputs, outputs, status);
    }
    case kNative: {
      Decision copy = *d;
      return NativeStackRun(stack, copy.handler, copy.next, src, type, device, n_in, in,
                            num_outputs, outputs, status, /*first_stack=*/depth == 0);
    }
    case kAfterExecute: {
      Decision copy = *d;
      return RunAfterExecute(stack, copy, src, type, device, n_in, in, num_outputs, outputs,
                             status, depth);
    }
    case kHook: {
      if (depth > 0) return false;  // below a forwarding level: its copy-on rules, Python
      Decision copy = *d;
      return RunHook(stack, copy, src, type, device, n_in, in, num_outputs, outputs, status);
    }
    case kPlugin: {
      if (depth > 0) return false;  // as kHook
      Decision copy = *d;
      if (g_handler_hooks.run_plugin == nullptr) {  // no C implementation compiled in
        return RunHook(stack, copy, src, type, device, n_in, in, num_outputs, outputs, status);
      }
      return g_handler_hooks.run_plugin(stack, copy, src, type, device, n_in, in, num_outputs,
                                        outputs, status);
    }
    default:
      return false;
  }
}

// Ops the fast path never takes: _EagerConst (its own rule in Python) and ops running
// Python in their kernel (tf.py_function), whose body must run with state.current set
// to the next stack. Copy ops are taken only as RunOn says.
bool Excluded(const char* type) {
  if (type[0] == '_' && std::strcmp(type, "_EagerConst") == 0) return true;
  return std::strstr(type, "PyFunc") != nullptr;
}

// fast_setup(state, PHYSICAL)
PyObject* PyFastSetup(PyObject*, PyObject* args) {
  PyObject *state, *physical;
  if (!PyArg_ParseTuple(args, "OO", &state, &physical)) return nullptr;
  if (!native_internal::SetSharedState(state, physical)) return nullptr;
  using native_internal::InternOnce;
  if (!InternOnce(&s_fast, "_oh_fast") ||
      !InternOnce(&s_value_dtype, "value_dtype") || !InternOnce(&s_wants_copy, "wants_copy") ||
      !InternOnce(&s_copy_on_value, "_copy_on_value") || !InternOnce(&s_below, "_below") ||
      !InternOnce(&s_not_a_list, "_raise_not_a_list") ||
      !InternOnce(&s_wrap_eager, "_wrap_eager") ||
      !InternOnce(&s_after_execute, "after_execute") || !InternOnce(&s_sig, "_oh_sig") ||
      !InternOnce(&s_physical_copy, "_physical_copy_on") ||
      !InternOnce(&s_releases, "_releases")) {
    return nullptr;
  }
  Py_RETURN_NONE;
}

}  // namespace fast

using namespace fast;  // NOLINT: this file is the fast path's entry

bool TryFastExecute(const TFE_Op* op, const char* type, const char* device, int n_in,
                    int* num_outputs, TFE_TensorHandle** outputs, TF_Status* status) {
  if (!g_enabled || g_state == nullptr || type == nullptr || Excluded(type)) return false;
  PyObject* mode = StateGet(s_mode);  // borrowed; only identity matters
  if (mode != Py_None) return false;  // a function being replayed (or unknown): Python
  absl::InlinedVector<TFE_TensorHandle*, 4> in(n_in);
  for (int i = 0; i < n_in; ++i) {
    in[i] = TFE_OpGetFlatInput(op, i, status);
    if (TF_GetCode(status) != TF_OK) {
      TF_SetStatus(status, TF_OK, "");
      return false;
    }
  }
  PyObject* stack = nullptr;  // borrowed (kept alive by state.current or an input)
  if (device != nullptr && g_device_name == device) {
    // Placed by a scope: the current stack (dispatch.execute). PHYSICAL here means a
    // hook's own ops placed under an outer scope: Python decides those.
    PyObject* current = StateGet(s_current);  // state.current keeps it alive while the op runs
    if (current == nullptr || current == g_physical) return false;
    stack = current;
  } else {
    // Type-based dispatch: the one stack of the handler inputs (dispatch._stack_for);
    // inputs on two stacks need its rules: Python.
    for (int i = 0; i < n_in; ++i) {
      TFOH_Payload* p = PayloadOf(in[i]);
      if (p == nullptr) continue;
      PyObject* s = reinterpret_cast<PyObject*>(p->stack);
      if (stack != nullptr && s != stack) return false;
      stack = s;
    }
    if (stack == nullptr) return false;
    // A handler that may release its values (a closed tape, OpHandler.values_released):
    // Python asks it where the op runs. Only type-based dispatch reads this flag.
    PyObject* releases = PyObject_GetAttr(stack, s_releases);
    if (releases == nullptr) {
      PyErr_Clear();
      return false;
    }
    const bool may_release = releases == Py_True;
    Py_DECREF(releases);
    if (may_release) return false;
  }
  // A substituting handler under a TensorFlow tape: HandlerStack.execute records what it
  // runs, so the tape gets the gradient of that (the Python path).
  if (SubstitutesUnderTape(stack)) return false;
  if (!RunOn(stack, op, type, device, n_in, in.data(), num_outputs, outputs, status, 0)) {
    return false;
  }
  ++g_fast_ops;
  return true;
}

bool FastRunOn(PyObject* stack, const TFE_Op* op, const char* type, const char* device,
               int n_in, TFE_TensorHandle** in, int* num_outputs, TFE_TensorHandle** outputs,
               TF_Status* status) {
  if (!g_enabled || g_state == nullptr || Excluded(type)) return false;
  if (SubstitutesUnderTape(stack)) return false;  // as TryFastExecute
  // Depth 1: a Python execute hook (kHook) is only run from C on the op's first stack.
  return RunOn(stack, op, type, device, n_in, in, num_outputs, outputs, status, 1);
}

namespace {
// RunAfterExecute's hand-over of the physical TFE_Op (KeepNextPhysicalOp): whether the next
// ExecuteOnPhysical on this thread leaves its op here instead of in its cache.
thread_local bool t_keep_next = false;
thread_local TFE_Op* t_kept = nullptr;
thread_local TFE_Op* t_cached_op = nullptr;  // the reused TFE_Op (TFE_OpReset)
}  // namespace

void fast::KeepNextPhysicalOp() { t_keep_next = true; }

TFE_Op* fast::TakeKeptPhysicalOp() {
  t_keep_next = false;
  TFE_Op* op = t_kept;
  t_kept = nullptr;
  return op;
}

void fast::ReturnPhysicalOp(TFE_Op* op) {
  if (op == nullptr) return;
  if (t_cached_op == nullptr) {
    t_cached_op = op;
  } else {
    PoolOp(op);
  }
}

void ExecuteOnPhysical(const TFE_Op* src, const char* type, const char* device, int n_in,
                       TFE_TensorHandle** in, int* num_outputs, TFE_TensorHandle** outputs,
                       TF_Status* status, bool gil_held) {
  // Reuse this thread's TFE_Op (as ExecuteOp does); a nested use takes it out first.
  const bool keep = t_keep_next;
  t_keep_next = false;
  TFE_Op* tfe = t_cached_op;
  t_cached_op = nullptr;
  if (tfe == nullptr && gil_held) tfe = TakePooledOp();  // a released record's op
  tfe = ResetOrNewOp(tfe, type, device, status);
  if (TF_GetCode(status) == TF_OK) {
    TFE_OpAddAttrs(tfe, TFE_OpGetAttrs(src));
    for (int i = 0; i < n_in && TF_GetCode(status) == TF_OK; ++i) {
      TFE_OpAddInput(tfe, in[i], status);
    }
  }
  if (TF_GetCode(status) == TF_OK) {
    if (gil_held) {
      Py_BEGIN_ALLOW_THREADS;
      TFE_Execute(tfe, outputs, num_outputs, status);
      Py_END_ALLOW_THREADS;
    } else {
      TFE_Execute(tfe, outputs, num_outputs, status);
    }
  }
  if (tfe != nullptr) {
    if (keep && TF_GetCode(status) == TF_OK) {
      // The op holds exactly `src`'s attributes: a record keeps it (without its inputs)
      // instead of copying them again (EndBorrow).
      tensorflow::unwrap(tfe)->Clear();
      if (t_kept != nullptr) TFE_DeleteOp(t_kept);
      t_kept = tfe;
    } else if (t_cached_op == nullptr && TF_GetCode(status) == TF_OK) {
      t_cached_op = tfe;
    } else {
      TFE_DeleteOp(tfe);
    }
  }
}

PyObject* PySubstitutingStacks(PyObject*, PyObject* arg) {
  long delta = PyLong_AsLong(arg);
  if (delta == -1 && PyErr_Occurred()) return nullptr;
  g_substituting.fetch_add(static_cast<int>(delta), std::memory_order_relaxed);
  Py_RETURN_NONE;
}

PyMethodDef kFastModuleMethods[] = {
    {"fast_setup", PyFastSetup, METH_VARARGS,
     "fast_setup(state, PHYSICAL): what the C++ per-op fast path reads."},
    {"substituting_stacks", PySubstitutingStacks, METH_O,
     "substituting_stacks(delta): counts live stacks whose `_substituting` is true "
     "(while none lives, the fast paths never read it)."},
    {"stacks_changed", PyStacksChanged, METH_O,
     "stacks_changed(may_be_fast): a stack was built; clears the fast path's decisions."},
    {"nogil_forget", PyNoGilForget, METH_NOARGS,
     "nogil_forget(): drops this thread's no-GIL plan (a scope closed)."},
    {"fast_stats", PyFastStats, METH_NOARGS,
     "fast_stats() -> {hits, misses, fast_ops, clears, entries, maxsize, enabled, "
     "shared_hits, python_asks, shared_entries, shared_maxsize, nogil_ops, "
     "nogil_forward_ops}."},
    {nullptr}};

bool InstallHandlerHooks(PyObject* module) {
  if (!RegisterHandlerHooks(&g_handler_hooks)) return false;
  for (PyMethodDef* table : g_handler_hooks.methods) {
    if (table != nullptr && PyModule_AddFunctions(module, table) < 0) return false;
  }
  return true;
}

}  // namespace tf_ophandlers
