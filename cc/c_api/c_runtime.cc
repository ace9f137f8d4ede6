// tf-ophandlers: the Python-free handler runtime: ops through handler stacks, the
// dispatcher device's callbacks and the TFOH_RuntimeApi. Contracts: c_runtime.h.
#include "c_api/c_runtime.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_map>

#include "absl/container/inlined_vector.h"
#include "kernels/op_outputs.h"

namespace tf_ophandlers {
namespace c_runtime {
namespace {

using Tensors = absl::InlinedVector<TFOH_Tensor*, 4>;

std::string OnOp(const TFOH_Op* op) { return std::string(" (op ") + op->type + ")"; }

// Prefixes a failed `status` with the handler and the op, like the Python runtime's
// errors ("handler OpCounter(3 ops): op MatMul: ...").
void Prefix(const Handler* h, const char* what, const TFOH_Op* op, TF_Status* status) {
  std::string m = "tf_ophandlers: handler " + DebugString(h) + ": " + what +
                  (op ? OnOp(op) : std::string()) + ": " + TF_Message(status);
  TF_SetStatus(status, TF_GetCode(status), m.c_str());
}

TFOH_Tensor* NewTensor(TFE_TensorHandle* owned) {
  auto* t = new TFOH_Tensor();
  t->h = owned;
  return t;
}

// A new tensor sharing `h` (borrowed), or null with `status` set.
TFOH_Tensor* SharingTensor(TFE_TensorHandle* h, TF_Status* status) {
  TFE_TensorHandle* c = TFE_TensorHandleCopySharingTensor(h, status);
  return TF_GetCode(status) == TF_OK ? NewTensor(c) : nullptr;
}

void ReleaseAll(Tensors& ts) {
  for (TFOH_Tensor* t : ts) Unref(t);
  ts.clear();
}

// ---- dispatcher-device tensors --------------------------------------------------------------

int PayloadNumDims(void* data, TF_Status* status) {
  auto* p = static_cast<Payload*>(data);
  const Handler* h = p->stack->handler;
  if (h->type->hooks.num_dims != nullptr) {
    int r = -1;
    GuardHook(h, "num_dims", status, [&] { r = h->type->hooks.num_dims(h->state, p->rep, status); });
    if (TF_GetCode(status) != TF_OK) Prefix(h, "num_dims", nullptr, status);
    return r;
  }
  return TFE_TensorHandleNumDims(p->rep->h, status);
}

int64_t PayloadDim(void* data, int index, TF_Status* status) {
  auto* p = static_cast<Payload*>(data);
  const Handler* h = p->stack->handler;
  if (h->type->hooks.dim != nullptr) {
    int64_t r = -1;
    GuardHook(h, "dim", status, [&] { r = h->type->hooks.dim(h->state, p->rep, index, status); });
    if (TF_GetCode(status) != TF_OK) Prefix(h, "dim", nullptr, status);
    return r;
  }
  return TFE_TensorHandleDim(p->rep->h, index, status);
}

void PayloadDelete(void* data) {
  auto* p = static_cast<Payload*>(data);
  Unref(p->rep);
  StackUnref(p->stack);
  delete p;
}

TF_Buffer* PayloadSummarize(void* data, TF_Status* status) {
  auto* p = static_cast<Payload*>(data);
  const Handler* h = p->stack->handler;
  TF_Buffer* out = TF_NewBuffer();
  if (h->type->hooks.tensor_debug_string != nullptr) {
    GuardHook(h, "tensor_debug_string", status,
              [&] { h->type->hooks.tensor_debug_string(h->state, p->rep, out, status); });
  } else {
    std::string text = "handler tensor of " + DebugString(h);
    void* bytes = std::malloc(text.size() + 1);
    std::memcpy(bytes, text.c_str(), text.size() + 1);
    out->data = bytes;
    out->length = text.size();
    out->data_deallocator = [](void* b, size_t) { std::free(b); };
  }
  if (TF_GetCode(status) != TF_OK) {
    Prefix(h, "tensor_debug_string", nullptr, status);
    TF_DeleteBuffer(out);
    return nullptr;
  }
  return out;
}

// A new tensor of `s` for the representation `rep` (a tensor of s->next; the new tensor
// takes a reference), or null with `status` set.
TFOH_Tensor* Wrap(DispatcherState* d, Stack* s, TFOH_Tensor* rep, TF_Status* status) {
  auto* p = new Payload{s, rep};
  StackRef(s);
  rep->refs.fetch_add(1, std::memory_order_relaxed);
  TFE_CustomDeviceTensorHandle methods;
  methods.num_dims = PayloadNumDims;
  methods.dim = PayloadDim;
  methods.deallocator = PayloadDelete;
  methods.summarize = PayloadSummarize;
  // Takes `p` in every case (the deallocator runs on failure too).
  TFE_TensorHandle* h = TFE_NewCustomDeviceTensorHandle(
      d->ctx, d->name.c_str(), TFE_TensorHandleDataType(rep->h), p, methods, status);
  if (TF_GetCode(status) != TF_OK) return nullptr;
  return NewTensor(h);
}

// Whether `a` and `b` are the same stack: the same handlers in the same order. Each push
// makes a new Stack, so a tensor made under an earlier scope of a handler (or under its
// scope on another thread) has a different Stack object that still means the same stack.
// Stacks never change once made, so no lock is needed.
bool SameStack(const Stack* a, const Stack* b) {
  for (; a != nullptr && b != nullptr; a = a->next, b = b->next) {
    if (a == b) return true;
    if (a->handler != b->handler) return false;
  }
  return a == b;
}

// Whether `below` is `s` or one of the stacks under it.
bool IsBelowOrSame(const Stack* below, const Stack* s) {
  for (; s != nullptr; s = s->next) {
    if (SameStack(s, below)) return true;
  }
  return below == nullptr;
}

// `t`, a tensor of `from` (a stack at or under `s`), as a tensor of `s`: every level in
// between takes it through its copy_on hook. A new reference, or null with `status` set.
TFOH_Tensor* Lift(DispatcherState* d, Stack* s, Stack* from, TFOH_Tensor* t, TF_Status* status) {
  if (SameStack(s, from)) {
    t->refs.fetch_add(1, std::memory_order_relaxed);
    return t;
  }
  TFOH_Tensor* inner = Lift(d, s->next, from, t, status);
  if (inner == nullptr) return nullptr;
  const Handler* h = s->handler;
  TFOH_Tensor* rep = inner;
  if (h->type->hooks.copy_on != nullptr) {
    TFOH_Context ctx{s, d};
    rep = nullptr;
    GuardHook(h, "copy_on", status, [&] { rep = h->type->hooks.copy_on(h->state, &ctx, inner, status); });
    Unref(inner);
    if (TF_GetCode(status) != TF_OK || rep == nullptr) {
      if (TF_GetCode(status) == TF_OK) {
        TF_SetStatus(status, TF_INTERNAL, "copy_on returned no tensor");
      }
      if (rep != nullptr) Unref(rep);
      Prefix(h, "copy_on", nullptr, status);
      return nullptr;
    }
  }
  TFOH_Tensor* r = Wrap(d, s, rep, status);
  Unref(rep);
  return r;
}

std::string StackString(const Stack* s) {
  if (s == nullptr) return "[physical]";
  std::string r = "[";
  for (; s != nullptr; s = s->next) r += DebugString(s->handler) + (s->next ? " > " : "]");
  return r;
}

void ExecuteOn(DispatcherState* d, Stack* s, const TFOH_Op* op, int n_in,
               TFOH_Tensor* const* in, int* num_outputs, TFOH_Tensor** outputs,
               TF_Status* status);

// Runs `op` on the physical device with physical inputs.
void ExecutePhysical(DispatcherState* d, const TFOH_Op* op, int n_in, TFOH_Tensor* const* in,
                     int* num_outputs, TFOH_Tensor** outputs, TF_Status* status) {
  // The op's own device if it asked for a physical one; never "": inside the device's
  // callback that would be the dispatcher again.
  const char* device = op->device;
  if (device == nullptr || device[0] == '\0' || d->name == device) device = d->physical.c_str();
  TFE_Op* p = TFE_NewOp(d->ctx, op->type, status);
  if (TF_GetCode(status) != TF_OK) return;
  TFE_OpAddAttrs(p, TFE_OpGetAttrs(op->tfe));
  TFE_OpSetDevice(p, device, status);
  for (int i = 0; i < n_in && TF_GetCode(status) == TF_OK; ++i) {
    if (in[i] == nullptr || in[i]->h == nullptr) {
      TF_SetStatus(status, TF_INVALID_ARGUMENT,
                   ("tf_ophandlers: input " + std::to_string(i) + OnOp(op) + " is null").c_str());
    } else if (PayloadOf(d, in[i]->h) != nullptr) {
      TF_SetStatus(status, TF_INVALID_ARGUMENT,
                   ("tf_ophandlers: input " + std::to_string(i) + OnOp(op) +
                    " reaching the physical device is a handler tensor, not a tensor of the "
                    "next stack")
                       .c_str());
    } else {
      TFE_OpAddInput(p, in[i]->h, status);
    }
  }
  if (TF_GetCode(status) == TF_OK) {
    absl::InlinedVector<TFE_TensorHandle*, 4> rets(*num_outputs > 0 ? *num_outputs : 1);
    int n = *num_outputs;
    TFE_Execute(p, rets.data(), &n, status);
    if (TF_GetCode(status) == TF_OK) {
      for (int i = 0; i < n; ++i) outputs[i] = NewTensor(rets[i]);
      *num_outputs = n;
    }
  }
  TFE_DeleteOp(p);
}

// Runs `op` with `in` (tensors of `s`) on handler stack `s`: the handler's execute hook,
// or forwarded to the next stack when the handler does not execute ops of this type.
void ExecuteOnHandler(DispatcherState* d, Stack* s, const TFOH_Op* op, int n_in,
                      TFOH_Tensor* const* in, int* num_outputs, TFOH_Tensor** outputs,
                      TF_Status* status) {
  const Handler* h = s->handler;
  const TFOH_HandlerType& hooks = h->type->hooks;
  Tensors reps;
  for (int i = 0; i < n_in; ++i) {
    Payload* p = in[i] != nullptr && in[i]->h != nullptr ? PayloadOf(d, in[i]->h) : nullptr;
    TFOH_Tensor* rep = nullptr;
    if (p != nullptr && SameStack(p->stack, s)) {
      rep = p->rep;
      rep->refs.fetch_add(1, std::memory_order_relaxed);
    } else if (p == nullptr || IsBelowOrSame(p->stack, s)) {
      // A physical tensor, or one of a stack below: copy it on.
      Stack* from = p == nullptr ? nullptr : p->stack;
      TFOH_Tensor* lifted = in[i] == nullptr ? nullptr : Lift(d, s, from, in[i], status);
      if (lifted != nullptr) {
        rep = PayloadOf(d, lifted->h)->rep;
        rep->refs.fetch_add(1, std::memory_order_relaxed);
        Unref(lifted);
      } else if (TF_GetCode(status) == TF_OK) {
        TF_SetStatus(status, TF_INVALID_ARGUMENT, ("tf_ophandlers: null input" + OnOp(op)).c_str());
      }
    } else {
      TF_SetStatus(status, TF_INVALID_ARGUMENT,
                   ("tf_ophandlers: input " + std::to_string(i) + OnOp(op) +
                    " is a tensor of handler stack " + StackString(p->stack) +
                    ", which is not below the op's stack " + StackString(s) +
                    "; copy it to a physical device first")
                       .c_str());
    }
    if (TF_GetCode(status) != TF_OK) {
      ReleaseAll(reps);
      return;
    }
    reps.push_back(rep);
  }
  bool executes = hooks.execute != nullptr;
  if (executes && hooks.executes_op != nullptr) {
    TF_Status* ignored = TF_NewStatus();
    GuardHook(h, "executes_op", ignored, [&] { executes = hooks.executes_op(h->state, op->type) != 0; });
    TF_DeleteStatus(ignored);
  }
  const int capacity = *num_outputs;
  Tensors outs(capacity > 0 ? capacity : 1, nullptr);
  int n = capacity;
  if (executes) {
    TFOH_Context ctx{s, d};
    GuardHook(h, "execute", status, [&] {
      hooks.execute(h->state, &ctx, op, n_in, reps.data(), &n, outs.data(), status);
    });
    if (TF_GetCode(status) == TF_OK) {
      // TensorFlow does not check what a custom device returns (too few outputs or a wrong
      // dtype corrupt memory): the OpDef's dtypes where they are known, else the count.
      absl::InlinedVector<TF_DataType, 4> want;
      const bool known = ExpectedOutputs(op->tfe, &want);
      const int count = known ? static_cast<int>(want.size())
                              : op->num_outputs >= 0 ? op->num_outputs : n;
      std::string wrong;
      if (n != count || n > capacity || n < 0) {
        wrong = "returned " + std::to_string(n) + " outputs; the op has " + std::to_string(count);
      }
      for (int i = 0; wrong.empty() && i < n; ++i) {
        if (outs[i] == nullptr || outs[i]->h == nullptr) {
          wrong = "returned no tensor for output " + std::to_string(i);
        } else if (known && TFE_TensorHandleDataType(outs[i]->h) != want[i]) {
          wrong = "returned output " + std::to_string(i) + " of dtype enum " +
                  std::to_string(TFE_TensorHandleDataType(outs[i]->h)) + "; the op's is " +
                  std::to_string(want[i]);
        }
      }
      if (!wrong.empty()) {
        TF_SetStatus(status, TF_INVALID_ARGUMENT, ("the execute hook " + wrong).c_str());
        for (int i = 0; i < n && i < capacity; ++i) {
          if (outs[i] != nullptr) Unref(outs[i]);
        }
        n = 0;
      }
    }
    if (TF_GetCode(status) != TF_OK) {
      Prefix(h, "execute", op, status);
      ReleaseAll(reps);
      return;
    }
  } else {
    ExecuteOn(d, s->next, op, n_in, reps.data(), &n, outs.data(), status);
  }
  ReleaseAll(reps);
  if (TF_GetCode(status) != TF_OK) return;
  for (int i = 0; i < n; ++i) {
    TFOH_Tensor* o = outs[i];
    // Resources stay on the stack below (as the Python runtime leaves them), and so does
    // a tensor that is not of the next stack (it left the stacks below already).
    bool leaves = TFE_TensorHandleDataType(o->h) == TF_RESOURCE ||
                  (s->next != nullptr && PayloadOf(d, o->h) == nullptr);
    if (!leaves && s->next != nullptr) leaves = !SameStack(PayloadOf(d, o->h)->stack, s->next);
    TFOH_Tensor* w = leaves ? o : Wrap(d, s, o, status);
    if (leaves) {
      o->refs.fetch_add(1, std::memory_order_relaxed);
    }
    if (w == nullptr) {
      for (int j = 0; j < i; ++j) Unref(outputs[j]);
      for (int j = i; j < n; ++j) Unref(outs[j]);
      return;
    }
    outputs[i] = w;
    Unref(o);
  }
  *num_outputs = n;
}

void ExecuteOn(DispatcherState* d, Stack* s, const TFOH_Op* op, int n_in,
               TFOH_Tensor* const* in, int* num_outputs, TFOH_Tensor** outputs,
               TF_Status* status) {
  if (s == nullptr) {
    ExecutePhysical(d, op, n_in, in, num_outputs, outputs, status);
  } else {
    ExecuteOnHandler(d, s, op, n_in, in, num_outputs, outputs, status);
  }
}

// ---- the device callbacks ----------------------------------------------------------------

DispatcherState* StateOf(void* info) {
  return static_cast<std::shared_ptr<DispatcherState>*>(info)->get();
}

// The calling thread's innermost scope of `d` (borrowed), or null.
Stack* CurrentStack(DispatcherState* d) {
  std::vector<Stack*>& scopes = ThreadScopes(d->id);
  return scopes.empty() ? nullptr : scopes.back();
}

void DeviceExecute(const TFE_Op* tfe_op, int* num_outputs, TFE_TensorHandle** outputs,
                   TF_Status* status, void* info) {
  DispatcherState* d = StateOf(info);
  const int n_in = TFE_OpGetFlatInputCount(tfe_op, status);
  if (TF_GetCode(status) != TF_OK) return;
  TFOH_Op op{tfe_op, TFE_OpGetName(tfe_op, status), TFE_OpGetDevice(tfe_op, status),
             *num_outputs};
  if (TF_GetCode(status) != TF_OK) return;
  Tensors ins;
  Stack* target = CurrentStack(d);
  for (int i = 0; i < n_in; ++i) {
    TFE_TensorHandle* h = TFE_OpGetFlatInput(tfe_op, i, status);
    TFOH_Tensor* t = TF_GetCode(status) == TF_OK ? SharingTensor(h, status) : nullptr;
    if (t == nullptr) {
      ReleaseAll(ins);
      return;
    }
    ins.push_back(t);
    // No scope open: type-based dispatch, to the first handler input's stack.
    Payload* p = target == nullptr ? PayloadOf(d, h) : nullptr;
    if (p != nullptr) target = p->stack;
  }
  StackRef(target);  // a scope popped by a hook must not free the stack under us
  absl::InlinedVector<TFOH_Tensor*, 4> outs(*num_outputs > 0 ? *num_outputs : 1, nullptr);
  int n = *num_outputs;
  ExecuteOn(d, target, &op, n_in, ins.data(), &n, outs.data(), status);
  ReleaseAll(ins);
  if (TF_GetCode(status) == TF_OK && n != *num_outputs) {
    for (int i = 0; i < n; ++i) Unref(outs[i]);
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 ("tf_ophandlers: op " + std::string(op.type) + " produced " +
                  std::to_string(n) + " outputs under " + StackString(target) +
                  ", TensorFlow expects " + std::to_string(*num_outputs))
                     .c_str());
  }
  StackUnref(target);
  if (TF_GetCode(status) != TF_OK) return;
  for (int i = 0; i < n; ++i) {
    // The handle moves to TensorFlow when this was its last reference.
    if (outs[i]->refs.load() == 1 && outs[i]->data == nullptr) {
      outputs[i] = outs[i]->h;
      outs[i]->h = nullptr;
    } else {
      outputs[i] = TFE_TensorHandleCopySharingTensor(outs[i]->h, status);
    }
    Unref(outs[i]);
  }
}

// Copy-on by TFE_TensorHandleCopyToDevice: a physical tensor onto the thread's innermost
// scope.
TFE_TensorHandle* DeviceCopyTo(TFE_Context*, TFE_TensorHandle* tensor, TF_Status* status,
                               void* info) {
  DispatcherState* d = StateOf(info);
  Stack* s = CurrentStack(d);
  if (s == nullptr) {
    TF_SetStatus(status, TF_FAILED_PRECONDITION,
                 "tf_ophandlers: copying a tensor to the dispatcher device needs a handler "
                 "scope open on this thread (TFOH_C_PushHandler)");
    return nullptr;
  }
  TFOH_Tensor* t = SharingTensor(tensor, status);
  if (t == nullptr) return nullptr;
  Payload* p = PayloadOf(d, tensor);
  TFOH_Tensor* r = nullptr;
  if (p != nullptr && !IsBelowOrSame(p->stack, s)) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 ("tf_ophandlers: a tensor of handler stack " + StackString(p->stack) +
                  " cannot be copied onto " + StackString(s) + "; copy it off first")
                     .c_str());
  } else {
    r = Lift(d, s, p ? p->stack : nullptr, t, status);
  }
  Unref(t);
  if (r == nullptr) return nullptr;
  TFE_TensorHandle* h = r->h;
  r->h = nullptr;
  Unref(r);
  return h;
}

