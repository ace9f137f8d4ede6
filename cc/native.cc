// tf-ophandlers: handlers written against the public C ABI. Contracts: native.h and
// include/tf_ophandlers/handler.h.
#define PY_SSIZE_T_CLEAN
#include "native.h"

#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "handler_tensor.h"
#include "native_hooks.h"
#include "op.h"
#include "runtime.h"
#include "status.h"
#include "tf_ophandlers/handler.h"

// ---- the opaque types of handler.h ------------------------------------------------------

struct TFOH_Tensor {
  std::atomic<int> refs;
  TFE_TensorHandle* h;  // owned iff py == nullptr; null for a symbolic tensor
  PyObject* py;         // owned; may be null (a tensor the C path made)
};

struct TFOH_Op {
  const TFE_Op* tfe;  // attribute source, borrowed
  PyObject* py;       // the Python Op (tf_ophandlers.Op), borrowed; may be null
  const char* type;
  const char* device;
  int num_outputs;
};

struct TFOH_Context {
  PyObject* stack;  // the handler's stack, borrowed
  PyObject* next;   // its next stack, borrowed
  bool eager;       // no function is being replayed
  PyObject* device; // state.device (str), borrowed
};

struct TFOH_Library {
  std::vector<void*>* types;  // tf_ophandlers::TypeRecord*
};

