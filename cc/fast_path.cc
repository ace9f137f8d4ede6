// tf-ophandlers: the per-op fast path. Contracts: fast_path.h.
#define PY_SSIZE_T_CLEAN
#include "fast_path.h"

#include <cstring>
#include <string>
#include <unordered_map>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "device.h"
#include "handler_tensor.h"
#include "native.h"
#include "native_internal.h"
#include "op.h"
#include "runtime.h"
#include "status.h"

namespace tf_ophandlers {
namespace {

// How a stack runs an op type (HandlerStack._oh_fast; the values are core/stack.py's).
enum Kind : int {
  kPython = 0,   // the Python path (a Python execute hook, or unknown)
  kForward = 1,  // the handler does not execute this op: forward it to the next stack
  kNative = 2,   // a C/C++ handler (native.h)
  kHook = 3,     // a Python execute hook, called from C (the op's first stack only)
  kRecord = 4,   // forward to the next stack, then the handler's after_execute (RunRecord)
};

struct Decision {
  int kind = kPython;
  PyObject* next = nullptr;  // borrowed: the stack holds it, and the stack is alive
  PyObject* handler = nullptr;  // kNative: the stack's handler, borrowed (the stack holds it)
  bool transient = true;     // resource outputs stay on the next stack
  bool default_copy_on = false;  // the handler's copy_on is OpHandler's (a move)
  bool copy_all = true;      // every foreign input is copied on (no needs_copy, no deferral)
};

struct Key {
  PyObject* stack;
  std::string type;
  bool operator==(const Key& o) const { return stack == o.stack && type == o.type; }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    return std::hash<std::string>()(k.type) ^ (reinterpret_cast<size_t>(k.stack) >> 4) * 31;
  }
};

// Guarded by the GIL. Cleared by stacks_changed (every new stack) and when full.
constexpr size_t kMaxDecisions = 4096;
std::unordered_map<Key, Decision, KeyHash>* g_decisions = nullptr;
bool g_enabled = false;  // set once a stack that may take the fast path exists
uint64_t g_hits = 0, g_misses = 0, g_fast_ops = 0, g_clears = 0;

// Decisions shared by every stack with the same declaration signature (HandlerStack's
// `_oh_sig`: the handler class and everything `_oh_fast` reads, canonicalized in Python),
// so a fresh handler per step (`with Handler():` per step) does not ask Python again.
// The entry holds a strong reference to its signature object, so the address in the
// key cannot be reused by another object while the entry lives. Only the
// stack-independent part is kept (no `next`, read from the stack on a hit). Guarded by
// the GIL; not cleared by stacks_changed; cleared (references released) when full.
struct Shared {
  int kind = kPython;
  bool transient = true;
  bool default_copy_on = false;
  bool copy_all = true;
};
constexpr size_t kMaxShared = 4096;
std::unordered_map<Key, Shared, KeyHash>* g_shared = nullptr;  // Key.stack: the signature
uint64_t g_shared_hits = 0, g_python_asks = 0;

// Empties g_shared, releasing its signature references after the map is consistent
// (a release may run Python: a class or a function dying). GIL: held.
void ClearShared() {
  if (g_shared == nullptr || g_shared->empty()) return;
  absl::InlinedVector<PyObject*, 16> sigs;
  sigs.reserve(g_shared->size());
  for (auto& kv : *g_shared) sigs.push_back(kv.first.stack);
  g_shared->clear();
  for (PyObject* sig : sigs) Py_DECREF(sig);
}

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

// Set by fast_setup (core/stack.py at import). Interned attribute names of the fast path.
PyObject* s_fast = nullptr;
PyObject* s_value_dtype = nullptr;
PyObject* s_wants_copy = nullptr;
PyObject* s_copy_on_value = nullptr;
PyObject* s_not_a_list = nullptr;
PyObject* s_wrap_eager = nullptr;
PyObject* s_after_execute = nullptr;
PyObject* s_sig = nullptr;

constexpr int kMaxDepth = 64;

// The decision for `stack` and `type`, asked from Python on a miss. Returns null when
// the stack cannot be asked (the Python path then decides). GIL: held; never leaves a
// Python exception set.
// This thread's last few hits of Decide, compared by stack and type text: no std::string
// and no hash for a (stack, type) seen just before. An entry is valid while its
// generation is g_generation, which every clear of g_decisions advances (elements of an
// unordered_map never move otherwise).
uint64_t g_generation = 1;
struct RecentDecision {
  uint64_t generation = 0;
  PyObject* stack = nullptr;
  char type[40] = {0};
  const Decision* decision = nullptr;
};
constexpr int kRecentDecisions = 4;
thread_local RecentDecision t_recent[kRecentDecisions];
thread_local unsigned t_recent_next = 0;

void ClearDecisions() {
  g_decisions->clear();
  ++g_clears;
  ++g_generation;
}

const Decision* Decide(PyObject* stack, const char* type) {
  for (const RecentDecision& r : t_recent) {
    if (r.generation == g_generation && r.stack == stack && std::strcmp(r.type, type) == 0) {
      ++g_hits;
      return r.decision;
    }
  }
  if (g_decisions == nullptr) g_decisions = new std::unordered_map<Key, Decision, KeyHash>();
  Key key{stack, type};
  auto it = g_decisions->find(key);
  if (it != g_decisions->end()) {
    ++g_hits;
    if (std::strlen(type) < sizeof(RecentDecision::type)) {
      RecentDecision& r = t_recent[t_recent_next++ % kRecentDecisions];
      r.generation = g_generation;
      r.stack = stack;
      std::strcpy(r.type, type);
      r.decision = &it->second;
    }
    return &it->second;
  }
  ++g_misses;
  Decision d;
  // A C/C++ handler decides in C (NativeStackRun), without asking Python.
  PyObject* handler = PyObject_GetAttr(stack, s_handler);
  if (handler == nullptr) PyErr_Clear();
  bool native = handler != nullptr && PyObject_TypeCheck(handler, &NativeHandlerBaseType);
  Py_XDECREF(handler);
  handler = nullptr;
  // A function call op (a type without an OpDef) is replayed or taken whole in Python.
  if (native) {
    // The stack's handler and next stack are fixed for its life (HandlerStack.__init__),
    // so they are read once here, not per op.
    PyObject* next = PyObject_GetAttr(stack, s_next);
    if (next == nullptr) {
      PyErr_Clear();
      return nullptr;
    }
    Py_DECREF(next);  // the stack keeps it alive
    handler = PyObject_GetAttr(stack, s_handler);
    if (handler == nullptr) {
      PyErr_Clear();
      return nullptr;
    }
    Py_DECREF(handler);  // the stack keeps it alive
    d.kind = kNative;
    d.next = next;
    d.handler = handler;
  } else if (IsRegisteredOpType(type)) {
    // The stack's signature (None: its decisions are its own, not shared).
    PyObject* sig = PyObject_GetAttr(stack, s_sig);
    if (sig == nullptr) PyErr_Clear();
    if (sig == Py_None) Py_CLEAR(sig);
    if (g_shared == nullptr) g_shared = new std::unordered_map<Key, Shared, KeyHash>();
    auto sit = sig != nullptr ? g_shared->find(Key{sig, type}) : g_shared->end();
    if (sit != g_shared->end()) {
      ++g_shared_hits;
      Shared sh = sit->second;
      Py_DECREF(sig);  // the entry holds its own reference
      PyObject* next = PyObject_GetAttr(stack, s_next);
      if (next == nullptr) {
        PyErr_Clear();
        return nullptr;
      }
      Py_DECREF(next);  // the stack keeps its next stack alive
      d.kind = sh.kind;
      d.next = next;
      d.transient = sh.transient;
      d.default_copy_on = sh.default_copy_on;
      d.copy_all = sh.copy_all;
    } else {
      ++g_python_asks;
      PyObject* name = PyUnicode_FromString(type);
      PyObject* r = name != nullptr ? PyObject_CallMethodOneArg(stack, s_fast, name) : nullptr;
      Py_XDECREF(name);
      if (r == nullptr) {
        PyErr_Clear();
        Py_XDECREF(sig);
        return nullptr;
      }
      int kind = 0, transient = 1, default_copy_on = 0, copy_all = 1;
      PyObject* next = nullptr;
      if (!PyArg_ParseTuple(r, "iOppp", &kind, &next, &transient, &default_copy_on,
                            &copy_all)) {
        PyErr_Clear();
        Py_DECREF(r);
        Py_XDECREF(sig);
        return nullptr;
      }
      d.kind = kind;
      d.next = next;  // the stack keeps its next stack alive
      d.transient = transient != 0;
      d.default_copy_on = default_copy_on != 0;
      d.copy_all = copy_all != 0;
      Py_DECREF(r);
      if (sig != nullptr) {
        if (g_shared->size() >= kMaxShared) ClearShared();
        Shared sh;
        sh.kind = d.kind;
        sh.transient = d.transient;
        sh.default_copy_on = d.default_copy_on;
        sh.copy_all = d.copy_all;
        // The reference taken by GetAttr moves into the entry.
        if (!g_shared->emplace(Key{sig, type}, sh).second) Py_DECREF(sig);
        sig = nullptr;
      }
    }
  }
  if (g_decisions->size() >= kMaxDecisions) ClearDecisions();
  return &g_decisions->emplace(std::move(key), d).first->second;
}

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

bool RunOn(PyObject* stack, const TFE_Op* src, const char* type, const char* device,
           int n_in, TFE_TensorHandle** in, int* num_outputs, TFE_TensorHandle** outputs,
           TF_Status* status, int depth);

// Which inputs that are not `stack`'s an unwrap passes down as they are.
enum class Pass {
  kNone,      // none (each needs the handler's copy_on hook: Python)
  kAny,       // every one (the default copy_on moves it to the next stack: RunForward)
  kPhysical,  // physical ones, when the next stack is PHYSICAL (after_execute: RunRecord)
};

// HandlerStack.execute's unwrap in C: `values[i]` (n_in slots) gets the physical handle
// of each input that is a Python payload of `stack` holding an EagerTensor (borrowed from
// the payload; `own[i]`, when `own` is not null, the payload's value, borrowed, else
// null), and `in[i]` itself for an input `pass` lets through. Returns false (nothing
// done) when an input needs Python: a payload of `stack` that is not an EagerTensor, or a
// foreign input needing a copy_on hook. `in` borrowed. Never fails otherwise; no Python
// exception set. GIL: held.
bool UnwrapInputs(PyObject* stack, Pass pass, bool next_physical, int n_in,
                  TFE_TensorHandle** in, TFE_TensorHandle** values, PyObject** own) {
  for (int i = 0; i < n_in; ++i) {
    TFOH_Payload* p = PayloadOf(in[i]);
    if (own != nullptr) own[i] = nullptr;
    if (p != nullptr && reinterpret_cast<PyObject*>(p->stack) == stack) {
      if (p->kind != TFOH_PAYLOAD_PYTHON) return false;
      if (own != nullptr) {
        PyObject* v = PayloadValue(p);  // made now if the payload has only a handle
        if (v == nullptr) {
          PyErr_Clear();
          return false;
        }
        if (!EagerTensor_CheckExact(v)) return false;
        own[i] = v;
      }
      values[i] = PayloadTensorHandle(p);
      if (values[i] == nullptr) return false;  // not a tensor: the handler's execute
    } else if (pass == Pass::kAny ||
               (pass == Pass::kPhysical && p == nullptr && next_physical)) {
      // kAny: the default copy-on moves a tensor that is not this stack's onto the next
      // stack (stack.move_onto), where the next level unwraps it, or copies it on in
      // turn: so it is passed down as it is. One that no level below owns reaches
      // PHYSICAL as a handler tensor, and RunPhysical hands the op to Python (nothing
      // done yet). kPhysical: after_execute's contract says the handler's copy_on
      // leaves a physical input unchanged.
      values[i] = in[i];
    } else {
      return false;  // a copy_on hook to run: Python
    }
  }
  return true;
}

// HandlerStack.execute's forwarding path for a handler that does not execute `type`:
// unwrap in C, run on the next stack, wrap in C. GIL: held.
bool RunForward(PyObject* stack, const Decision& d, const TFE_Op* src, const char* type,
                const char* device, int n_in, TFE_TensorHandle** in, int* num_outputs,
                TFE_TensorHandle** outputs, TF_Status* status, int depth) {
  absl::InlinedVector<TFE_TensorHandle*, 4> values(n_in);
  if (!UnwrapInputs(stack, d.default_copy_on ? Pass::kAny : Pass::kNone, false, n_in, in,
                    values.data(), nullptr)) {
    return false;
  }
  int n = *num_outputs;
  absl::InlinedVector<TFE_TensorHandle*, 4> outs(n > 0 ? n : 1, nullptr);
  if (!RunOn(d.next, src, type, device, n_in, values.data(), &n, outs.data(), status,
             depth + 1)) {
    return false;
  }
  if (TF_GetCode(status) != TF_OK) return true;
  PyObject* producer = InternedString(type);
  int done = 0;
  for (; producer != nullptr && done < n; ++done) {
    TFE_TensorHandle* h = outs[done];
    TF_DataType dt = TFE_TensorHandleDataType(h);
    bool leaves = d.transient && dt == TF_RESOURCE;  // RFC "Placement of resource handles"
    if (!leaves && d.next != g_physical) {
      TFOH_Payload* p = PayloadOf(h);
      leaves = p == nullptr || reinterpret_cast<PyObject*>(p->stack) != d.next;
    }
    if (leaves) {
      outputs[done] = h;  // ownership moves to the caller
      continue;
    }
    // No EagerTensor for the value: made only if Python asks (PayloadValue).
    outs[done] = nullptr;  // taken by the payload in every case
    outputs[done] = NewHandlerTensorHandleFromHandle(stack, h, dt, producer);
    if (outputs[done] == nullptr) break;
  }
  Py_XDECREF(producer);
  if (done < n) {  // a failure (Python exception set)
    StatusFromPyErr(status);
    for (int j = 0; j < done; ++j) TFE_DeleteTensorHandle(outputs[j]);
    for (int j = done; j < n; ++j) {
      if (outs[j] != nullptr) TFE_DeleteTensorHandle(outs[j]);
    }
    return true;
  }
  *num_outputs = n;
  return true;
}

// Runs `fn(a, b[, c])` as HandlerStack.call_hook does: `stack` pushed on state.frames and
// state.current set to `next` meanwhile (restored on failure too, keeping the error).
// Returns a new reference, or null with a Python exception set. GIL: held.
PyObject* CallHook(PyObject* stack, PyObject* next, PyObject* fn, PyObject* a, PyObject* b,
                   PyObject* c = nullptr) {
  PyObject* frames = PyObject_GetAttr(g_state, s_frames);
  if (frames == nullptr) return nullptr;
  if (!PyList_Check(frames) || PyList_Append(frames, stack) < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "state.frames is not a list");
    Py_DECREF(frames);
    return nullptr;
  }
  PyObject* saved = PyObject_GetAttr(g_state, s_current);
  PyObject* r = nullptr;
  if (saved != nullptr && PyObject_SetAttr(g_state, s_current, next) == 0) {
    r = PyObject_CallFunctionObjArgs(fn, a, b, c, nullptr);
  }
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);
  if (saved != nullptr && PyObject_SetAttr(g_state, s_current, saved) < 0) PyErr_Clear();
  Py_ssize_t n = PyList_GET_SIZE(frames);
  if (n > 0 && PyList_SetSlice(frames, n - 1, n, nullptr) < 0) PyErr_Clear();
  PyErr_Restore(et, ev, tb);
  Py_XDECREF(saved);
  Py_DECREF(frames);
  return r;
}