// Copy-off: every level's copy_off hook, then the physical copy to `target`.
TFE_TensorHandle* DeviceCopyFrom(TFE_Context* context, TFE_TensorHandle* tensor,
                                 const char* target, TF_Status* status, void* info) {
  DispatcherState* d = StateOf(info);
  TFOH_Tensor* cur = SharingTensor(tensor, status);
  if (cur == nullptr) return nullptr;
  Payload* p;
  while ((p = PayloadOf(d, cur->h)) != nullptr) {
    Stack* s = p->stack;
    const Handler* h = s->handler;
    TFOH_Tensor* v = p->rep;
    if (h->type->hooks.copy_off != nullptr) {
      TFOH_Context ctx{s, d};
      TFOH_Tensor* off = nullptr;
      GuardHook(h, "copy_off", status,
                [&] { off = h->type->hooks.copy_off(h->state, &ctx, p->rep, target, status); });
      if (TF_GetCode(status) == TF_OK && off == nullptr) {
        TF_SetStatus(status, TF_INTERNAL, "copy_off returned no tensor");
      }
      if (TF_GetCode(status) != TF_OK) {
        if (off != nullptr) Unref(off);
        Prefix(h, "copy_off", nullptr, status);
        Unref(cur);
        return nullptr;
      }
      v = off;
    } else {
      v->refs.fetch_add(1, std::memory_order_relaxed);
    }
    Unref(cur);
    cur = v;
  }
  TFE_TensorHandle* r = TFE_TensorHandleCopyToDevice(cur->h, context, target, status);
  Unref(cur);
  return TF_GetCode(status) == TF_OK ? r : nullptr;
}

