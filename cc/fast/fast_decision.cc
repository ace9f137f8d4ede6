// tf-ophandlers: the fast path's decision per (stack, op type): a per-stack cache and
// one shared per declaration signature. Contracts: fast_internal.h.
#define PY_SSIZE_T_CLEAN
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

namespace tf_ophandlers {
namespace fast {

bool g_enabled = false;  // set once a stack that may take the fast path exists
uint64_t g_hits = 0, g_misses = 0, g_fast_ops = 0, g_clears = 0;

namespace {

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
  bool hook_objects = false;
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

// This thread's last few hits of Decide, compared by stack and type text: no std::string
// and no hash for a (stack, type) seen just before. An entry is valid while its
// generation is g_generation, which every clear of g_decisions advances (elements of an
// unordered_map never move otherwise).
std::atomic<uint64_t> g_generation{1};
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

}  // namespace

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
    auto* self = reinterpret_cast<native_internal::NativeHandlerObject*>(handler);
    std::string threw;
    bool executes = self->state == nullptr || native_internal::ExecutesOp(self, type, &threw);
    // An executes_op hook that threw: no decision (the Python path asks it again and
    // raises the HandlerError there).
    if (!threw.empty()) return nullptr;
    if (!executes) {
      // ABI version 4: an op the handler does not execute is forwarded as a Python
      // handler's default execute is (RunForward: no hook call, no TFOH_* object). Its
      // outputs answer shape queries from their handle, so a type with num_dims/dim
      // hooks takes the Python path, which wraps them for those hooks.
      const TFOH_HandlerType& k = self->type->hooks;
      d.kind = (k.num_dims != nullptr || k.dim != nullptr) ? kPython : kForward;
      d.handler = nullptr;
      d.transient = true;  // native handlers are transient (handler.h)
      d.default_copy_on = k.copy_on == nullptr;
      d.copy_all = !(d.default_copy_on && next != g_physical);  // HandlerStack._defer_copy
    }
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
      d.hook_objects = sh.hook_objects;
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
      int kind = 0, transient = 1, default_copy_on = 0, copy_all = 1, hook_objects = 0;
      PyObject* next = nullptr;
      if (!PyArg_ParseTuple(r, "iOppp|p", &kind, &next, &transient, &default_copy_on,
                            &copy_all, &hook_objects)) {
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
      d.hook_objects = hook_objects != 0;
      Py_DECREF(r);
      if (sig != nullptr) {
        if (g_shared->size() >= kMaxShared) ClearShared();
        Shared sh;
        sh.kind = d.kind;
        sh.transient = d.transient;
        sh.default_copy_on = d.default_copy_on;
        sh.copy_all = d.copy_all;
        sh.hook_objects = d.hook_objects;
        // The reference taken by GetAttr moves into the entry.
        if (!g_shared->emplace(Key{sig, type}, sh).second) Py_DECREF(sig);
        sig = nullptr;
      }
    }
  }
  if (g_decisions->size() >= kMaxDecisions) ClearDecisions();
  return &g_decisions->emplace(std::move(key), d).first->second;
}

// stacks_changed(enable): a stack was built; `enable` says whether it may take the fast
// path for some op (turns the path on for the process).
PyObject* PyStacksChanged(PyObject*, PyObject* arg) {
  if (g_decisions != nullptr && !g_decisions->empty()) {
    ClearDecisions();
  } else {
    ++g_generation;  // StacksGeneration: every new stack, even with no decision cached
  }
  if (PyObject_IsTrue(arg) == 1) g_enabled = true;
  PyErr_Clear();
  Py_RETURN_NONE;
}

// fast_stats() -> dict: counters of the fast path (tests and benchmarks).
PyObject* PyFastStats(PyObject*, PyObject*) {
  return Py_BuildValue("{sKsKsKsKsnsnsOsKsKsnsnsKsK}", "hits", (unsigned long long)g_hits,
                       "misses", (unsigned long long)g_misses, "fast_ops",
                       (unsigned long long)(g_fast_ops + NativeNoGilOps() + NativeNoGilForwardOps()), "clears",
                       (unsigned long long)g_clears, "entries",
                       (Py_ssize_t)(g_decisions ? g_decisions->size() : 0), "maxsize",
                       (Py_ssize_t)kMaxDecisions, "enabled",
                       g_enabled ? Py_True : Py_False, "shared_hits",
                       (unsigned long long)g_shared_hits, "python_asks",
                       (unsigned long long)g_python_asks, "shared_entries",
                       (Py_ssize_t)(g_shared ? g_shared->size() : 0), "shared_maxsize",
                       (Py_ssize_t)kMaxShared, "nogil_ops",
                       (unsigned long long)NativeNoGilOps(), "nogil_forward_ops",
                       (unsigned long long)NativeNoGilForwardOps());
}

}  // namespace fast

uint64_t StacksGeneration() { return fast::g_generation.load(std::memory_order_acquire); }

}  // namespace tf_ophandlers