// HandlerStack.execute for a Python handler whose execute hook runs for the op, on the
// op's first stack: unwrap and copy-on, the hook, and the wrap, with only the hook (and
// copy_on hooks) in Python; then the dispatcher's output validation (TakeOutputs).
// Always handled: errors are reported through `status` as the Python path raises them.
// GIL: held.
bool RunHook(PyObject* stack, const Decision& d, const TFE_Op* src, const char* type,
             const char* device, int n_in, TFE_TensorHandle** in, int* num_outputs,
             TFE_TensorHandle** outputs, TF_Status* status) {
  OpObject* op = NewOpObject(type, device, *num_outputs);
  if (op == nullptr) {
    StatusFromPyErr(status);
    return true;
  }
  op->borrowed = src;
  // Read per op (the handler may rebind them); not cached, so the cache keeps no handler
  // alive.
  PyObject* handler = PyObject_GetAttr(stack, s_handler);
  PyObject* execute = handler != nullptr ? PyObject_GetAttr(handler, s_execute) : nullptr;
  PyObject* value_dtype = nullptr;
  PyObject* values = execute != nullptr ? PyList_New(n_in) : nullptr;
  PyObject* result = nullptr;
  PyObject* wrapped = nullptr;
  absl::InlinedVector<int, 4> foreign;
  OpObject* outer = SwapCurrentOp(op);  // names the op in wrap errors (CurrentOpType)
  bool swapped = true;
  if (values == nullptr) goto fail;
  for (int i = 0; i < n_in; ++i) {
    TFOH_Payload* p = PayloadOf(in[i]);
    PyObject* v;
    if (p != nullptr && p->kind == TFOH_PAYLOAD_PYTHON &&
        reinterpret_cast<PyObject*>(p->stack) == stack) {
      v = PayloadValue(p);  // borrowed; made now if the payload has only a handle
      if (v == nullptr) goto fail;
      Py_INCREF(v);
    } else {
      v = native_internal::EagerTensorSharing(in[i]);
      if (v == nullptr) goto fail;
      foreign.push_back(i);
    }
    PyList_SET_ITEM(values, i, v);
  }
  for (int i : foreign) {
    if (!d.copy_all) {
      PyObject* idx = PyLong_FromLong(i);
      PyObject* want = idx ? PyObject_CallMethodObjArgs(stack, s_wants_copy, op, idx, nullptr)
                           : nullptr;
      Py_XDECREF(idx);
      int yes = want != nullptr ? PyObject_IsTrue(want) : -1;
      Py_XDECREF(want);
      if (yes < 0) goto fail;
      if (yes == 0) continue;
    }
    PyObject* moved = PyObject_CallMethodOneArg(stack, s_copy_on_value, PyList_GET_ITEM(values, i));
    if (moved == nullptr) goto fail;
    PyList_SetItem(values, i, moved);  // steals `moved`, releases the input
  }
  result = CallHook(stack, d.next, execute, reinterpret_cast<PyObject*>(op), values);
  if (result == nullptr) goto fail;
  if (!PyList_Check(result) && !PyTuple_Check(result)) {
    PyObject* r = PyObject_CallMethodObjArgs(stack, s_not_a_list, op, result, nullptr);
    Py_XDECREF(r);  // raises
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "execute did not return a list");
    goto fail;
  }
  if (d.next == g_physical) {
    value_dtype = PyObject_GetAttr(handler, s_value_dtype);
    if (value_dtype == nullptr) goto fail;
    wrapped = WrapOutputs(stack, result, d.transient, value_dtype, op->type);
  } else {
    // Outputs that left the stacks below (HandlerStack._wrap_eager).
    wrapped = PyObject_CallMethodOneArg(stack, s_wrap_eager, result);
  }
  if (wrapped == nullptr) goto fail;
  SwapCurrentOp(outer);
  swapped = false;
  TakeOutputs(op, src, wrapped, num_outputs, outputs, status);
  goto done;