namespace tf_ophandlers {
namespace {

struct TypeRecord {
  TFOH_HandlerType hooks;  // zero-filled past the library's struct_size
  std::string name;
  std::string doc;
};

struct NativeHandlerObject {
  PyObject_HEAD
  TypeRecord* type;  // never freed (libraries are never unloaded)
  void* state;       // owned: delete_state on dealloc
};

// Set by native_setup (tf_ophandlers.core.native at import). Strong references.
PyObject* g_state = nullptr;     // tf_ophandlers.core.state.state (thread-local object)
PyObject* g_physical = nullptr;  // tf_ophandlers.core.stack.PHYSICAL
PyObject* s_mode = nullptr;      // interned attribute names
PyObject* s_current = nullptr;
PyObject* s_handler = nullptr;
PyObject* s_next = nullptr;
PyObject* s_device = nullptr;
PyObject* s_execute = nullptr;

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
  Py_INCREF(py);
  t->py = py;
  t->h = EagerTensor_CheckExact(py) ? EagerTensor_Handle(py) : nullptr;
  return t;
}

void Unref(TFOH_Tensor* t) {
  if (t == nullptr) return;
  if (t->refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  if (t->py != nullptr) {
    Py_DECREF(t->py);  // GIL held: hooks run with it (handler.h)
  } else if (t->h != nullptr) {
    TFE_DeleteTensorHandle(t->h);
  }
  FreeTensor(t);
}

// A new Python object for `t` (its own, or a new EagerTensor sharing its handle), or
// null with a Python exception set. GIL: held.
PyObject* PyOf(TFOH_Tensor* t) {
  if (t->py != nullptr) {
    Py_INCREF(t->py);
    return t->py;
  }
  TF_Status* s = ThreadStatus();
  TFE_TensorHandle* copy = TFE_TensorHandleCopySharingTensor(t->h, s);
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
    return r;
  }
  return PyOf(t);
}

// ---- the runtime API ----------------------------------------------------------------------

const char* ApiOpType(const TFOH_Op* op) { return op->type; }
const char* ApiOpDevice(const TFOH_Op* op) { return op->device; }
int ApiOpNumOutputs(const TFOH_Op* op) { return op->num_outputs; }
const TFE_OpAttrs* ApiOpAttrs(const TFOH_Op* op) { return TFE_OpGetAttrs(op->tfe); }

TF_DataType ApiTensorDtype(const TFOH_Tensor* t) {
  if (t->h != nullptr) return TFE_TensorHandleDataType(t->h);
  PyObject* d = PyObject_GetAttrString(t->py, "dtype");
  PyObject* e = d ? PyObject_GetAttrString(d, "as_datatype_enum") : nullptr;
  long v = e ? PyLong_AsLong(e) : 0;
  Py_XDECREF(d);
  Py_XDECREF(e);
  PyErr_Clear();
  return static_cast<TF_DataType>(v);
}

int ApiTensorNumDims(const TFOH_Tensor* t, TF_Status* status) {
  if (t->h != nullptr) return TFE_TensorHandleNumDims(t->h, status);
  PyObject* shape = PyObject_GetAttrString(t->py, "shape");
  PyObject* rank = shape ? PyObject_GetAttrString(shape, "rank") : nullptr;
  int r = (rank && rank != Py_None) ? static_cast<int>(PyLong_AsLong(rank)) : -1;
  Py_XDECREF(shape);
  Py_XDECREF(rank);
  if (PyErr_Occurred()) {
    StatusFromPyErr(status);
    return -1;
  }
  return r;
}

int64_t ApiTensorDim(const TFOH_Tensor* t, int index, TF_Status* status) {
  if (t->h != nullptr) return TFE_TensorHandleDim(t->h, index, status);
  PyObject* shape = PyObject_GetAttrString(t->py, "shape");
  PyObject* list = shape ? PyObject_CallMethod(shape, "as_list", nullptr) : nullptr;
  int64_t r = -1;
  if (list != nullptr) {
    if (index < 0 || index >= PyList_GET_SIZE(list)) {
      TF_SetStatus(status, TF_INVALID_ARGUMENT, "tf_ophandlers: dim index out of range");
    } else {
      PyObject* v = PyList_GET_ITEM(list, index);
      r = v == Py_None ? -1 : PyLong_AsLongLong(v);
    }
  }
  Py_XDECREF(shape);
  Py_XDECREF(list);
  if (PyErr_Occurred()) {
    StatusFromPyErr(status);
    return -1;
  }
  return r;
}

TFE_TensorHandle* ApiTensorHandle(const TFOH_Tensor* t) { return t->h; }
void ApiTensorRef(TFOH_Tensor* t) { t->refs.fetch_add(1, std::memory_order_relaxed); }
void ApiTensorUnref(TFOH_Tensor* t) { Unref(t); }

// Executes on PHYSICAL in C: every input is an eager physical tensor. GIL: held; released
// around TFE_Execute.
void ExecutePhysical(TFOH_Context* ctx, const TFOH_Op* op, int n_in, TFOH_Tensor* const* in,
                     int* num_outputs, TFOH_Tensor** outputs, TF_Status* status) {
  thread_local TFE_Op* cached_op = nullptr;
  const char* device = ctx->device ? PyUnicode_AsUTF8(ctx->device) : "";
  if (device == nullptr) {
    PyErr_Clear();
    device = "";
  }
  TFE_Op* tfe = cached_op;
  cached_op = nullptr;
  if (tfe != nullptr) {
    TFE_OpReset(tfe, op->type, device, status);
    if (TF_GetCode(status) != TF_OK) {
      TFE_DeleteOp(tfe);
      tfe = nullptr;
      TF_SetStatus(status, TF_OK, "");
    }
  }
  if (tfe == nullptr) {
    tfe = TFE_NewOp(g_ctx, op->type, status);
    if (TF_GetCode(status) != TF_OK) return;
    TFE_OpSetDevice(tfe, device, status);
    if (TF_GetCode(status) != TF_OK) {
      TFE_DeleteOp(tfe);
      return;
    }
  }
  TFE_OpAddAttrs(tfe, TFE_OpGetAttrs(op->tfe));
  for (int i = 0; i < n_in && TF_GetCode(status) == TF_OK; ++i) TFE_OpAddInput(tfe, in[i]->h, status);
  absl::InlinedVector<TFE_TensorHandle*, 4> rets(op->num_outputs > 0 ? op->num_outputs : 1);
  int num = op->num_outputs;
  if (TF_GetCode(status) == TF_OK) {
    if (num > *num_outputs) {
      TF_SetStatus(status, TF_INVALID_ARGUMENT,
                   "tf_ophandlers: execute_next: too few output slots for the op");
    } else {
      // Ops that run Python inside their kernel (tf.py_function's body) run it below
      // the handler: state.current is the next stack meanwhile, as for the Python
      // stack's forwarding (only these ops pay for it).
      PyObject* saved = nullptr;
      if (std::strstr(op->type, "PyFunc") != nullptr) {
        saved = PyObject_GetAttr(g_state, s_current);
        if (saved == nullptr || PyObject_SetAttr(g_state, s_current, ctx->next) < 0) {
          Py_CLEAR(saved);
          PyErr_Clear();
        }
      }
      Py_BEGIN_ALLOW_THREADS;
      TFE_Execute(tfe, rets.data(), &num, status);
      Py_END_ALLOW_THREADS;
      if (saved != nullptr) {
        if (PyObject_SetAttr(g_state, s_current, saved) < 0) PyErr_Clear();
        Py_DECREF(saved);
      }
    }
  }
  if (TF_GetCode(status) == TF_OK) {
    for (int i = 0; i < num; ++i) outputs[i] = TensorFromHandle(rets[i]);
    *num_outputs = num;
    if (cached_op == nullptr) {
      cached_op = tfe;
      return;
    }
  }
  TFE_DeleteOp(tfe);
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
  PyObject* inputs = PyList_New(n_in);
  PyObject* result = nullptr;
  PyObject* saved = nullptr;
  if (inputs == nullptr) goto done;
  for (int i = 0; i < n_in; ++i) {
    PyObject* o = PyOf(in[i]);
    if (o == nullptr) goto done;
    PyList_SET_ITEM(inputs, i, o);
  }
  saved = PyObject_GetAttr(g_state, s_current);
  if (saved == nullptr || PyObject_SetAttr(g_state, s_current, ctx->next) < 0) goto done;
  result = PyObject_CallMethodObjArgs(ctx->next, s_execute, py_op, inputs, nullptr);
  {
    // Restore even on failure, keeping the error.
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    if (PyObject_SetAttr(g_state, s_current, saved) < 0) PyErr_Clear();
    PyErr_Restore(et, ev, tb);
  }
  if (result != nullptr) {
    if (!PyList_Check(result) && !PyTuple_Check(result)) {
      PyErr_SetString(PyExc_TypeError, "tf_ophandlers: the next stack returned a non-list");
    } else {
      PyObject* seq = PySequence_Fast(result, "");
      Py_ssize_t n = seq ? PySequence_Fast_GET_SIZE(seq) : 0;
      if (seq != nullptr && n > *num_outputs) {
        PyErr_SetString(PyExc_ValueError,
                        "tf_ophandlers: execute_next: more outputs than output slots");
      } else if (seq != nullptr) {
        for (Py_ssize_t i = 0; i < n; ++i) outputs[i] = TensorFromPy(PySequence_Fast_GET_ITEM(seq, i));
        *num_outputs = static_cast<int>(n);
      }
      Py_XDECREF(seq);
    }
  }
done:
  if (PyErr_Occurred()) StatusFromPyErr(status);
  Py_XDECREF(saved);
  Py_XDECREF(result);
  Py_XDECREF(inputs);
  if (made != nullptr) {
    EndBorrow(made, g_ctx);
    Py_DECREF(made);
  }
}

// Runs `op` on `stack` in C when its handler is native and every input (`in`, borrowed
// handles) is already on it, or is physical and taken as it is (the next stack is
// PHYSICAL and the type has no copy_on). Returns false when not (nothing done, `status`
// untouched); true when it ran: `status` tells whether it succeeded, and on success
// `outputs` holds `*num_outputs` new handles (handler tensors of `stack`, or tensors that
// left the stacks below). `op->num_outputs` < 0: read from the OpDef. GIL: held.
bool NativeStackExecute(PyObject* stack, const TFOH_Op* op, int n_in, TFE_TensorHandle** in,
                        int* num_outputs, TFE_TensorHandle** outputs, TF_Status* status);

bool IsCopyOrConst(const char* type) {
  if (type[0] == '_' && std::strcmp(type, "_EagerConst") == 0) return true;
  return std::strncmp(type, "Copy", 4) == 0 &&
         (!std::strcmp(type, "CopyOn") || !std::strcmp(type, "CopyOff") ||
          !std::strcmp(type, "CopyOnGrad") || !std::strcmp(type, "CopyOffGrad"));
}

void ApiExecuteNext(TFOH_Context* ctx, const TFOH_Op* op, int n_in, TFOH_Tensor* const* in,
                    int* num_outputs, TFOH_Tensor** outputs, TF_Status* status) {
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
    // A native handler below: run it in C too.
    absl::InlinedVector<TFE_TensorHandle*, 4> handles;
    for (int i = 0; i < n_in && in[i]->h != nullptr; ++i) handles.push_back(in[i]->h);
    absl::InlinedVector<TFE_TensorHandle*, 4> outs(op->num_outputs > 0 ? op->num_outputs : 1);
    int n = op->num_outputs;
    if (static_cast<int>(handles.size()) == n_in && n <= *num_outputs &&
        NativeStackExecute(ctx->next, op, n_in, handles.data(), &n, outs.data(), status)) {
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

void ApiRegisterType(TFOH_Library* library, const TFOH_HandlerType* type, TF_Status* status) {
  if (type == nullptr || !KnownAbiVersion(type->abi_version)) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 UnknownAbiVersionMessage(type ? type->abi_version : 0).c_str());
    return;
  }
  if (type->name == nullptr || type->name[0] == '\0' || type->create == nullptr ||
      type->delete_state == nullptr || type->execute == nullptr) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 "tf_ophandlers: register_type: name, create, delete_state and execute are "
                 "required");
    return;
  }
  for (void* r : *library->types) {
    if (static_cast<TypeRecord*>(r)->name == type->name) {
      TF_SetStatus(status, TF_ALREADY_EXISTS,
                   (std::string("tf_ophandlers: handler type ") + type->name +
                    " registered twice").c_str());
      return;
    }
  }
  auto* rec = new TypeRecord();
  std::memset(&rec->hooks, 0, sizeof(rec->hooks));
  std::memcpy(&rec->hooks, type, HandlerTypeBytes(type));  // later versions' fields: NULL
  rec->name = type->name;
  rec->doc = type->doc ? type->doc : "";
  rec->hooks.name = rec->name.c_str();
  rec->hooks.doc = rec->doc.c_str();
  library->types->push_back(rec);
}

