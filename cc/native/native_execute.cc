// tf-ophandlers: the per-op execute path of native handlers (NativeStackRun,
// NativeStackExecute, execute_next) and their TFOH_Tensor objects. Contracts: native.h,
// native_internal.h and include/tf_ophandlers/handler.h.
#define PY_SSIZE_T_CLEAN
#include "native/native_internal.h"

#include <atomic>
#include <cstring>
#include <new>
#include <string>

#include "fast/fast_path.h"
#include "boundary/handler_tensor.h"
#include "native/native_hooks.h"
#include "boundary/op.h"
#include "boundary/owners.h"
#include "boundary/runtime.h"
#include "boundary/status.h"

namespace tf_ophandlers {
namespace native_internal {
namespace {

// ---- TFOH_Tensor ------------------------------------------------------------------------

// TFOH_Tensor objects are recycled through a small per-thread free list: the native
// path makes two or three per op, and a heap allocation each was a visible part of its
// cost. A tensor freed on another thread than the one that made it joins that thread's
// list (plain heap memory either way).
struct TensorFreeList {
  static constexpr int kMax = 64;
  TFOH_Tensor* items[kMax];
  int size = 0;
  ~TensorFreeList() {
    while (size > 0) ::operator delete(items[--size]);
  }
};
thread_local TensorFreeList t_free_tensors;

TFOH_Tensor* AllocTensor() {
  TensorFreeList& fl = t_free_tensors;
  void* mem = fl.size > 0 ? fl.items[--fl.size] : ::operator new(sizeof(TFOH_Tensor));
  return new (mem) TFOH_Tensor;
}

void FreeTensor(TFOH_Tensor* t) {
  t->~TFOH_Tensor();
  TensorFreeList& fl = t_free_tensors;
  if (fl.size < TensorFreeList::kMax) {
    fl.items[fl.size++] = t;
  } else {
    ::operator delete(t);
  }
}

}  // namespace

TFOH_Tensor* TensorFromHandle(TFE_TensorHandle* owned) {
  auto* t = AllocTensor();
  t->refs.store(1, std::memory_order_relaxed);
  t->h = owned;
  t->py = nullptr;
  return t;
}

// A tensor for a Python object (an EagerTensor or a symbolic tensor); takes a new
// reference to `py`. GIL: held.
TFOH_Tensor* TensorFromPy(PyObject* py) {
  auto* t = AllocTensor();
  t->refs.store(1, std::memory_order_relaxed);
  if (Py_TYPE(py) == &NativeValueType) {  // ABI 3: the tensor it carries, and its data
    Py_INCREF(py);
    t->wrapper = py;
    py = reinterpret_cast<NativeValueObject*>(py)->tensor;
  }
  Py_INCREF(py);
  t->py = py;
  t->h = EagerTensor_CheckExact(py) ? EagerTensor_Handle(py) : nullptr;
  return t;
}

void Unref(TFOH_Tensor* t) {
  if (t == nullptr) return;
  if (t->refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  Py_CLEAR(t->wrapper);
  if (t->has_data && t->del != nullptr) t->del(t->data);  // never became a NativeValue
  if (t->py != nullptr) {
    Py_DECREF(t->py);  // GIL held: hooks run with it (handler.h)
  } else if (t->h != nullptr) {
    TFE_DeleteTensorHandle(t->h);
  }
  FreeTensor(t);
}

// A new Python object for `t` (its own, or a new EagerTensor sharing its handle), or
// null with a Python exception set. GIL: held.
namespace {

// The tensor's own Python object (no handler data). GIL: held.
PyObject* PlainPyOf(TFOH_Tensor* t) {
  if (t->py != nullptr) {
    Py_INCREF(t->py);
    return t->py;
  }
  return EagerTensorSharing(t->h);
}

// `inner` (a new reference, or null) as the tensor's NativeValue when it carries handler
// data; the data moves into the value, which the tensor keeps. GIL: held.
PyObject* WithData(TFOH_Tensor* t, PyObject* inner) {
  if (inner == nullptr || !t->has_data) return inner;
  PyObject* v = NewNativeValue(inner, t->data, t->del);  // owns the data even on failure
  Py_DECREF(inner);
  t->has_data = false;
  t->data = nullptr;
  t->del = nullptr;
  if (v == nullptr) return nullptr;
  Py_INCREF(v);
  t->wrapper = v;
  return v;
}

}  // namespace

PyObject* PyOf(TFOH_Tensor* t) {
  if (!t->has_data && t->wrapper != nullptr) {
    Py_INCREF(t->wrapper);
    return t->wrapper;
  }
  return WithData(t, PlainPyOf(t));
}

PyObject* EagerTensorSharing(TFE_TensorHandle* h) {
  TF_Status* s = ThreadStatus();
  TFE_TensorHandle* copy = TFE_TensorHandleCopySharingTensor(h, s);
  if (TF_GetCode(s) != TF_OK) {
    PyErr_SetString(PyExc_RuntimeError, TF_Message(s));
    return nullptr;
  }
  PyObject* r = EagerTensorFromHandle(copy, false);
  if (r == nullptr) TFE_DeleteTensorHandle(copy);
  return r;
}

// PyOf for a tensor about to be released: when this is its last reference and it owns
// a handle, the new EagerTensor takes that handle (no copy; `t` keeps only a reference
// to the EagerTensor, released by its Unref). GIL: held.
PyObject* PyOfLast(TFOH_Tensor* t) {
  if (t->py == nullptr && t->h != nullptr && t->refs.load(std::memory_order_acquire) == 1) {
    PyObject* r = EagerTensorFromHandle(t->h, false);  // owns t->h on success
    if (r == nullptr) return nullptr;
    Py_INCREF(r);
    t->py = r;
    return WithData(t, r);
  }
  return PyOf(t);
}

namespace {

// Executes on PHYSICAL in C: every input is an eager physical tensor. GIL: held; released
// around TFE_Execute.
void ExecutePhysical(TFOH_Context* ctx, const TFOH_Op* op, int n_in, TFOH_Tensor* const* in,
                     int* num_outputs, TFOH_Tensor** outputs, TF_Status* status) {
  int num = op->num_outputs;
  if (num > *num_outputs) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 "tf_ophandlers: execute_next: too few output slots for the op");
    return;
  }
  // state.device now (a hook may have run Python since the op was placed); on the no-GIL
  // path, as read at the op's start (no Python has run on this thread since).
  const char* device = ctx->device_utf8;
  if (ctx->gil) {
    PyObject* dev_obj = StateGet(s_device);
    device = dev_obj != nullptr ? PyUnicode_AsUTF8(dev_obj) : "";
    if (device == nullptr) {
      PyErr_Clear();
      device = "";
    }
  } else if (device == nullptr) {
    device = "";
  }
  absl::InlinedVector<TFE_TensorHandle*, 4> handles(n_in);
  for (int i = 0; i < n_in; ++i) handles[i] = in[i]->h;
  absl::InlinedVector<TFE_TensorHandle*, 4> rets(num > 0 ? num : 1);
  // Ops that run Python inside their kernel (tf.py_function's body) run it below the
  // handler: state.current is the next stack meanwhile, as for the Python stack's
  // forwarding (only these ops pay for it).
  PyObject* saved = nullptr;
  if (ctx->gil && std::strstr(op->type, "PyFunc") != nullptr) {
    saved = PyObject_GetAttr(g_state, s_current);
    if (saved == nullptr || PyObject_SetAttr(g_state, s_current, ctx->next) < 0) {
      Py_CLEAR(saved);
      PyErr_Clear();
    }
  }
  ExecuteOnPhysical(op->tfe, op->type, device, n_in, handles.data(), &num, rets.data(),
                    status, ctx->gil);
  if (saved != nullptr) {
    if (PyObject_SetAttr(g_state, s_current, saved) < 0) PyErr_Clear();
    Py_DECREF(saved);
  }
  if (TF_GetCode(status) != TF_OK) return;
  for (int i = 0; i < num; ++i) outputs[i] = TensorFromHandle(rets[i]);
  *num_outputs = num;
}

// Executes on the next stack through Python (`next.execute(op, inputs)`), with
// state.current set to it. GIL: held.
void ExecuteThroughPython(TFOH_Context* ctx, const TFOH_Op* op, int n_in,
                          TFOH_Tensor* const* in, int* num_outputs, TFOH_Tensor** outputs,
                          TF_Status* status) {
  PyObject* py_op = op->py;
  OpObject* made = nullptr;
  if (py_op == nullptr) {
    made = NewOpObject(op->type, op->device, op->num_outputs);
    if (made == nullptr) {
      StatusFromPyErr(status);
      return;
    }
    made->borrowed = op->tfe;
    py_op = reinterpret_cast<PyObject*>(made);
  }
  // Released in the reverse order of these declarations (the Op made here last), after
  // an error was turned into `status`.
  OpRef made_ref(made, g_ctx);
  PyRef inputs(PyList_New(n_in));
  PyRef result;
  PyRef saved;
  [&] {
    if (!inputs) return;
    for (int i = 0; i < n_in; ++i) {
      PyObject* o = PlainPyOf(in[i]);  // the tensor of the next stack, not handler data
      if (o == nullptr) return;
      PyList_SET_ITEM(inputs.get(), i, o);
    }
    saved.reset(PyObject_GetAttr(g_state, s_current));
    if (!saved || PyObject_SetAttr(g_state, s_current, ctx->next) < 0) return;
    result.reset(
        PyObject_CallMethodObjArgs(ctx->next, s_execute, py_op, inputs.get(), nullptr));
    {
      // Restore even on failure, keeping the error.
      PyObject *et, *ev, *tb;
      PyErr_Fetch(&et, &ev, &tb);
      if (PyObject_SetAttr(g_state, s_current, saved.get()) < 0) PyErr_Clear();
      PyErr_Restore(et, ev, tb);
    }
    if (!result) return;
    if (!PyList_Check(result.get()) && !PyTuple_Check(result.get())) {
      PyErr_SetString(PyExc_TypeError, "tf_ophandlers: the next stack returned a non-list");
      return;
    }
    PyRef seq(PySequence_Fast(result.get(), ""));
    Py_ssize_t n = seq ? PySequence_Fast_GET_SIZE(seq.get()) : 0;
    if (seq && n > *num_outputs) {
      PyErr_SetString(PyExc_ValueError,
                      "tf_ophandlers: execute_next: more outputs than output slots");
    } else if (seq) {
      for (Py_ssize_t i = 0; i < n; ++i) {
        outputs[i] = TensorFromPy(PySequence_Fast_GET_ITEM(seq.get(), i));
      }
      *num_outputs = static_cast<int>(n);
    }
  }();
  if (PyErr_Occurred()) StatusFromPyErr(status);
}

}  // namespace


bool IsCopyOrConst(const char* type) {
  if (type[0] == '_' && std::strcmp(type, "_EagerConst") == 0) return true;
  return std::strncmp(type, "Copy", 4) == 0 &&
         (!std::strcmp(type, "CopyOn") || !std::strcmp(type, "CopyOff") ||
          !std::strcmp(type, "CopyOnGrad") || !std::strcmp(type, "CopyOffGrad"));
}

void ApiExecuteNext(TFOH_Context* ctx, const TFOH_Op* op, int n_in, TFOH_Tensor* const* in,
                    int* num_outputs, TFOH_Tensor** outputs, TF_Status* status) {
  if (std::this_thread::get_id() != ctx->thread) {  // checked first: no GIL, no Python here
    TF_SetStatus(status, TF_FAILED_PRECONDITION,
                 (std::string("tf_ophandlers: execute_next of op ") + op->type +
                  " was called on another thread than the hook's; a hook must call "
                  "execute_next on the thread that runs it (tf_ophandlers/handler.h)")
                     .c_str());
    return;
  }
  if (!ctx->gil) {
    // The no-GIL path (NativeNoGilExecute): a physical execution runs as it is; anything
    // else (an input that is not a physical handle, an op running Python in its kernel)
    // takes the GIL for the usual path.
    bool plain = ctx->eager && ctx->next == g_physical && op->num_outputs >= 0 &&
                 op->built == nullptr &&
                 std::strstr(op->type, "PyFunc") == nullptr;
    for (int i = 0; plain && i < n_in; ++i) {
      plain = in[i] != nullptr && in[i]->py == nullptr && in[i]->h != nullptr &&
              PayloadOf(in[i]->h) == nullptr;
    }
    if (plain) {
      ExecutePhysical(ctx, op, n_in, in, num_outputs, outputs, status);
      return;
    }
    PyGILState_STATE g = PyGILState_Ensure();
    ctx->gil = true;
    ApiExecuteNext(ctx, op, n_in, in, num_outputs, outputs, status);
    ctx->gil = false;
    PyGILState_Release(g);
    return;
  }
  TFOH_Op resolved;
  if (op->built != nullptr) {  // ABI 3: an op the handler built (native_build.cc)
    if (!ResolveBuiltOp(op, &resolved, status)) return;
    op = &resolved;
  }
  bool physical = ctx->eager && ctx->next == g_physical;
  for (int i = 0; physical && i < n_in; ++i) {
    if (in[i] == nullptr) {
      TF_SetStatus(status, TF_INVALID_ARGUMENT, "tf_ophandlers: execute_next: null input");
      return;
    }
    physical = in[i]->h != nullptr && PayloadOf(in[i]->h) == nullptr;
  }
  if (physical && op->num_outputs >= 0) {
    ExecutePhysical(ctx, op, n_in, in, num_outputs, outputs, status);
    return;
  }
  if (ctx->eager && ctx->next != g_physical && op->num_outputs >= 0) {
    // The fast path's levels below (a C/C++ handler, a Python level that does not
    // execute the op): run them in C too.
    absl::InlinedVector<TFE_TensorHandle*, 4> handles;
    for (int i = 0; i < n_in && in[i]->h != nullptr; ++i) handles.push_back(in[i]->h);
    absl::InlinedVector<TFE_TensorHandle*, 4> outs(op->num_outputs > 0 ? op->num_outputs : 1);
    int n = op->num_outputs;
    if (static_cast<int>(handles.size()) == n_in && n <= *num_outputs &&
        FastRunOn(ctx->next, op->tfe, op->type, op->device, n_in, handles.data(), &n,
                  outs.data(), status)) {
      if (TF_GetCode(status) == TF_OK) {
        for (int i = 0; i < n; ++i) outputs[i] = TensorFromHandle(outs[i]);
        *num_outputs = n;
      }
      return;
    }
  }
  {
    ExecuteThroughPython(ctx, op, n_in, in, num_outputs, outputs, status);
  }
}

// Runs the execute hook and checks what it returned against the op. On success
// `outs` holds `n_out` new tensors. Returns false with `status` set. GIL: held.
bool RunExecute(NativeHandlerObject* self, TFOH_Context* ctx, TFOH_Op* op,
                absl::InlinedVector<TFOH_Tensor*, 4>& ins,
                absl::InlinedVector<TFOH_Tensor*, 4>& outs,
                const absl::InlinedVector<TF_DataType, 4>* want,
                TF_Status* status) {
  int cap = op->num_outputs < 0 ? 0 : op->num_outputs;
  outs.assign(cap > 0 ? cap : 1, nullptr);
  int n = cap;
  auto execute = self->type->hooks.execute;
  if (execute != nullptr) {
    CallVoidHook(self, "execute", op->type, status, [&] {
      execute(self->state, ctx, op, static_cast<int>(ins.size()), ins.data(), &n, outs.data(),
              status);
    });
  } else {
    // ABI version 4: a type without execute forwards every op (the paths that reach here
    // for it: the no-GIL path, a direct `_oh_execute`; the stacks forward it otherwise).
    ApiExecuteNext(ctx, op, static_cast<int>(ins.size()), ins.data(), &n, outs.data(),
                   status);
  }
  if (TF_GetCode(status) != TF_OK) {
    for (auto* t : outs) Unref(t);
    outs.clear();
    PrefixStatus(self, "execute", op->type, status);
    return false;
  }
  std::string bad;
  if (n < 0 || n > cap || (op->num_outputs >= 0 && n != op->num_outputs)) {
    bad = "expected " + std::to_string(op->num_outputs) + " outputs, got " + std::to_string(n);
  } else {
    for (int i = 0; i < n && bad.empty(); ++i) {
      if (outs[i] == nullptr) {
        bad = "output " + std::to_string(i) + " is null";
      } else if (want != nullptr && i < static_cast<int>(want->size()) &&
                 ApiTensorDtype(outs[i]) != (*want)[i]) {
        bad = "output " + std::to_string(i) + " has dtype enum " +
              std::to_string(ApiTensorDtype(outs[i])) + ", the OpDef requires " +
              std::to_string((*want)[i]);
      }
    }
  }
  if (!bad.empty()) {
    for (auto* t : outs) Unref(t);
    outs.clear();
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 ("tf_ophandlers: " + DebugString(self) + ".execute returned invalid outputs "
                  "for op " + op->type + ": " + bad).c_str());
    return false;
  }
  outs.resize(n);
  return true;
}