void DeviceDelete(void* info) {
  auto* holder = static_cast<std::shared_ptr<DispatcherState>*>(info);
  (*holder)->alive.store(false);
  (*holder)->ctx = nullptr;
  delete holder;
}

// ---- the runtime API -------------------------------------------------------------------

const char* ApiOpType(const TFOH_Op* op) { return op->type; }
const char* ApiOpDevice(const TFOH_Op* op) { return op->device ? op->device : ""; }
int ApiOpNumOutputs(const TFOH_Op* op) { return op->num_outputs; }
const TFE_OpAttrs* ApiOpAttrs(const TFOH_Op* op) { return TFE_OpGetAttrs(op->tfe); }
TF_DataType ApiTensorDtype(const TFOH_Tensor* t) { return TFE_TensorHandleDataType(t->h); }
int ApiTensorNumDims(const TFOH_Tensor* t, TF_Status* status) {
  return TFE_TensorHandleNumDims(t->h, status);
}
int64_t ApiTensorDim(const TFOH_Tensor* t, int index, TF_Status* status) {
  return TFE_TensorHandleDim(t->h, index, status);
}
TFE_TensorHandle* ApiTensorHandle(const TFOH_Tensor* t) { return t->h; }
void ApiTensorRef(TFOH_Tensor* t) { t->refs.fetch_add(1, std::memory_order_relaxed); }
void ApiTensorUnref(TFOH_Tensor* t) { Unref(t); }