const TFOH_RuntimeApi kApi = {
    TFOH_ABI_VERSION,  sizeof(TFOH_RuntimeApi), ApiOpType,       ApiOpDevice,
    ApiOpNumOutputs,   ApiOpAttrs,              ApiTensorDtype,  ApiTensorNumDims,
    ApiTensorDim,      ApiTensorHandle,         ApiTensorRef,    ApiTensorUnref,
    ApiExecuteNext,    ApiRegisterType,
};

// ---- helpers ----------------------------------------------------------------------------

std::string DebugString(NativeHandlerObject* self) {
  if (self->type->hooks.debug_string != nullptr && self->state != nullptr) {
    TF_Buffer* b = TF_NewBuffer();
    self->type->hooks.debug_string(self->state, b);
    std::string r(static_cast<const char*>(b->data ? b->data : ""), b->data ? b->length : 0);
    TF_DeleteBuffer(b);
    return r;
  }
  return self->type->name + "()";
}

// Prefixes a failed `status` with the handler and op. GIL: held.
void PrefixStatus(NativeHandlerObject* self, const char* hook, const char* op_type,
                  TF_Status* status) {
  std::string m = "tf_ophandlers: " + DebugString(self) + "." + hook;
  if (op_type != nullptr) m += std::string(" failed for op ") + op_type;
  else m += " failed";
  m += ": ";
  m += TF_Message(status);
  TF_SetStatus(status, TF_GetCode(status), m.c_str());
}