fail:
  StatusFromPyErr(status);
done:
  if (swapped) SwapCurrentOp(outer);
  Py_XDECREF(wrapped);
  Py_XDECREF(result);
  Py_XDECREF(values);
  Py_XDECREF(value_dtype);
  Py_XDECREF(execute);
  Py_XDECREF(handler);
  EndBorrow(op, g_ctx);
  Py_DECREF(op);
  return true;
}

// ---- kRecord: a handler that records what ran (OpHandler.after_execute, a tape) -------
//
// HandlerStack.execute for a handler that defines `after_execute`: inputs on the stack
// are unwrapped in C (a physical input, when the next stack is PHYSICAL, is passed as it
// is: after_execute's contract says the handler's copy_on leaves it unchanged), the op
// runs on the next stack (RunOn, so further levels stay in C), then one Python call,
// `after_execute(op, inputs, outputs)` with the representations, in the hook's frame;
// the outputs are then wrapped as RunForward does.
//
// Over a Python execute hook (the next stack's decision is kHook: a tape inside
// oh.vectorized_map) the next level runs from C too (RunHook), with exactly the values
// the Python path hands to `next.execute(op, values)`: this stack's unwrapped inputs and,
// on the op's first stack (depth 0, where no forwarding level's copy rules came first),
// inputs from elsewhere copied on as HandlerStack.execute does (`wants_copy` when copies
// defer, then the stack's `_copy_on_value`, which runs the handler's copy_on hook; a
// tape records a CopyOn there). Returns false (nothing done) for inputs that need a
// copy_on hook in any other case. After a copy-on or the op ran, always handled; an
// exception of a hook reaches the user through `status` (StatusFromPyErr). GIL: held.
bool RunRecord(PyObject* stack, const Decision& d, const TFE_Op* src, const char* type,
               const char* device, int n_in, TFE_TensorHandle** in, int* num_outputs,
               TFE_TensorHandle** outputs, TF_Status* status, int depth) {
  absl::InlinedVector<TFE_TensorHandle*, 4> values(n_in);
  absl::InlinedVector<PyObject*, 4> own(n_in, nullptr);  // borrowed payload values
  // The next level when it is a Python execute hook (copied: Decide may clear the cache).
  Decision hook;
  bool over_hook = false;
  if (d.next != g_physical) {
    const Decision* nd = Decide(d.next, type);
    if (nd != nullptr && nd->kind == kHook) {
      hook = *nd;
      over_hook = true;
    }
  }
  // Inputs from elsewhere to copy on in C (over a hook, on the op's first stack only).
  absl::InlinedVector<int, 4> foreign;
  if (!UnwrapInputs(stack, Pass::kPhysical, d.next == g_physical, n_in, in, values.data(),
                    own.data())) {
    if (!over_hook || depth != 0) return false;
    for (int i = 0; i < n_in; ++i) {  // which inputs: nothing done yet
      TFOH_Payload* p = PayloadOf(in[i]);
      if (p != nullptr && reinterpret_cast<PyObject*>(p->stack) == stack) {
        if (p->kind != TFOH_PAYLOAD_PYTHON) return false;
        PyObject* v = PayloadValue(p);
        if (v == nullptr) {
          PyErr_Clear();
          return false;
        }
        if (!EagerTensor_CheckExact(v)) return false;
        own[i] = v;
        values[i] = PayloadTensorHandle(p);
        if (values[i] == nullptr) return false;
      } else {
        own[i] = nullptr;
        values[i] = in[i];
        foreign.push_back(i);
      }
    }
  }
  const int capacity = *num_outputs;
  int n = capacity;
  absl::InlinedVector<TFE_TensorHandle*, 4> outs(n > 0 ? n : 1, nullptr);
  absl::InlinedVector<bool, 4> leaves(n > 0 ? n : 1, false);
  absl::InlinedVector<PyObject*, 4> copied(n_in, nullptr);  // owned: copied-on inputs
  PyObject* py_in = nullptr;
  PyObject* py_out = nullptr;
  PyObject* handler = nullptr;
  PyObject* fn = nullptr;
  PyObject* r = nullptr;
  PyObject* producer = nullptr;
  OpObject* op = nullptr;
  int done = 0;
  if (!foreign.empty()) {
    // HandlerStack.execute's copy-on, before the op runs (nothing was done before).
    op = NewOpObject(type, device, capacity);
    if (op == nullptr) goto fail;
    op->borrowed = src;
    for (int i : foreign) {
      PyObject* t = native_internal::EagerTensorSharing(in[i]);
      if (t == nullptr) goto fail;
      if (!d.copy_all) {
        PyObject* idx = PyLong_FromLong(i);
        PyObject* want =
            idx ? PyObject_CallMethodObjArgs(stack, s_wants_copy, op, idx, nullptr) : nullptr;
        Py_XDECREF(idx);
        int yes = want != nullptr ? PyObject_IsTrue(want) : -1;
        Py_XDECREF(want);
        if (yes <= 0) {
          if (yes < 0) {
            Py_DECREF(t);
            goto fail;
          }
          copied[i] = t;  // passed down as it is
          continue;
        }
      }
      PyObject* moved = PyObject_CallMethodOneArg(stack, s_copy_on_value, t);
      Py_DECREF(t);
      if (moved == nullptr) goto fail;
      copied[i] = moved;
      if (!EagerTensor_CheckExact(moved)) {
        PyErr_Format(PyExc_TypeError,
                     "tf_ophandlers: the copy_on hook of %R returned a %s for input %d of op "
                     "%s, not a tensor of the next stack (a handler with after_execute "
                     "represents a tensor by a tensor of the next stack)",
                     stack, Py_TYPE(moved)->tp_name, i, type);
        goto fail;
      }
      values[i] = EagerTensor_Handle(moved);
    }
  }
  if (over_hook) {
    RunHook(d.next, hook, src, type, device, n_in, values.data(), &n, outs.data(), status);
  } else if (!RunOn(d.next, src, type, device, n_in, values.data(), &n, outs.data(), status,
                    depth + 1)) {
    // Nothing done (no copy-on happened: `foreign` is only filled over a hook).
    if (op != nullptr) {
      EndBorrow(op, g_ctx);
      Py_DECREF(op);
    }
    return false;
  }
  if (TF_GetCode(status) != TF_OK) {
    n = 0;  // no outputs to release
    goto cleanup;
  }
  // From here on the op ran: always handled. Python views of inputs and outputs.
  py_in = PyList_New(n_in);
  py_out = py_in != nullptr ? PyList_New(n) : nullptr;
  if (py_out == nullptr) goto fail;
  for (int i = 0; i < n_in; ++i) {
    PyObject* v = own[i] != nullptr ? own[i] : copied[i];
    if (v != nullptr) {
      Py_INCREF(v);
    } else {
      v = native_internal::EagerTensorSharing(in[i]);
      if (v == nullptr) goto fail;
    }
    PyList_SET_ITEM(py_in, i, v);
  }
  for (int j = 0; j < n; ++j) {
    TFE_TensorHandle* h = outs[j];
    TF_DataType dt = TFE_TensorHandleDataType(h);
    bool leave = d.transient && dt == TF_RESOURCE;  // RFC "Placement of resource handles"
    if (!leave && d.next != g_physical) {
      TFOH_Payload* p = PayloadOf(h);
      leave = p == nullptr || reinterpret_cast<PyObject*>(p->stack) != d.next;
    }
    leaves[j] = leave;
    PyObject* v;
    if (leave) {
      v = native_internal::EagerTensorSharing(h);  // the handle itself goes to the caller
    } else {
      v = EagerTensorFromHandle(h, false);  // owns `h` on success
      if (v != nullptr) outs[j] = nullptr;
    }
    if (v == nullptr) goto fail;
    PyList_SET_ITEM(py_out, j, v);
  }
  if (op == nullptr) {
    op = NewOpObject(type, device, capacity);
    if (op == nullptr) goto fail;
    op->borrowed = src;
  }
  handler = PyObject_GetAttr(stack, s_handler);
  fn = handler != nullptr ? PyObject_GetAttr(handler, s_after_execute) : nullptr;
  if (fn == nullptr) goto fail;
  r = CallHook(stack, d.next, fn, reinterpret_cast<PyObject*>(op), py_in, py_out);
  if (r == nullptr) goto fail;
  // Wrap (as RunForward does).
  producer = InternedString(type);
  if (producer == nullptr) goto fail;
  for (; done < n; ++done) {
    if (leaves[done]) {
      outputs[done] = outs[done];  // ownership moves to the caller
      outs[done] = nullptr;
      continue;
    }
    PyObject* value = PyList_GET_ITEM(py_out, done);
    outputs[done] = NewHandlerTensorHandle(stack, value,
                                           TFE_TensorHandleDataType(EagerTensor_Handle(value)),
                                           producer, true);
    if (outputs[done] == nullptr) goto fail;
  }
  *num_outputs = n;
  goto cleanup;
fail:
  StatusFromPyErr(status);
  for (int j = 0; j < done; ++j) TFE_DeleteTensorHandle(outputs[j]);
cleanup:
  for (int j = 0; j < n; ++j) {
    if (outs[j] != nullptr) TFE_DeleteTensorHandle(outs[j]);
  }
  if (op != nullptr) {
    EndBorrow(op, g_ctx);
    Py_DECREF(op);
  }
  for (PyObject* c : copied) Py_XDECREF(c);
  Py_XDECREF(producer);
  Py_XDECREF(r);
  Py_XDECREF(fn);
  Py_XDECREF(handler);
  Py_XDECREF(py_out);
  Py_XDECREF(py_in);
  return true;
}