void ApiExecuteNext(TFOH_Context* ctx, const TFOH_Op* op, int n_in, TFOH_Tensor* const* in,
                    int* num_outputs, TFOH_Tensor** outputs, TF_Status* status) {
  if (std::this_thread::get_id() != ctx->thread) {
    TF_SetStatus(status, TF_FAILED_PRECONDITION,
                 (std::string("tf_ophandlers: execute_next of op ") + op->type +
                  " was called on another thread than the hook's (tf_ophandlers/handler.h)")
                     .c_str());
    return;
  }
  if (op->built == nullptr) {
    ExecuteOn(ctx->dispatcher, ctx->stack->next, op, n_in, in, num_outputs, outputs, status);
    return;
  }
  // An op the handler built: its outputs follow from the attributes it set (handler.h).
  absl::InlinedVector<TF_DataType, 4> want;
  if (!ExpectedOutputs(op->built, &want)) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 (std::string("tf_ophandlers: execute_next: the outputs of op ") + op->type +
                  " (built with op_new) are not known from its attributes: set every "
                  "attribute its OpDef has without a default, type attributes too")
                     .c_str());
    return;
  }
  if (static_cast<int>(want.size()) > *num_outputs) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 (std::string("tf_ophandlers: execute_next: op ") + op->type + " has " +
                  std::to_string(want.size()) + " outputs, more than the " +
                  std::to_string(*num_outputs) + " the caller has room for")
                     .c_str());
    return;
  }
  TFOH_Op resolved{op->tfe, op->type, op->device, static_cast<int>(want.size())};
  *num_outputs = resolved.num_outputs;
  ExecuteOn(ctx->dispatcher, ctx->stack->next, &resolved, n_in, in, num_outputs, outputs, status);
}