// Raises the failed `status` as a Python exception. GIL: held.
void RaiseStatus(TF_Status* status) { RaiseFromStatus(status); }

bool CheckState(NativeHandlerObject* self) {
  if (self->type == nullptr || self->state == nullptr) {
    PyErr_SetString(PyExc_RuntimeError,
                    "tf_ophandlers: native handler not initialized (call its __init__)");
    return false;
  }
  return true;
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
  self->type->hooks.execute(self->state, ctx, op, static_cast<int>(ins.size()), ins.data(), &n,
                            outs.data(), status);
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

bool NativeStackExecute(PyObject* stack, const TFOH_Op* op_in, int n_in, TFE_TensorHandle** in,
                        int* num_outputs, TFE_TensorHandle** outputs, TF_Status* status) {
  if (stack == g_physical || IsCopyOrConst(op_in->type)) return false;
  PyObject* handler = PyObject_GetAttr(stack, s_handler);
  PyObject* next = nullptr;
  PyObject* dev = nullptr;
  PyObject* producer = nullptr;
  NativeHandlerObject* self = nullptr;
  absl::InlinedVector<TF_DataType, 4> want;
  absl::InlinedVector<TFOH_Tensor*, 4> ins, outs;
  bool handled = false;
  bool shape_hooks = false;
  TFOH_Op op = *op_in;
  if (handler == nullptr || !PyObject_TypeCheck(handler, &NativeHandlerBaseType)) goto out;
  self = reinterpret_cast<NativeHandlerObject*>(handler);
  if (self->state == nullptr) goto out;
  next = PyObject_GetAttr(stack, s_next);
  if (next == nullptr) goto out;
  if (!ExpectedOutputs(op.tfe, &want) || static_cast<int>(want.size()) > *num_outputs) goto out;
  op.num_outputs = static_cast<int>(want.size());
  for (int i = 0; i < n_in; ++i) {
    TFOH_Payload* p = PayloadOf(in[i]);
    if (p != nullptr) {
      PyObject* v = reinterpret_cast<PyObject*>(p->value);
      if (p->kind != TFOH_PAYLOAD_PYTHON || p->stack != stack || !EagerTensor_CheckExact(v)) goto out;
      ins.push_back(TensorFromPy(v));
    } else if (next == g_physical && self->type->hooks.copy_on == nullptr) {
      // The default copy-on of a physical tensor onto PHYSICAL is the tensor itself.
      TFE_TensorHandle* copy = TFE_TensorHandleCopySharingTensor(in[i], status);
      if (TF_GetCode(status) != TF_OK) {
        TF_SetStatus(status, TF_OK, "");
        goto out;
      }
      ins.push_back(TensorFromHandle(copy));
    } else {
      goto out;
    }
  }
  // From here on the op is ours: every failure is reported through `status`.
  handled = true;
  dev = PyObject_GetAttr(g_state, s_device);
  if (dev == nullptr) {
    StatusFromPyErr(status);
    goto out;
  }
  {
    TFOH_Context ctx{stack, next, true, dev};
    if (!RunExecute(self, &ctx, &op, ins, outs, &want, status)) goto out;
  }
  producer = InternedString(op.type);
  if (producer == nullptr) {
    StatusFromPyErr(status);
    goto out;
  }
  shape_hooks = self->type->hooks.num_dims != nullptr || self->type->hooks.dim != nullptr;
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
      goto out;
    }
    outputs[i] = result;
  }
  *num_outputs = static_cast<int>(outs.size());