bool RunOn(PyObject* stack, const TFE_Op* src, const char* type, const char* device,
           int n_in, TFE_TensorHandle** in, int* num_outputs, TFE_TensorHandle** outputs,
           TF_Status* status, int depth) {
  if (stack == g_physical) return RunPhysical(src, type, n_in, in, num_outputs, outputs, status);
  if (depth > kMaxDepth) return false;
  const Decision* d = Decide(stack, type);
  if (d == nullptr) return false;
  switch (d->kind) {
    case kForward: {
      Decision copy = *d;  // the cache may be cleared by nested decisions
      return RunForward(stack, copy, src, type, device, n_in, in, num_outputs, outputs, status,
                        depth);
    }
    case kNative: {
      Decision copy = *d;
      return NativeStackRun(stack, copy.handler, copy.next, src, type, device, n_in, in,
                            num_outputs, outputs, status);
    }
    case kRecord: {
      Decision copy = *d;
      return RunRecord(stack, copy, src, type, device, n_in, in, num_outputs, outputs, status,
                       depth);
    }
    case kHook: {
      if (depth > 0) return false;  // below a forwarding level: its copy-on rules, Python
      Decision copy = *d;
      return RunHook(stack, copy, src, type, device, n_in, in, num_outputs, outputs, status);
    }
    default:
      return false;
  }
}