bool KnownAbiVersion(int v) { return v >= 1 && v <= TFOH_ABI_VERSION; }

size_t HandlerTypeBytes(const TFOH_HandlerType* type) {
  size_t version_size = type->abi_version == 1   ? TFOH_HANDLER_TYPE_V1_SIZE
                        : type->abi_version == 2 ? TFOH_HANDLER_TYPE_V2_SIZE
                        : type->abi_version == 3 ? TFOH_HANDLER_TYPE_V3_SIZE
                                                 : sizeof(TFOH_HandlerType);
  return type->struct_size < version_size ? type->struct_size : version_size;
}

void ApiRegisterType(TFOH_Library* library, const TFOH_HandlerType* type, TF_Status* status) {
  if (type == nullptr || !KnownAbiVersion(type->abi_version)) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 ("tf_ophandlers: register_type: handler ABI version " +
                  std::to_string(type ? type->abi_version : 0) +
                  " is unknown to this runtime (it knows versions 1 to " +
                  std::to_string(TFOH_ABI_VERSION) + "); rebuild the library against this "
                  "package's tf_ophandlers/handler.h")
                     .c_str());
    return;
  }
  if (type->struct_size < TFOH_HANDLER_TYPE_MIN_SIZE) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 ("tf_ophandlers: register_type: struct_size " + std::to_string(type->struct_size) +
                  " is smaller than TFOH_HANDLER_TYPE_MIN_SIZE; set it to "
                  "sizeof(TFOH_HandlerType)")
                     .c_str());
    return;
  }
  TFOH_HandlerType hooks;
  std::memset(&hooks, 0, sizeof(hooks));
  std::memcpy(&hooks, type, HandlerTypeBytes(type));
  if (hooks.name == nullptr || hooks.name[0] == '\0' || hooks.create == nullptr ||
      hooks.delete_state == nullptr || (hooks.execute == nullptr && hooks.abi_version < 4)) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 "tf_ophandlers: register_type: name, create, delete_state and (before ABI "
                 "version 4) execute are required");
    return;
  }
  for (TypeRecord* r : *library->types) {
    if (r->name == hooks.name) {
      TF_SetStatus(status, TF_ALREADY_EXISTS,
                   ("tf_ophandlers: handler type " + r->name + " registered twice").c_str());
      return;
    }
  }
  auto* rec = new TypeRecord();
  rec->hooks = hooks;
  rec->name = hooks.name;
  rec->doc = hooks.doc ? hooks.doc : "";
  rec->hooks.name = rec->name.c_str();
  rec->hooks.doc = rec->doc.c_str();
  library->types->push_back(rec);
}