out:
  for (auto* t : ins) Unref(t);
  for (auto* t : outs) Unref(t);
  Py_XDECREF(producer);
  Py_XDECREF(dev);
  Py_XDECREF(next);
  Py_XDECREF(handler);
  if (!handled && PyErr_Occurred()) PyErr_Clear();
  return handled;
}

// ---- NativeHandlerBase methods ------------------------------------------------------------

void NativeDealloc(NativeHandlerObject* self) {
  if (self->state != nullptr && self->type != nullptr) self->type->hooks.delete_state(self->state);
  self->state = nullptr;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

// _oh_native_init(type_capsule, config)
PyObject* NativeInit(NativeHandlerObject* self, PyObject* args) {
  PyObject* capsule;
  const char* config = "";
  if (!PyArg_ParseTuple(args, "O|s", &capsule, &config)) return nullptr;
  auto* rec = static_cast<TypeRecord*>(PyCapsule_GetPointer(capsule, "tf_ophandlers.type"));
  if (rec == nullptr) return nullptr;
  if (self->state != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "tf_ophandlers: native handler initialized twice");
    return nullptr;
  }
  TF_Status* s = TF_NewStatus();
  void* st = rec->hooks.create(rec->hooks.type_data, config, s);
  if (TF_GetCode(s) != TF_OK || st == nullptr) {
    if (TF_GetCode(s) == TF_OK) TF_SetStatus(s, TF_INTERNAL, "create returned NULL");
    std::string m = "tf_ophandlers: " + rec->name + "(" + config + ") could not be created: " +
                    TF_Message(s);
    TF_SetStatus(s, TF_GetCode(s), m.c_str());
    if (st != nullptr) rec->hooks.delete_state(st);
    RaiseStatus(s);
    TF_DeleteStatus(s);
    return nullptr;
  }
  TF_DeleteStatus(s);
  self->type = rec;
  self->state = st;
  Py_RETURN_NONE;
}

// _oh_execute(stack, next_stack, op, values) -> list of values (the Python path).
PyObject* NativeExecute(NativeHandlerObject* self, PyObject* args) {
  PyObject *stack, *next, *op_obj, *values;
  if (!PyArg_ParseTuple(args, "OOO!O", &stack, &next, &OpBaseType, &op_obj, &values))
    return nullptr;
  if (!CheckState(self) || g_state == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "tf_ophandlers: native_setup missing");
    return nullptr;
  }
  auto* opo = reinterpret_cast<OpObject*>(op_obj);
  const TFE_Op* src = OpAttrSource(opo);
  if (src == nullptr) return nullptr;
  PyObject* seq = PySequence_Fast(values, "values must be a sequence");
  if (seq == nullptr) return nullptr;
  PyObject* mode = PyObject_GetAttr(g_state, s_mode);
  PyObject* device = PyObject_GetAttr(g_state, s_device);
  if (mode == nullptr || device == nullptr) {
    Py_XDECREF(mode);
    Py_XDECREF(device);
    Py_DECREF(seq);
    return nullptr;
  }
  TFOH_Context ctx{stack, next, mode == Py_None, device};
  TFOH_Op op{src, op_obj, PyUnicode_AsUTF8(opo->type), PyUnicode_AsUTF8(opo->device),
             opo->num_outputs};
  absl::InlinedVector<TFOH_Tensor*, 4> ins, outs;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  for (Py_ssize_t i = 0; i < n; ++i) ins.push_back(TensorFromPy(PySequence_Fast_GET_ITEM(seq, i)));
  TF_Status* s = TF_NewStatus();
  PyObject* result = nullptr;
  if (RunExecute(self, &ctx, &op, ins, outs, nullptr, s)) {
    result = PyList_New(static_cast<Py_ssize_t>(outs.size()));
    for (size_t i = 0; result != nullptr && i < outs.size(); ++i) {
      PyObject* o = PyOf(outs[i]);
      if (o == nullptr) {
        Py_CLEAR(result);
        break;
      }
      PyList_SET_ITEM(result, i, o);
    }
  } else {
    RaiseStatus(s);
  }
  for (auto* t : ins) Unref(t);
  for (auto* t : outs) Unref(t);
  TF_DeleteStatus(s);
  Py_DECREF(mode);
  Py_DECREF(device);
  Py_DECREF(seq);
  return result;
}