// Ops the fast path never takes: copy ops and _EagerConst (their own rules in Python),
// and ops running Python in their kernel (tf.py_function), whose body must run with
// state.current set to the next stack.
bool Excluded(const char* type) {
  if (type[0] == '_' && std::strcmp(type, "_EagerConst") == 0) return true;
  if (std::strncmp(type, "Copy", 4) == 0 &&
      (!std::strcmp(type, "CopyOn") || !std::strcmp(type, "CopyOff") ||
       !std::strcmp(type, "CopyOnGrad") || !std::strcmp(type, "CopyOffGrad"))) {
    return true;
  }
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
      !InternOnce(&s_copy_on_value, "_copy_on_value") ||
      !InternOnce(&s_not_a_list, "_raise_not_a_list") ||
      !InternOnce(&s_wrap_eager, "_wrap_eager") ||
      !InternOnce(&s_after_execute, "after_execute") || !InternOnce(&s_sig, "_oh_sig")) {
    return nullptr;
  }
  Py_RETURN_NONE;
}

// stacks_changed(enable): a stack was built; `enable` says whether it may take the fast
// path for some op (turns the path on for the process).
PyObject* PyStacksChanged(PyObject*, PyObject* arg) {
  if (g_decisions != nullptr && !g_decisions->empty()) ClearDecisions();
  if (PyObject_IsTrue(arg) == 1) g_enabled = true;
  PyErr_Clear();
  Py_RETURN_NONE;
}