TFOH_Op* ApiOpNew(TFOH_Context* ctx, const char* type, TF_Status* status) {
  TFE_Op* built = TFE_NewOp(ctx->dispatcher->ctx, type, status);
  if (TF_GetCode(status) != TF_OK) return nullptr;
  auto* op = new TFOH_Op{built, nullptr, "", -1, built};
  op->type_storage = type;
  op->type = op->type_storage.c_str();
  return op;
}
void ApiOpDelete(TFOH_Op* op) {
  if (op == nullptr) return;
  TFE_DeleteOp(op->built);
  delete op;
}
void ApiOpSetAttrType(TFOH_Op* op, const char* name, TF_DataType v) {
  TFE_OpSetAttrType(op->built, name, v);
}
void ApiOpSetAttrInt(TFOH_Op* op, const char* name, int64_t v) {
  TFE_OpSetAttrInt(op->built, name, v);
}
void ApiOpSetAttrFloat(TFOH_Op* op, const char* name, float v) {
  TFE_OpSetAttrFloat(op->built, name, v);
}
void ApiOpSetAttrBool(TFOH_Op* op, const char* name, unsigned char v) {
  TFE_OpSetAttrBool(op->built, name, v);
}
void ApiOpSetAttrTensor(TFOH_Op* op, const char* name, TF_Tensor* v, TF_Status* status) {
  TFE_OpSetAttrTensor(op->built, name, v, status);
}
void ApiTensorSetData(TFOH_Tensor* t, void* data, void (*del)(void*)) {
  if (t->del != nullptr) t->del(t->data);
  t->data = data;
  t->del = del;
}
void* ApiTensorData(const TFOH_Tensor* t) { return t->data; }

}  // namespace