// _oh_copy(kind, stack, next_stack, value[, device]) -> value: kind 0 copy_on, 1 copy_off.
PyObject* NativeCopy(NativeHandlerObject* self, PyObject* args) {
  int kind;
  PyObject *stack, *next, *value;
  const char* device = "";
  if (!PyArg_ParseTuple(args, "iOOO|s", &kind, &stack, &next, &value, &device)) return nullptr;
  if (!CheckState(self)) return nullptr;
  auto on = self->type->hooks.copy_on;
  auto off = self->type->hooks.copy_off;
  if ((kind == 0 && on == nullptr) || (kind == 1 && off == nullptr)) {
    Py_INCREF(value);
    return value;
  }
  PyObject* mode = PyObject_GetAttr(g_state, s_mode);
  PyObject* dev = PyObject_GetAttr(g_state, s_device);
  if (mode == nullptr || dev == nullptr) {
    Py_XDECREF(mode);
    Py_XDECREF(dev);
    return nullptr;
  }
  TFOH_Context ctx{stack, next, mode == Py_None, dev};
  TFOH_Tensor* in = TensorFromPy(value);
  TF_Status* s = TF_NewStatus();
  TFOH_Tensor* out = kind == 0 ? on(self->state, &ctx, in, s) : off(self->state, &ctx, in, device, s);
  PyObject* r = nullptr;
  if (TF_GetCode(s) != TF_OK || out == nullptr) {
    if (TF_GetCode(s) == TF_OK) TF_SetStatus(s, TF_INTERNAL, "returned NULL");
    Unref(out);
    PrefixStatus(self, kind == 0 ? "copy_on" : "copy_off", nullptr, s);
    RaiseStatus(s);
  } else {
    r = PyOf(out);
    Unref(out);
  }
  Unref(in);
  TF_DeleteStatus(s);
  Py_DECREF(mode);
  Py_DECREF(dev);
  return r;
}

// _oh_shape(value[, index]) -> rank, or axis length; None when the hook is missing.
PyObject* NativeShape(NativeHandlerObject* self, PyObject* args) {
  PyObject* value;
  int index = -1;
  if (!PyArg_ParseTuple(args, "O|i", &value, &index)) return nullptr;
  if (!CheckState(self)) return nullptr;
  if ((index < 0 && self->type->hooks.num_dims == nullptr) ||
      (index >= 0 && self->type->hooks.dim == nullptr)) {
    Py_RETURN_NONE;
  }
  TFOH_Tensor* in = TensorFromPy(value);
  TF_Status* s = TF_NewStatus();
  int64_t r = index < 0 ? self->type->hooks.num_dims(self->state, in, s)
                        : self->type->hooks.dim(self->state, in, index, s);
  Unref(in);
  PyObject* result = nullptr;
  if (TF_GetCode(s) != TF_OK) {
    PrefixStatus(self, index < 0 ? "num_dims" : "dim", nullptr, s);
    RaiseStatus(s);
  } else {
    result = PyLong_FromLongLong(r);
  }
  TF_DeleteStatus(s);
  return result;
}

// Calls a hook writing into a TF_Buffer; returns bytes, None when the hook is missing.
template <typename F>
PyObject* BufferCall(NativeHandlerObject* self, bool present, const char* hook, F call) {
  if (!present) Py_RETURN_NONE;
  TF_Buffer* b = TF_NewBuffer();
  TF_Status* s = TF_NewStatus();
  call(b, s);
  PyObject* r = nullptr;
  if (TF_GetCode(s) != TF_OK) {
    PrefixStatus(self, hook, nullptr, s);
    RaiseStatus(s);
  } else {
    r = PyBytes_FromStringAndSize(static_cast<const char*>(b->data),
                                  b->data ? static_cast<Py_ssize_t>(b->length) : 0);
  }
  TF_DeleteBuffer(b);
  TF_DeleteStatus(s);
  return r;
}

PyObject* NativeQuery(NativeHandlerObject* self, PyObject* args) {
  const char* key;
  if (!PyArg_ParseTuple(args, "s", &key)) return nullptr;
  if (!CheckState(self)) return nullptr;
  auto q = self->type->hooks.query;
  if (q == nullptr) {
    PyErr_Format(PyExc_ValueError, "tf_ophandlers: %s has no queries", DebugString(self).c_str());
    return nullptr;
  }
  return BufferCall(self, true, "query",
                    [&](TF_Buffer* b, TF_Status* s) { q(self->state, key, b, s); });
}

PyObject* NativeDebugString(NativeHandlerObject* self, PyObject*) {
  if (!CheckState(self)) return nullptr;
  return PyUnicode_FromString(DebugString(self).c_str());
}