// fast_stats() -> dict: counters of the fast path (tests and benchmarks).
PyObject* PyFastStats(PyObject*, PyObject*) {
  return Py_BuildValue("{sKsKsKsKsnsnsOsKsKsnsn}", "hits", (unsigned long long)g_hits,
                       "misses", (unsigned long long)g_misses, "fast_ops",
                       (unsigned long long)g_fast_ops, "clears",
                       (unsigned long long)g_clears, "entries",
                       (Py_ssize_t)(g_decisions ? g_decisions->size() : 0), "maxsize",
                       (Py_ssize_t)kMaxDecisions, "enabled",
                       g_enabled ? Py_True : Py_False, "shared_hits",
                       (unsigned long long)g_shared_hits, "python_asks",
                       (unsigned long long)g_python_asks, "shared_entries",
                       (Py_ssize_t)(g_shared ? g_shared->size() : 0), "shared_maxsize",
                       (Py_ssize_t)kMaxShared);
}

}  // namespace

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
  }
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
  // Depth 1: a Python execute hook (kHook) is only run from C on the op's first stack.
  return RunOn(stack, op, type, device, n_in, in, num_outputs, outputs, status, 1);
}

void ExecuteOnPhysical(const TFE_Op* src, const char* type, const char* device, int n_in,
                       TFE_TensorHandle** in, int* num_outputs, TFE_TensorHandle** outputs,
                       TF_Status* status) {
  // Reuse this thread's TFE_Op (as ExecuteOp does); a nested use takes it out first.
  thread_local TFE_Op* cached_op = nullptr;
  TFE_Op* tfe = cached_op;
  cached_op = nullptr;
  if (tfe != nullptr) {
    TFE_OpReset(tfe, type, device, status);
    if (TF_GetCode(status) != TF_OK) {
      TFE_DeleteOp(tfe);
      tfe = nullptr;
      TF_SetStatus(status, TF_OK, "");
    }
  }
  if (tfe == nullptr) {
    tfe = TFE_NewOp(g_ctx, type, status);
    if (TF_GetCode(status) == TF_OK) TFE_OpSetDevice(tfe, device, status);
  }
  if (TF_GetCode(status) == TF_OK) {
    TFE_OpAddAttrs(tfe, TFE_OpGetAttrs(src));
    for (int i = 0; i < n_in && TF_GetCode(status) == TF_OK; ++i) {
      TFE_OpAddInput(tfe, in[i], status);
    }
  }
  if (TF_GetCode(status) == TF_OK) {
    Py_BEGIN_ALLOW_THREADS;
    TFE_Execute(tfe, outputs, num_outputs, status);
    Py_END_ALLOW_THREADS;
  }
  if (tfe != nullptr) {
    if (cached_op == nullptr && TF_GetCode(status) == TF_OK) {
      cached_op = tfe;
    } else {
      TFE_DeleteOp(tfe);
    }
  }
}

PyMethodDef kFastModuleMethods[] = {
    {"fast_setup", PyFastSetup, METH_VARARGS,
     "fast_setup(state, PHYSICAL): what the C++ per-op fast path reads."},
    {"stacks_changed", PyStacksChanged, METH_O,
     "stacks_changed(may_be_fast): a stack was built; clears the fast path's decisions."},
    {"fast_stats", PyFastStats, METH_NOARGS,
     "fast_stats() -> {hits, misses, fast_ops, clears, entries, maxsize, enabled, "
     "shared_hits, python_asks, shared_entries, shared_maxsize}."},
    {nullptr}};

}  // namespace tf_ophandlers