// NativeStackExecute's wrap: the handler tensors of `stack` for the hook's outputs `outs`
// (checked against `want`), or the tensors that left the stacks below (resources, or
// outputs not on `next`). On success `outputs` holds outs.size() new handles; on failure
// it holds nothing and `status` is set. `outs` stay the caller's. GIL: held.
bool WrapNativeOutputs(PyObject* stack, NativeHandlerObject* self, PyObject* next,
                       const char* type, const absl::InlinedVector<TF_DataType, 4>& want,
                       absl::InlinedVector<TFOH_Tensor*, 4>& outs, TFE_TensorHandle** outputs,
                       TF_Status* status) {
  PyObject* producer = InternedString(type);
  if (producer == nullptr) {
    StatusFromPyErr(status);
    return false;
  }
  const bool shape_hooks =
      self->type->hooks.num_dims != nullptr || self->type->hooks.dim != nullptr;
  for (size_t i = 0; i < outs.size(); ++i) {
    TFOH_Tensor* t = outs[i];
    TFE_TensorHandle* result = nullptr;
    TF_DataType dt = want[i];
    bool leaves = dt == TF_RESOURCE;  // native handlers are transient (handler.h)
    if (!leaves && next != g_physical && t->h != nullptr) {
      TFOH_Payload* p = PayloadOf(t->h);
      leaves = p == nullptr || p->stack != next;  // left the stacks below
    }
    if (leaves && t->h != nullptr) {
      result = TFE_TensorHandleCopySharingTensor(t->h, status);
    } else if (!shape_hooks && t->py == nullptr && t->h != nullptr && !t->has_data &&
               t->wrapper == nullptr) {
      // A handle without a Python object (the common case: execute_next's output): the
      // handler tensor takes it as it is (NewHandlerTensorHandleFromHandle), no
      // EagerTensor is made unless Python asks for the value.
      TFE_TensorHandle* h = t->h;
      if (t->refs.load(std::memory_order_acquire) == 1) {
        t->h = nullptr;  // moved: Unref no longer deletes it
      } else {
        h = TFE_TensorHandleCopySharingTensor(t->h, status);
      }
      if (TF_GetCode(status) == TF_OK) {
        result = NewHandlerTensorHandleFromHandle(stack, h, dt, producer);
        if (result == nullptr) StatusFromPyErr(status);
      }
    } else {
      PyObject* v = PyOfLast(t);
      if (v != nullptr) {
        result = NewHandlerTensorHandle(stack, v, dt, producer, !shape_hooks);
        Py_DECREF(v);
      }
      if (result == nullptr) StatusFromPyErr(status);
    }
    if (TF_GetCode(status) != TF_OK) {
      for (size_t j = 0; j < i; ++j) TFE_DeleteTensorHandle(outputs[j]);
      Py_DECREF(producer);
      return false;
    }
    outputs[i] = result;
  }
  Py_DECREF(producer);
  return true;
}