// _oh_value_text(kind, value) -> bytes or None: kind 0 tensor_debug_string, 1 function
// input summary.
PyObject* NativeValueText(NativeHandlerObject* self, PyObject* args) {
  int kind;
  PyObject* value;
  if (!PyArg_ParseTuple(args, "iO", &kind, &value)) return nullptr;
  if (!CheckState(self)) return nullptr;
  auto tds = self->type->hooks.tensor_debug_string;
  auto fis = self->type->hooks.function_input_summary;
  TFOH_Tensor* in = TensorFromPy(value);
  PyObject* r = BufferCall(
      self, kind == 0 ? tds != nullptr : fis != nullptr,
      kind == 0 ? "tensor_debug_string" : "function_input_summary",
      [&](TF_Buffer* b, TF_Status* s) { (kind == 0 ? tds : fis)(self->state, in, b, s); });
  Unref(in);
  return r;
}

// _oh_static_value(value) -> EagerTensor, None (unknown) or NotImplemented (no hook).
PyObject* NativeStaticValue(NativeHandlerObject* self, PyObject* value) {
  if (!CheckState(self)) return nullptr;
  if (self->type->hooks.static_value == nullptr) Py_RETURN_NOTIMPLEMENTED;
  TFOH_Tensor* in = TensorFromPy(value);
  PyObject* r = CallStaticValueHook(self->type->hooks.static_value, self->state, in,
                                    ApiTensorDtype(in), DebugString(self));
  Unref(in);
  return r;
}

PyObject* NativeTypeName(NativeHandlerObject* self, void*) {
  if (self->type == nullptr) Py_RETURN_NONE;
  return PyUnicode_FromString(self->type->name.c_str());
}

PyMethodDef kNativeMethods[] = {
    {"_oh_native_init", reinterpret_cast<PyCFunction>(NativeInit), METH_VARARGS,
     "_oh_native_init(type_capsule, config='') creates the handler state."},
    {"_oh_execute", reinterpret_cast<PyCFunction>(NativeExecute), METH_VARARGS,
     "_oh_execute(stack, next_stack, op, values) -> values."},
    {"_oh_copy", reinterpret_cast<PyCFunction>(NativeCopy), METH_VARARGS,
     "_oh_copy(kind, stack, next_stack, value[, device]) -> value."},
    {"_oh_shape", reinterpret_cast<PyCFunction>(NativeShape), METH_VARARGS,
     "_oh_shape(value[, index]) -> int or None."},
    {"_oh_value_text", reinterpret_cast<PyCFunction>(NativeValueText), METH_VARARGS,
     "_oh_value_text(kind, value) -> bytes or None."},
    {"_oh_static_value", reinterpret_cast<PyCFunction>(NativeStaticValue), METH_O,
     "_oh_static_value(value) -> EagerTensor, None or NotImplemented."},
    {"query", reinterpret_cast<PyCFunction>(NativeQuery), METH_VARARGS,
     "query(key) -> bytes: a read-only request the handler defines."},
    {"_oh_debug_string", reinterpret_cast<PyCFunction>(NativeDebugString), METH_NOARGS, nullptr},
    {nullptr}};

PyGetSetDef kNativeGetSet[] = {
    {"native_type_name", reinterpret_cast<getter>(NativeTypeName), nullptr,
     "The handler type's registered name.", nullptr},
    {nullptr}};

// ---- module functions ---------------------------------------------------------------------

PyObject* PyNativeSetup(PyObject*, PyObject* args) {
  PyObject *state, *physical;
  if (!PyArg_ParseTuple(args, "OO", &state, &physical)) return nullptr;
  Py_INCREF(state);
  Py_INCREF(physical);
  Py_XSETREF(g_state, state);
  Py_XSETREF(g_physical, physical);
  s_mode = PyUnicode_InternFromString("mode");
  s_current = PyUnicode_InternFromString("current");
  s_handler = PyUnicode_InternFromString("handler");
  s_next = PyUnicode_InternFromString("next");
  s_device = PyUnicode_InternFromString("device");
  s_execute = PyUnicode_InternFromString("execute");
  Py_RETURN_NONE;
}