const TFOH_RuntimeApi kApi = {
    TFOH_ABI_VERSION,  sizeof(TFOH_RuntimeApi), ApiOpType,         ApiOpDevice,
    ApiOpNumOutputs,   ApiOpAttrs,              ApiTensorDtype,    ApiTensorNumDims,
    ApiTensorDim,      ApiTensorHandle,         ApiTensorRef,      ApiTensorUnref,
    ApiExecuteNext,    ApiRegisterType,         ApiOpNew,          ApiOpDelete,
    ApiOpSetAttrType,  ApiOpSetAttrInt,         ApiOpSetAttrFloat, ApiOpSetAttrBool,
    ApiOpSetAttrTensor, ApiTensorSetData,       ApiTensorData,
};

void Unref(TFOH_Tensor* t) {
  if (t == nullptr || t->refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  if (t->h != nullptr) TFE_DeleteTensorHandle(t->h);
  if (t->del != nullptr) t->del(t->data);
  delete t;
}

void HandlerRef(Handler* h) { h->refs.fetch_add(1, std::memory_order_relaxed); }

void HandlerUnref(Handler* h) {
  if (h == nullptr || h->refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  TF_Status* ignored = TF_NewStatus();
  GuardHook(h, "delete_state", ignored, [&] { h->type->hooks.delete_state(h->state); });
  if (TF_GetCode(ignored) != TF_OK) {
    std::fprintf(stderr, "tf_ophandlers: handler %s: %s\n", h->type->name.c_str(),
                 TF_Message(ignored));
  }
  TF_DeleteStatus(ignored);
  delete h;
}

Stack* NewStack(Handler* handler, Stack* next) {
  HandlerRef(handler);
  if (next != nullptr) StackRef(next);
  auto* s = new Stack();
  s->handler = handler;
  s->next = next;
  return s;
}

void StackRef(Stack* s) {
  if (s != nullptr) s->refs.fetch_add(1, std::memory_order_relaxed);
}

void StackUnref(Stack* s) {
  while (s != nullptr && s->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    Stack* next = s->next;
    HandlerUnref(s->handler);
    delete s;
    s = next;
  }
}

std::string DebugString(const Handler* h) {
  if (h->type->hooks.debug_string != nullptr) {
    TF_Buffer* out = TF_NewBuffer();
    std::string text;
    try {
      h->type->hooks.debug_string(h->state, out);
      if (out->data != nullptr) text.assign(static_cast<const char*>(out->data), out->length);
    } catch (...) {
      text.clear();
    }
    TF_DeleteBuffer(out);
    if (!text.empty()) return text;
  }
  return h->type->name + "()";
}

Payload* PayloadOf(const DispatcherState* d, TFE_TensorHandle* h) {
  TF_Status* s = TF_NewStatus();
  const char* name = TFE_TensorHandleDeviceName(h, s);
  Payload* p = nullptr;
  if (TF_GetCode(s) == TF_OK && name != nullptr && d->name == name) {
    p = static_cast<Payload*>(TFE_TensorHandleDevicePointer(h, s));
    if (TF_GetCode(s) != TF_OK) p = nullptr;
  }
  TF_DeleteStatus(s);
  return p;
}

// The thread's scope stacks, released when the thread ends.
struct ThreadScopeTable {
  std::unordered_map<uint64_t, std::vector<Stack*>> by_dispatcher;
  ~ThreadScopeTable() {
    for (auto& kv : by_dispatcher) {
      for (Stack* s : kv.second) StackUnref(s);
    }
  }
};

std::vector<Stack*>& ThreadScopes(uint64_t id) {
  thread_local ThreadScopeTable table;
  return table.by_dispatcher[id];
}

void RegisterDevice(std::shared_ptr<DispatcherState> d, TF_Status* status) {
  TFE_CustomDevice device;
  device.copy_tensor_to_device = DeviceCopyTo;
  device.copy_tensor_from_device = DeviceCopyFrom;
  device.execute = DeviceExecute;
  device.delete_device = DeviceDelete;
  TFE_Context* ctx = d->ctx;
  std::string name = d->name;
  // TensorFlow owns the holder from here on, also when registration fails.
  auto* holder = new std::shared_ptr<DispatcherState>(std::move(d));
  TFE_RegisterCustomDevice(ctx, device, name.c_str(), holder, status);
}

}  // namespace c_runtime
}  // namespace tf_ophandlers