bool NativeStackExecute(PyObject* stack, NativeHandlerObject* self, PyObject* next,
                        const TFOH_Op* op_in, int n_in, TFE_TensorHandle** in,
                        int* num_outputs, TFE_TensorHandle** outputs, TF_Status* status) {
  if (stack == g_physical || IsCopyOrConst(op_in->type)) return false;
  absl::InlinedVector<TF_DataType, 4> want;
  absl::InlinedVector<TFOH_Tensor*, 4> ins, outs;
  bool handled = false;
  TFOH_Op op = *op_in;
  {
    // The tensors made for the handler are released on every exit of the body.
    struct Release {
      absl::InlinedVector<TFOH_Tensor*, 4>* ins;
      absl::InlinedVector<TFOH_Tensor*, 4>* outs;
      ~Release() {
        for (auto* t : *ins) Unref(t);
        for (auto* t : *outs) Unref(t);
      }
    } release{&ins, &outs};
    [&] {
      if (self == nullptr || next == nullptr || self->state == nullptr) return;
      if (!ExpectedOutputs(op.tfe, &want) || static_cast<int>(want.size()) > *num_outputs) {
        return;
      }
      op.num_outputs = static_cast<int>(want.size());
      for (int i = 0; i < n_in; ++i) {
        TFOH_Payload* p = PayloadOf(in[i]);
        if (p != nullptr) {
          if (p->kind != TFOH_PAYLOAD_PYTHON || p->stack != stack) return;
          if (p->value == nullptr) {
            // A C path's output with no Python object: the tensor gets its own reference
            // to the handle (CopySharingTensor re-references the same TensorHandle).
            TFE_TensorHandle* h = PayloadTensorHandle(p);
            TFE_TensorHandle* copy =
                h ? TFE_TensorHandleCopySharingTensor(h, status) : nullptr;
            if (copy == nullptr || TF_GetCode(status) != TF_OK) {
              TF_SetStatus(status, TF_OK, "");
              return;
            }
            ins.push_back(TensorFromHandle(copy));
            continue;
          }
          PyObject* v = reinterpret_cast<PyObject*>(p->value);
          if (!EagerTensor_CheckExact(v)) return;
          ins.push_back(TensorFromPy(v));
        } else if (next == g_physical && self->type->hooks.copy_on == nullptr) {
          // The default copy-on of a physical tensor onto PHYSICAL is the tensor itself.
          TFE_TensorHandle* copy = TFE_TensorHandleCopySharingTensor(in[i], status);
          if (TF_GetCode(status) != TF_OK) {
            TF_SetStatus(status, TF_OK, "");
            return;
          }
          ins.push_back(TensorFromHandle(copy));
        } else {
          return;
        }
      }
      // From here on the op is ours: every failure is reported through `status`.
      handled = true;
      PyObject* dev = StateGet(s_device);  // borrowed (ctx.device: read at the op's start)
      if (dev == nullptr) {
        TF_SetStatus(status, TF_INTERNAL, "tf_ophandlers: state.device is not set");
        return;
      }
      {
        TFOH_Context ctx{stack, next, true, dev};
        if (!RunExecute(self, &ctx, &op, ins, outs, &want, status)) return;
      }
      if (!WrapNativeOutputs(stack, self, next, op.type, want, outs, outputs, status)) return;
      *num_outputs = static_cast<int>(outs.size());
    }();
  }
  if (!handled && PyErr_Occurred()) PyErr_Clear();
  return handled;
}

}  // namespace native_internal

using namespace native_internal;  // NOLINT: this file's own internals

bool NativeStackRun(PyObject* stack, PyObject* handler, PyObject* next, const TFE_Op* tfe_op,
                    const char* type, const char* device, int n_in, TFE_TensorHandle** in,
                    int* num_outputs, TFE_TensorHandle** outputs, TF_Status* status,
                    bool first_stack) {
  if (g_state == nullptr || IsCopyOrConst(type)) return false;
  if (handler == nullptr || !PyObject_TypeCheck(handler, &NativeHandlerBaseType)) return false;
  TFOH_Op op{tfe_op, nullptr, type, device, -1};
  int n = *num_outputs;
  bool handled = NativeStackExecute(stack, reinterpret_cast<NativeHandlerObject*>(handler),
                                    next, &op, n_in, in, &n, outputs, status);
  if (handled && TF_GetCode(status) == TF_OK) {
    *num_outputs = n;
    if (first_stack && next == g_physical) RememberNoGilStack(stack, handler);
  }
  return handled;
}

}  // namespace tf_ophandlers