// load_handler_library(path) -> [(name, doc, type_capsule, {hook: present}), ...]
PyObject* PyLoadHandlerLibrary(PyObject*, PyObject* args) {
  const char* path;
  if (!PyArg_ParseTuple(args, "s", &path)) return nullptr;
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* e = dlerror();
    PyErr_Format(PyExc_OSError, "tf_ophandlers: cannot load handler library %s: %s", path,
                 e ? e : "unknown error");
    return nullptr;
  }
  auto init = reinterpret_cast<TFOH_InitHandlerLibraryFn>(
      dlsym(lib, TFOH_INIT_HANDLER_LIBRARY_SYMBOL));
  if (init == nullptr) {
    PyErr_Format(PyExc_OSError,
                 "tf_ophandlers: %s is not a handler library (it does not export %s)", path,
                 TFOH_INIT_HANDLER_LIBRARY_SYMBOL);
    return nullptr;  // the library stays loaded (like tf.load_op_library)
  }
  std::vector<void*> types;
  TFOH_Library library{&types};
  TF_Status* s = TF_NewStatus();
  init(&kApi, &library, s);
  if (TF_GetCode(s) != TF_OK) {
    PyErr_Format(PyExc_RuntimeError, "tf_ophandlers: handler library %s failed to load: %s",
                 path, TF_Message(s));
    TF_DeleteStatus(s);
    return nullptr;  // records already registered leak with the library (never unloaded)
  }
  TF_DeleteStatus(s);
  PyObject* out = PyList_New(0);
  for (void* f : types) {
    auto* rec = static_cast<TypeRecord*>(f);
    PyObject* cap = PyCapsule_New(rec, "tf_ophandlers.type", nullptr);
    const TFOH_HandlerType& k = rec->hooks;
    PyObject* hooks = Py_BuildValue(
        "{sOsOsOsOsOsOsOsOsO}", "copy_on", k.copy_on ? Py_True : Py_False, "copy_off",
        k.copy_off ? Py_True : Py_False, "num_dims", k.num_dims ? Py_True : Py_False, "dim",
        k.dim ? Py_True : Py_False, "debug_string", k.debug_string ? Py_True : Py_False,
        "tensor_debug_string", k.tensor_debug_string ? Py_True : Py_False, "query",
        k.query ? Py_True : Py_False, "function_input_summary",
        k.function_input_summary ? Py_True : Py_False, "static_value",
        k.static_value ? Py_True : Py_False);
    PyObject* item = cap && hooks ? Py_BuildValue("(ssNN)", rec->name.c_str(), rec->doc.c_str(),
                                                  cap, hooks)
                                  : nullptr;
    if (item == nullptr || PyList_Append(out, item) < 0) {
      Py_XDECREF(item);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(item);
  }
  return out;
}

}  // namespace

PyMethodDef kNativeModuleMethods[] = {
    {"native_setup", PyNativeSetup, METH_VARARGS,
     "native_setup(state, PHYSICAL): what the native execute path reads."},
    {"load_handler_library", PyLoadHandlerLibrary, METH_VARARGS,
     "load_handler_library(path) -> [(name, doc, type_capsule, {optional hook: present})]."},
    {nullptr}};

PyTypeObject NativeHandlerBaseType = {
    PyVarObject_HEAD_INIT(nullptr, 0) "tf_ophandlers._C.NativeHandlerBase", /* tp_name */
    sizeof(NativeHandlerObject),                                            /* tp_basicsize */
};

bool ReadyNativeTypes() {
  NativeHandlerBaseType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE;
  NativeHandlerBaseType.tp_doc = "Base of handlers from handler libraries (see cc/native.h).";
  NativeHandlerBaseType.tp_dealloc = reinterpret_cast<destructor>(NativeDealloc);
  NativeHandlerBaseType.tp_methods = kNativeMethods;
  NativeHandlerBaseType.tp_getset = kNativeGetSet;
  NativeHandlerBaseType.tp_new = PyType_GenericNew;
  return PyType_Ready(&NativeHandlerBaseType) >= 0;
}

bool HasNativeShapeHooks(PyObject* stack) {
  if (s_handler == nullptr || stack == g_physical) return false;
  PyObject* handler = PyObject_GetAttr(stack, s_handler);
  if (handler == nullptr) {
    PyErr_Clear();
    return false;
  }
  bool r = false;
  if (PyObject_TypeCheck(handler, &NativeHandlerBaseType)) {
    auto* self = reinterpret_cast<NativeHandlerObject*>(handler);
    r = self->type != nullptr &&
        (self->type->hooks.num_dims != nullptr || self->type->hooks.dim != nullptr);
  }
  Py_DECREF(handler);
  return r;
}

bool NativeStackRun(PyObject* stack, const TFE_Op* tfe_op, const char* type,
                    const char* device, int n_in, TFE_TensorHandle** in, int* num_outputs,
                    TFE_TensorHandle** outputs, TF_Status* status) {
  if (g_state == nullptr || IsCopyOrConst(type)) return false;
  TFOH_Op op{tfe_op, nullptr, type, device, -1};
  int n = *num_outputs;
  bool handled = NativeStackExecute(stack, &op, n_in, in, &n, outputs, status);
  if (handled && TF_GetCode(status) == TF_OK) *num_outputs = n;
  return handled;
}

}  // namespace tf_ophandlers
