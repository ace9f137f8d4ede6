// tf-ophandlers: the no-GIL path (NativeNoGilExecute) and this thread's plan for it.
// Contracts: native.h, handler_tensor.h (StackAnchor), include/tf_ophandlers/handler.h.
#define PY_SSIZE_T_CLEAN
#include "native/native_internal.h"

#include <atomic>
#include <cstring>

#include "fast/fast_path.h"
#include "boundary/handler_tensor.h"
#include "boundary/op.h"
#include "boundary/runtime.h"
#include "boundary/status.h"

namespace tf_ophandlers {

using namespace native_internal;  // NOLINT: the native path's internals

namespace {

// An op type of the plan: its interned str (borrowed: InternedStringKept keeps it for the
// process), the payloads' producer; for a forwarding plan, the types it forwards.
struct PlanType {
  char text[40];
  PyObject* producer;
  PyObject* lazy;  // (forwarding) null, or the one forwarding level skipped: stack.next
};

// This thread's plan: the stack it last ran in C directly over PHYSICAL while it was
// state.current (borrowed, by address: a stack's handler and next stack are fixed for its
// life, and a dead stack's address can only name a new stack after stacks_changed, which
// advances StacksGeneration), with a count of an anchor of it (handler tensors are made
// without the GIL through it; the count keeps the stack alive until the plan is dropped).
// Thread-local: read without the GIL; changed only with it, by its own thread.
struct Plan {
  uint64_t generation = 0;
  PyObject* stack = nullptr;
  StackAnchor* anchor = nullptr;
  NativeHandlerObject* handler = nullptr;  // a C/C++ handler's; null: a forwarding level
  bool transient = true;                   // (forwarding) resource outputs leave
  bool default_copy_on = true;             // (forwarding) physical inputs pass as they are
  static constexpr int kTypes = 32;  // a model's small-op loop uses a few dozen types
  PlanType types[kTypes];
  int n_types = 0;
  unsigned next_type = 0;
};
thread_local Plan t_plan;
std::atomic<uint64_t> g_nogil_ops{0};
std::atomic<uint64_t> g_nogil_forward_ops{0};

// Drops the plan and its anchor count. GIL: held.
void Forget(Plan& plan) {
  if (plan.anchor != nullptr) ReleaseStackAnchor(plan.anchor);
  plan = Plan();
}

// Makes `stack` (state.current) the plan, unless it is already. GIL: held.
bool Adopt(Plan& plan, PyObject* stack, NativeHandlerObject* handler, bool transient,
           bool default_copy_on) {
  const uint64_t gen = StacksGeneration();
  if (plan.stack == stack && plan.generation == gen && plan.handler == handler &&
      plan.transient == transient && plan.default_copy_on == default_copy_on) {
    return true;
  }
  // Only the current stack: its scope's close drops the plan (PyNoGilForget).
  if (StateGet(s_current) != stack) return false;
  if (MaySubstitute(stack)) return false;  // its ops check the tapes: with the GIL
  Forget(plan);
  plan.generation = gen;
  plan.stack = stack;
  plan.anchor = NewStackAnchor(stack);
  plan.handler = handler;
  plan.transient = transient;
  plan.default_copy_on = default_copy_on;
  return true;
}

const PlanType* FindType(const Plan& plan, const char* type) {
  for (int i = 0; i < plan.n_types; ++i) {
    const char* t = plan.types[i].text;
    if (t[0] == type[0] && std::strcmp(t, type) == 0) return &plan.types[i];
  }
  return nullptr;
}

// Adds `type` to the plan's types (the oldest gives way); `lazy`: see PlanType. GIL: held.
void AddType(Plan& plan, const char* type, PyObject* lazy = nullptr) {
  if (FindType(plan, type) != nullptr || std::strlen(type) >= sizeof(PlanType::text)) return;
  PyObject* producer = InternedStringKept(type);
  if (producer == nullptr) return;
  int i = plan.n_types < Plan::kTypes ? plan.n_types++ : plan.next_type++ % Plan::kTypes;
  std::strcpy(plan.types[i].text, type);
  plan.types[i].producer = producer;
  plan.types[i].lazy = lazy;
}

// Ops the no-GIL path leaves to the GIL path: copy ops, _EagerConst, and ops running
// Python in their kernel.
bool NoGilExcluded(const char* type) {
  return IsCopyOrConst(type) || std::strstr(type, "PyFunc") != nullptr;
}

// A forwarding level over PHYSICAL (RunForward's work for it) without the GIL: unwrap,
// execute on PHYSICAL at `device`, and wrap the outputs as handler tensors of the plan's
// stack through its anchor. Returns false (nothing done) when an input needs the GIL path.
bool ForwardNoGil(const Plan& plan, const PlanType entry, const TFE_Op* tfe_op,
                  const char* type, const char* device, int n_in, TFE_TensorHandle** in,
                  int* num_outputs, TFE_TensorHandle** outputs, TF_Status* status) {
  // HandlerStack.execute's unwrap: a tensor of the stack gives its physical tensor
  // (shape_source: the handle of the payload's value, or one sharing its tensor); a
  // physical tensor passes as it is (the default copy_on).
  absl::InlinedVector<TFE_TensorHandle*, 4> values(n_in);
  for (int i = 0; i < n_in; ++i) {
    TFOH_Payload* p = PayloadOf(in[i]);
    if (p == nullptr) {
      if (!plan.default_copy_on) return false;
      values[i] = in[i];
      continue;
    }
    // (A payload a C path made, without a value, holds what PHYSICAL returned, also with
    // a skipped level; one with a value from a Python hook is checked: its tensor could
    // be another stack's.)
    if (p->kind != TFOH_PAYLOAD_PYTHON || reinterpret_cast<PyObject*>(p->stack) != plan.stack ||
        p->shape_source == nullptr ||
        (p->value != nullptr && PayloadOf(p->shape_source) != nullptr)) {
      return false;
    }
    values[i] = p->shape_source;
  }
  PyObject* const stack = plan.stack;  // (copied: nothing below may change the plan)
  StackAnchor* const anchor = plan.anchor;
  const bool transient = plan.transient;
  int n = *num_outputs;
  absl::InlinedVector<TFE_TensorHandle*, 4> outs(n > 0 ? n : 1, nullptr);
  ExecuteOnPhysical(tfe_op, type, device, n_in, values.data(), &n, outs.data(), status,
                    /*gil_held=*/false);
  g_nogil_forward_ops.fetch_add(1, std::memory_order_relaxed);
  if (TF_GetCode(status) != TF_OK) return true;
  // The anchor is usable while this thread's plan holds it (a kernel that ran Python
  // could have changed the plan: then the GIL path's wrap).
  const bool gil = t_plan.anchor != anchor;
  PyGILState_STATE g{};
  if (gil) g = PyGILState_Ensure();
  for (int i = 0; i < n; ++i) {
    TFE_TensorHandle* h = outs[i];
    outs[i] = nullptr;
    const TF_DataType dt = TFE_TensorHandleDataType(h);
    // RFC "Placement of resource handles": a transient level leaves them on PHYSICAL
    // (a skipped level is transient).
    if ((transient || entry.lazy != nullptr) && dt == TF_RESOURCE) {
      outputs[i] = h;
    } else if (gil) {
      outputs[i] = NewHandlerTensorHandleFromHandle(stack, h, dt, entry.producer, entry.lazy);
      if (outputs[i] == nullptr) StatusFromPyErr(status);
    } else {
      outputs[i] = NewAnchoredHandle(anchor, h, dt, entry.producer, entry.lazy, status);
    }
    if (outputs[i] == nullptr || TF_GetCode(status) != TF_OK) {
      // (Releasing an anchored handle here needs no GIL: the plan holds a count.)
      for (int j = 0; j <= i; ++j) {
        if (outputs[j] != nullptr) TFE_DeleteTensorHandle(outputs[j]);
      }
      for (int j = i + 1; j < n; ++j) TFE_DeleteTensorHandle(outs[j]);
      if (TF_GetCode(status) == TF_OK) {
        TF_SetStatus(status, TF_INTERNAL, "tf_ophandlers: cannot create handler tensor");
      }
      if (gil) PyGILState_Release(g);
      return true;
    }
  }
  if (gil) PyGILState_Release(g);
  *num_outputs = n;
  return true;
}

// A C/C++ handler's outputs wrapped without the GIL, when each is a plain handle (what
// execute_next returns: no Python object, no handler data, this reference the last) and
// the handler answers shapes from it: WrapNativeOutputs' common case. Returns false
// (nothing done) otherwise. On success `outs` are consumed. GIL: not needed.
bool WrapNoGil(StackAnchor* anchor, NativeHandlerObject* self, PyObject* producer,
               const absl::InlinedVector<TF_DataType, 4>& want,
               absl::InlinedVector<TFOH_Tensor*, 4>& outs, TFE_TensorHandle** outputs,
               TF_Status* status) {
  const auto& hooks = self->type->hooks;
  if (hooks.num_dims != nullptr || hooks.dim != nullptr) return false;
  for (TFOH_Tensor* t : outs) {
    if (t->py != nullptr || t->h == nullptr || t->has_data || t->wrapper != nullptr ||
        t->refs.load(std::memory_order_acquire) != 1) {
      return false;
    }
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    TFOH_Tensor* t = outs[i];
    TFE_TensorHandle* result;
    if (want[i] == TF_RESOURCE) {  // native handlers are transient (handler.h)
      result = TFE_TensorHandleCopySharingTensor(t->h, status);
    } else {
      TFE_TensorHandle* h = t->h;
      t->h = nullptr;  // moved into the payload
      result = NewAnchoredHandle(anchor, h, want[i], producer, nullptr, status);
    }
    if (result == nullptr || TF_GetCode(status) != TF_OK) {
      for (size_t j = 0; j < i; ++j) TFE_DeleteTensorHandle(outputs[j]);
      if (result != nullptr) TFE_DeleteTensorHandle(result);
      if (TF_GetCode(status) == TF_OK) {
        TF_SetStatus(status, TF_INTERNAL, "tf_ophandlers: cannot create handler tensor");
      }
      return true;  // failed, reported (the caller releases `outs`)
    }
    outputs[i] = result;
  }
  return true;
}

}  // namespace

void RememberNoGilStack(PyObject* stack, PyObject* handler) {
  Plan& plan = t_plan;
  auto* self = reinterpret_cast<NativeHandlerObject*>(handler);
  if (self != nullptr) Adopt(plan, stack, self, true, true);
}

void RememberNoGilForward(PyObject* stack, const char* type, bool transient,
                          bool default_copy_on, PyObject* skipped) {
  Plan& plan = t_plan;
  if (Adopt(plan, stack, nullptr, transient, default_copy_on)) AddType(plan, type, skipped);
}

PyObject* PyNoGilForget(PyObject*, PyObject*) {
  Forget(t_plan);
  Py_RETURN_NONE;
}

uint64_t NativeNoGilOps() { return g_nogil_ops.load(std::memory_order_relaxed); }
uint64_t NativeNoGilForwardOps() { return g_nogil_forward_ops.load(std::memory_order_relaxed); }

bool NativeNoGilMayRun() {
  const Plan& plan = t_plan;
  return plan.stack != nullptr && plan.generation == StacksGeneration();
}

bool NativeNoGilExecute(const TFE_Op* tfe_op, int* num_outputs, TFE_TensorHandle** outputs,
                        TF_Status* status) {
  Plan& plan = t_plan;
  if (plan.stack == nullptr || plan.generation != StacksGeneration()) return false;
  if (g_state == nullptr || PyGILState_Check() || PendingQueued()) return false;
  NativeHandlerObject* self = plan.handler;
  // A type that chooses its ops (executes_op, asked with the GIL) takes the GIL path.
  if (self != nullptr &&
      (self->state == nullptr || self->type->hooks.executes_op != nullptr)) {
    return false;
  }
  TF_Status* s = ThreadStatus();
  // The cheapest test first: an op a scope placed runs on state.current, which must be
  // the plan's stack (another stack's ops decline here, in a few dozen instructions).
  const char* device = TFE_OpGetDevice(tfe_op, s);
  const bool by_scope = device != nullptr && g_device_name == device;
  if (by_scope && StateGetNoGil(s_current) != plan.stack) return false;
  const char* type = TFE_OpGetName(tfe_op, s);
  int n_in = TFE_OpGetFlatInputCount(tfe_op, s);
  if (TF_GetCode(s) != TF_OK || type == nullptr || NoGilExcluded(type)) {
    TF_SetStatus(s, TF_OK, "");
    return false;
  }
  const PlanType* entry = FindType(plan, type);
  if (self == nullptr && entry == nullptr) return false;  // not known to forward
  // No function being replayed, and the op's stack is the plan's: the current stack for
  // an op a scope placed, else the one stack of its handler inputs (as TryFastExecute
  // decides).
  if (StateGetNoGil(s_mode) != Py_None) return false;
  absl::InlinedVector<TFE_TensorHandle*, 4> in(n_in);
  for (int i = 0; i < n_in; ++i) {
    in[i] = TFE_OpGetFlatInput(tfe_op, i, s);
    if (TF_GetCode(s) != TF_OK) {
      TF_SetStatus(s, TF_OK, "");
      return false;
    }
  }
  if (!by_scope) {
    bool any = false;
    for (int i = 0; i < n_in; ++i) {
      TFOH_Payload* p = PayloadOf(in[i]);
      if (p == nullptr) continue;
      if (reinterpret_cast<PyObject*>(p->stack) != plan.stack) return false;
      any = true;
    }
    if (!any) return false;
  }
  // state.device, an ASCII str read in place (no Python object is made).
  PyObject* dev = StateGetNoGil(s_device);
  if (dev == nullptr || !PyUnicode_CheckExact(dev) || !PyUnicode_IS_COMPACT_ASCII(dev)) {
    return false;
  }
  const char* dev_utf8 = reinterpret_cast<const char*>(PyUnicode_DATA(dev));
  if (self == nullptr) {
    return ForwardNoGil(plan, *entry, tfe_op, type, dev_utf8, n_in, in.data(), num_outputs,
                        outputs, status);
  }
  absl::InlinedVector<TF_DataType, 4> want;
  if (!ExpectedOutputs(tfe_op, &want) || static_cast<int>(want.size()) > *num_outputs) {
    return false;
  }
  // Inputs: a handler tensor of the stack gives its TensorFlow handle (a payload's
  // shape_source, or its EagerTensor's handle: both fixed while the payload lives, which
  // the input keeps alive); a physical tensor is taken as it is (no copy_on hook). Only
  // payloads without a Python value qualify, so that every TFOH_Tensor here holds a handle
  // and no Python object (Unref needs no GIL).
  absl::InlinedVector<TFOH_Tensor*, 4> ins, outs;
  auto release = [&]() {
    for (auto* t : ins) Unref(t);
    for (auto* t : outs) Unref(t);
    ins.clear();
    outs.clear();
  };
  for (int i = 0; i < n_in; ++i) {
    TFOH_Payload* p = PayloadOf(in[i]);
    TFE_TensorHandle* h = in[i];
    if (p != nullptr) {
      bool raw = p->kind == TFOH_PAYLOAD_PYTHON && p->value == nullptr &&
                 reinterpret_cast<PyObject*>(p->stack) == plan.stack;
      if (!raw) h = nullptr;
      else h = p->shape_source;
    } else if (self->type->hooks.copy_on != nullptr) {
      h = nullptr;
    }
    TFE_TensorHandle* copy = h != nullptr ? TFE_TensorHandleCopySharingTensor(h, s) : nullptr;
    if (copy == nullptr || TF_GetCode(s) != TF_OK) {
      TF_SetStatus(s, TF_OK, "");
      release();
      return false;
    }
    ins.push_back(TensorFromHandle(copy));
  }
  // From here on the op is ours: failures are reported through `status`.
  PyObject* const stack = plan.stack;  // (copied: execute_next may run Python)
  StackAnchor* const anchor = plan.anchor;
  const PlanType known = entry != nullptr ? *entry : PlanType{"", nullptr, nullptr};
  TFOH_Context ctx{stack, g_physical, true, dev};
  ctx.gil = false;
  ctx.device_utf8 = dev_utf8;
  TFOH_Op op{tfe_op, nullptr, type, device, static_cast<int>(want.size())};
  bool ok = RunExecute(self, &ctx, &op, ins, outs, &want, status);
  for (auto* t : ins) Unref(t);
  ins.clear();
  g_nogil_ops.fetch_add(1, std::memory_order_relaxed);
  if (!ok) return true;  // RunExecute released the outputs and set `status`
  if (known.producer != nullptr && t_plan.anchor == anchor &&
      WrapNoGil(anchor, self, known.producer, want, outs, outputs, status)) {
    if (TF_GetCode(status) == TF_OK) *num_outputs = static_cast<int>(outs.size());
    release();
    return true;
  }
  // The GIL for the wrap: handler tensors holding Python objects (stack, producer).
  PyGILState_STATE g = PyGILState_Ensure();
  DrainPending();
  if (WrapNativeOutputs(stack, self, g_physical, type, want, outs, outputs, status)) {
    *num_outputs = static_cast<int>(outs.size());
  }
  release();
  if (t_plan.anchor == anchor) AddType(t_plan, type);  // the next op of this type: no GIL
  PyGILState_Release(g);
  return true;
}

}  // namespace tf_ophandlers
