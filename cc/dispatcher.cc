// tf-ophandlers: implementation of the dispatcher device. Contracts: dispatcher.h.
#define PY_SSIZE_T_CLEAN
#include "dispatcher.h"

#include <cstring>
#include <atomic>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "tensorflow/c/eager/abstract_op_attrs.h"
#include "tensorflow/c/eager/immediate_execution_operation.h"
#include "tensorflow/c/eager/tfe_op_internal.h"
#include "tensorflow/core/framework/attr_value.pb.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_def.pb.h"

// Private symbols of lib_pywrap_tensorflow_common.so (TF 2.21; the Python package checks
// the version before loading this module). Declared here because no public header
// declares EagerTensorFromHandle.
PyObject* EagerTensorFromHandle(TFE_TensorHandle* handle, const bool is_packed);
TFE_TensorHandle* EagerTensor_Handle(const PyObject* o);
bool EagerTensor_CheckExact(const PyObject* o);

namespace tf_ophandlers {
namespace {

// ---- process-wide state (all guarded by the GIL unless noted) -------------------------
TFE_Context* g_ctx = nullptr;
std::string g_device_name;
PyTypeObject* g_op_type = nullptr;     // the Python subclass tf_ophandlers.core.op.Op
PyObject* g_execute = nullptr;         // dispatch.execute(op, inputs) -> list
PyObject* g_copy_to = nullptr;         // dispatch.copy_to_device(tensor) -> tensor
PyObject* g_copy_from = nullptr;       // dispatch.copy_from_device(tensor, dev) -> tensor
PyObject* g_stash_error = nullptr;     // dispatch.stash_error(exc) -> (code, message)
PyObject* g_num_dims = nullptr;        // dispatch.num_dims(stack, value) -> int
PyObject* g_dim = nullptr;             // dispatch.dim(stack, value, i) -> int
PyObject* g_summarize = nullptr;       // dispatch.summarize(stack, value) -> str
PyObject* g_error_text = nullptr;      // dispatch.output_error(op, kind, detail) -> str

// Payloads released on a thread that does not hold the GIL are queued here and their
// Python references dropped by the next thread that holds it. Taking the GIL inside a
// deallocator could deadlock against a thread that holds the GIL while waiting for the
// executor that runs the deallocator.
std::mutex g_pending_mu;
std::vector<TFOH_Payload*> g_pending;  // guarded by g_pending_mu

// One reusable status per thread for hot paths (payload checks).
TF_Status* ThreadStatus() {
  thread_local TF_Status* s = TF_NewStatus();
  TF_SetStatus(s, TF_OK, "");
  return s;
}

// Op type and device strings are few and repeat on every op: intern them. GIL: held.
PyObject* InternedString(const char* text) {
  static std::unordered_map<std::string, PyObject*>* cache =
      new std::unordered_map<std::string, PyObject*>();
  auto it = cache->find(text);
  if (it != cache->end()) {
    Py_INCREF(it->second);
    return it->second;
  }
  PyObject* s = PyUnicode_FromString(text);
  if (s == nullptr) return nullptr;
  if (cache->size() < 100000) {
    Py_INCREF(s);
    (*cache)[text] = s;
  }
  return s;
}

// Set by an atexit hook (tf_ophandlers/__init__.py): from then on callbacks do not enter
// Python, which closes the window between the PythonAlive() check and taking the GIL.
std::atomic<bool> g_shutdown{false};

bool PythonAlive() {
  return !g_shutdown.load(std::memory_order_acquire) && Py_IsInitialized() &&
         !_Py_IsFinalizing();
}

// Raises unless init() registered the dispatcher. GIL: held.
bool RequireInit() {
  if (g_ctx == nullptr || g_op_type == nullptr) {
    PyErr_SetString(PyExc_RuntimeError,
                    "tf_ophandlers: the dispatcher is not initialized (import tf_ophandlers)");
    return false;
  }
  return true;
}

void FreePayloadWithGil(TFOH_Payload* p) {
  Py_XDECREF(reinterpret_cast<PyObject*>(p->stack));
  Py_XDECREF(reinterpret_cast<PyObject*>(p->value));
  delete p;
}

void DrainPending() {
  std::vector<TFOH_Payload*> todo;
  {
    std::lock_guard<std::mutex> l(g_pending_mu);
    if (g_pending.empty()) return;
    todo.swap(g_pending);
  }
  for (TFOH_Payload* p : todo) FreePayloadWithGil(p);
}

// Converts the current Python exception into `status`, stashing the exception object so
// the user later receives it unchanged. Clears the Python error. GIL: held.
void StatusFromPyErr(TF_Status* status) {
  PyObject *etype, *exc, *etb;
  PyErr_Fetch(&etype, &exc, &etb);
  PyErr_NormalizeException(&etype, &exc, &etb);
  if (exc != nullptr && etb != nullptr) PyException_SetTraceback(exc, etb);
  Py_XDECREF(etype);
  Py_XDECREF(etb);
  if (exc == nullptr) {
    TF_SetStatus(status, TF_UNKNOWN, "tf_ophandlers: handler failed without an exception");
    return;
  }
  PyObject* r = g_stash_error ? PyObject_CallOneArg(g_stash_error, exc) : nullptr;
  int code = TF_UNKNOWN;
  const char* msg = nullptr;
  if (r != nullptr && PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 2) {
    code = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(r, 0)));
    if (PyErr_Occurred() || code <= TF_OK || code > TF_UNAUTHENTICATED) {
      PyErr_Clear();
      code = TF_UNKNOWN;  // a failure must never be reported as OK
    }
    msg = PyUnicode_AsUTF8(PyTuple_GET_ITEM(r, 1));
  }
  if (msg == nullptr) {
    PyErr_Clear();
    PyObject* s = PyObject_Str(exc);
    const char* m = s ? PyUnicode_AsUTF8(s) : nullptr;
    if (m == nullptr) PyErr_Clear();
    TF_SetStatus(status, TF_UNKNOWN, m ? m : "tf_ophandlers: handler error");
    Py_XDECREF(s);
  } else {
    TF_SetStatus(status, static_cast<TF_Code>(code), msg);
  }
  Py_XDECREF(r);
  Py_DECREF(exc);
}

// Raises a Python exception from a bad status that came out of TFE_Execute. The
// conversion goes through TensorFlow's own status-to-exception function (patched by the
// package), so a stashed handler exception comes back as itself. GIL: held.
void RaiseFromStatus(TF_Status* status) {
  PyObject* core = PyImport_ImportModule("tf_ophandlers.core.errors");
  if (core != nullptr) {
    PyObject* r = PyObject_CallMethod(core, "raise_from_code", "is",
                                      static_cast<int>(TF_GetCode(status)),
                                      TF_Message(status));
    Py_XDECREF(r);  // always null: it raises
    Py_DECREF(core);
    if (PyErr_Occurred()) return;
  }
  PyErr_Format(PyExc_RuntimeError, "%s", TF_Message(status));
}

// ---- expected outputs from the OpDef -------------------------------------------------

// Fills `dtypes` with the flat output dtypes TensorFlow's OpDef implies for `op`, or
// returns false when they cannot be known (function call ops). GIL: not needed.
bool ExpectedOutputs(const TFE_Op* op, std::vector<TF_DataType>* dtypes) {
  const tensorflow::ImmediateExecutionOperation* iop = tensorflow::unwrap(op);
  const tensorflow::OpDef* def = iop->OpDef();
  if (def == nullptr) {
    // TensorFlow leaves OpDef() unset for some ops (those with list inputs: AddN,
    // ConcatV2, Pack, ...): ask the op registry. Not registered means a function call.
    if (!tensorflow::OpRegistry::Global()->LookUpOpDef(iop->Name(), &def).ok()) return false;
  }
  const tensorflow::AbstractOpAttrs* attrs = iop->GetOpAttrs();
  // Attributes TensorFlow inferred from the inputs (the T and N of AddN, ConcatV2, Pack,
  // ...) are not visible through the typed getters; read them from the full attr list.
  tensorflow::NameAttrList all;
  bool have_all = false;
  auto lookup = [&](const std::string& name) -> const tensorflow::AttrValue* {
    if (!have_all) {
      attrs->GetNameAttrList(&all);
      have_all = true;
    }
    auto it = all.attr().find(name);
    return it == all.attr().end() ? nullptr : &it->second;
  };
  for (const auto& arg : def->output_arg()) {
    int64_t n = 1;
    if (!arg.number_attr().empty() && !attrs->GetInt(arg.number_attr(), &n)) {
      const tensorflow::AttrValue* v = lookup(arg.number_attr());
      if (v == nullptr || v->value_case() != tensorflow::AttrValue::kI) return false;
      n = v->i();
    }
    if (arg.type() != tensorflow::DT_INVALID) {
      for (int64_t i = 0; i < n; ++i) dtypes->push_back(static_cast<TF_DataType>(arg.type()));
    } else if (!arg.type_attr().empty()) {
      tensorflow::DataType t;
      if (!attrs->GetType(arg.type_attr(), &t)) {
        const tensorflow::AttrValue* v = lookup(arg.type_attr());
        if (v == nullptr || v->value_case() != tensorflow::AttrValue::kType) return false;
        t = v->type();
      }
      for (int64_t i = 0; i < n; ++i) dtypes->push_back(static_cast<TF_DataType>(t));
    } else if (!arg.type_list_attr().empty()) {
      absl::InlinedVector<tensorflow::DataType, 4> list;
      if (!attrs->GetTypeList(arg.type_list_attr(), &list).ok()) {
        const tensorflow::AttrValue* v = lookup(arg.type_list_attr());
        if (v == nullptr) return false;
        list.clear();
        for (int t : v->list().type()) list.push_back(static_cast<tensorflow::DataType>(t));
      }
      for (auto t : list) dtypes->push_back(static_cast<TF_DataType>(t));
    } else {
      return false;
    }
  }
  return true;
}

// ---- tensor methods of handler tensors ----------------------------------------------

int PayloadNumDims(void* data, TF_Status* status) {
  auto* p = static_cast<TFOH_Payload*>(data);
  if (p->kind == TFOH_PAYLOAD_C) return p->c_methods->num_dims(p->c_value, status);
  if (p->shape_source != nullptr) return TFE_TensorHandleNumDims(p->shape_source, status);
  if (!PythonAlive()) {
    TF_SetStatus(status, TF_FAILED_PRECONDITION, "tf_ophandlers: interpreter is exiting");
    return -1;
  }
  PyGILState_STATE g = PyGILState_Ensure();
  int result = -1;
  PyObject* r = PyObject_CallFunctionObjArgs(g_num_dims, reinterpret_cast<PyObject*>(p->stack),
                                             reinterpret_cast<PyObject*>(p->value), nullptr);
  if (r == nullptr) {
    StatusFromPyErr(status);
  } else {
    result = static_cast<int>(PyLong_AsLong(r));
    if (PyErr_Occurred()) StatusFromPyErr(status);
    Py_DECREF(r);
  }
  PyGILState_Release(g);
  return result;
}

int64_t PayloadDim(void* data, int dim_index, TF_Status* status) {
  auto* p = static_cast<TFOH_Payload*>(data);
  if (p->kind == TFOH_PAYLOAD_C) return p->c_methods->dim(p->c_value, dim_index, status);
  if (p->shape_source != nullptr) return TFE_TensorHandleDim(p->shape_source, dim_index, status);
  if (!PythonAlive()) {
    TF_SetStatus(status, TF_FAILED_PRECONDITION, "tf_ophandlers: interpreter is exiting");
    return -1;
  }
  PyGILState_STATE g = PyGILState_Ensure();
  int64_t result = -1;
  PyObject* r = PyObject_CallFunction(g_dim, "OOi", reinterpret_cast<PyObject*>(p->stack),
                                      reinterpret_cast<PyObject*>(p->value), dim_index);
  if (r == nullptr) {
    StatusFromPyErr(status);
  } else {
    result = PyLong_AsLongLong(r);
    if (PyErr_Occurred()) StatusFromPyErr(status);
    Py_DECREF(r);
  }
  PyGILState_Release(g);
  return result;
}

void PayloadDeallocate(void* data) {
  auto* p = static_cast<TFOH_Payload*>(data);
  if (p->shape_source != nullptr) TFE_DeleteTensorHandle(p->shape_source);
  p->shape_source = nullptr;
  if (p->kind == TFOH_PAYLOAD_C) {
    if (p->c_methods && p->c_methods->release) p->c_methods->release(p->c_value);
    delete p;
    return;
  }
  if (!PythonAlive()) {
    // The interpreter is gone or going: Python objects must not be touched. The
    // references are leaked deliberately; the process is exiting.
    delete p;
    return;
  }
  if (PyGILState_Check()) {
    FreePayloadWithGil(p);
  } else if (PyGILState_GetThisThreadState() != nullptr) {
    // A Python thread that released the GIL around TFE_DeleteTensorHandle (as
    // EagerTensor's dealloc does so that destructors may call into Python): taking it
    // back here is what TensorFlow intends, and nothing waits on this thread.
    PyGILState_STATE g = PyGILState_Ensure();
    FreePayloadWithGil(p);
    PyGILState_Release(g);
  } else {
    // A TensorFlow executor thread: a Python thread may hold the GIL while waiting for
    // this executor, so never wait for the GIL here.
    std::lock_guard<std::mutex> l(g_pending_mu);
    g_pending.push_back(p);
  }
}

TF_Buffer* PayloadSummarize(void* data, TF_Status* status) {
  auto* p = static_cast<TFOH_Payload*>(data);
  if (p->kind != TFOH_PAYLOAD_PYTHON || !PythonAlive()) {
    TF_SetStatus(status, TF_UNIMPLEMENTED, "no summary");
    return nullptr;
  }
  PyGILState_STATE g = PyGILState_Ensure();
  TF_Buffer* buf = nullptr;
  PyObject* r = PyObject_CallFunctionObjArgs(g_summarize, reinterpret_cast<PyObject*>(p->stack),
                                             reinterpret_cast<PyObject*>(p->value), nullptr);
  Py_ssize_t len = 0;
  const char* s = r ? PyUnicode_AsUTF8AndSize(r, &len) : nullptr;
  if (s == nullptr) {
    StatusFromPyErr(status);
  } else {
    buf = TF_NewBufferFromString(s, static_cast<size_t>(len));
  }
  Py_XDECREF(r);
  PyGILState_Release(g);
  return buf;
}

// ---- device callbacks ------------------------------------------------------------------

OpObject* NewOpObject(const char* type, const char* device, int num_outputs) {
  auto* op = reinterpret_cast<OpObject*>(g_op_type->tp_alloc(g_op_type, 0));
  if (op == nullptr) return nullptr;
  op->borrowed = nullptr;
  op->owned = nullptr;
  op->type = InternedString(type);
  op->device = InternedString(device ? device : "");
  op->num_outputs = num_outputs;
  op->output_dtypes = nullptr;
  op->dict = nullptr;
  if (op->type == nullptr || op->device == nullptr) {
    Py_DECREF(op);
    return nullptr;
  }
  return op;
}

// Ends the borrow of `op`: an Op still referenced from Python copies the attributes it
// borrowed. GIL: held.
void EndBorrow(OpObject* op, TFE_Context* ctx) {
  if (op->borrowed == nullptr) return;
  if (Py_REFCNT(op) > 1 && op->owned == nullptr) {
    TF_Status* s = TF_NewStatus();
    TFE_Op* copy = TFE_NewOp(ctx, PyUnicode_AsUTF8(op->type), s);
    if (TF_GetCode(s) == TF_OK) {
      TFE_OpAddAttrs(copy, TFE_OpGetAttrs(op->borrowed));
      op->owned = copy;
    } else if (copy != nullptr) {
      TFE_DeleteOp(copy);
    }
    TF_DeleteStatus(s);
  }
  op->borrowed = nullptr;
}

// Checks what a Python handler returned for `op` and moves it into `outputs`.
// Returns false with `status` set on any mismatch. GIL: held.
bool TakeOutputs(OpObject* op, const TFE_Op* tfe_op, PyObject* result, int* num_outputs,
                 TFE_TensorHandle** outputs, TF_Status* status) {
  auto fail = [&](const char* kind, const std::string& detail) {
    PyObject* text = PyObject_CallFunction(g_error_text, "OssO", op, kind, detail.c_str(),
                                           PyList_Check(result) ? result : Py_None);
    const char* m = text ? PyUnicode_AsUTF8(text) : nullptr;
    if (m == nullptr) PyErr_Clear();
    TF_SetStatus(status, TF_INVALID_ARGUMENT, m ? m : detail.c_str());
    Py_XDECREF(text);
    return false;
  };
  // A tuple copy: handler code run below cannot resize it under us.
  PyObject* seq = PySequence_Tuple(result);
  if (seq == nullptr) {
    PyErr_Clear();
    return fail("type", "the dispatcher returned a non-sequence");
  }
  Py_ssize_t n = PyTuple_GET_SIZE(seq);
  std::vector<TF_DataType> expected;
  bool known = ExpectedOutputs(tfe_op, &expected);
  int want = known ? static_cast<int>(expected.size()) : *num_outputs;
  if (n != want || n > *num_outputs) {
    Py_DECREF(seq);
    return fail("count", "expected " + std::to_string(want) + " outputs, got " +
                             std::to_string(n));
  }
  PyObject** items = &PyTuple_GET_ITEM(seq, 0);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!EagerTensor_CheckExact(items[i])) {
      Py_DECREF(seq);
      return fail("type", "output " + std::to_string(i) + " is not a tensor");
    }
    TFE_TensorHandle* h = EagerTensor_Handle(items[i]);
    if (known && TFE_TensorHandleDataType(h) != expected[i]) {
      std::string detail = "output " + std::to_string(i) + ": expected dtype enum " +
                           std::to_string(expected[i]) + ", got dtype enum " +
                           std::to_string(TFE_TensorHandleDataType(h));
      Py_DECREF(seq);
      return fail("dtype", detail);
    }
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    outputs[i] = TFE_TensorHandleCopySharingTensor(EagerTensor_Handle(items[i]), status);
    if (TF_GetCode(status) != TF_OK) {
      for (Py_ssize_t j = 0; j < i; ++j) TFE_DeleteTensorHandle(outputs[j]);
      Py_DECREF(seq);
      return false;
    }
  }
  *num_outputs = static_cast<int>(n);
  Py_DECREF(seq);
  return true;
}

void DeviceExecute(const TFE_Op* tfe_op, int* num_outputs, TFE_TensorHandle** outputs,
                   TF_Status* status, void* device_info) {
  if (!PythonAlive()) {
    TF_SetStatus(status, TF_FAILED_PRECONDITION, "tf_ophandlers: interpreter is exiting");
    return;
  }
  PyGILState_STATE g = PyGILState_Ensure();
  DrainPending();
  TFE_Context* ctx = TFE_OpGetContext(tfe_op, status);
  const char* name = TFE_OpGetName(tfe_op, status);
  const char* dev = TFE_OpGetDevice(tfe_op, status);
  int n_in = TFE_OpGetFlatInputCount(tfe_op, status);
  OpObject* op = nullptr;
  PyObject* inputs = nullptr;
  PyObject* result = nullptr;
  if (TF_GetCode(status) != TF_OK) goto done;
  op = NewOpObject(name, dev, *num_outputs);
  if (op == nullptr) {
    StatusFromPyErr(status);
    goto done;
  }
  op->borrowed = tfe_op;
  inputs = PyList_New(n_in);
  if (inputs == nullptr) {
    StatusFromPyErr(status);
    goto done;
  }
  for (int i = 0; i < n_in; ++i) {
    TFE_TensorHandle* h = TFE_OpGetFlatInput(tfe_op, i, status);
    if (TF_GetCode(status) != TF_OK) goto done;
    TFE_TensorHandle* copy = TFE_TensorHandleCopySharingTensor(h, status);
    if (TF_GetCode(status) != TF_OK) goto done;
    PyObject* t = EagerTensorFromHandle(copy, false);  // owns `copy` on success
    if (t == nullptr) {
      TFE_DeleteTensorHandle(copy);
      StatusFromPyErr(status);
      goto done;
    }
    PyList_SET_ITEM(inputs, i, t);
  }
  result = PyObject_CallFunctionObjArgs(g_execute, reinterpret_cast<PyObject*>(op), inputs,
                                        nullptr);
  if (result == nullptr) {
    StatusFromPyErr(status);
    goto done;
  }
  TakeOutputs(op, tfe_op, result, num_outputs, outputs, status);
done:
  if (op != nullptr) {
    EndBorrow(op, ctx);
    Py_DECREF(op);
  }
  Py_XDECREF(inputs);
  Py_XDECREF(result);
  PyGILState_Release(g);
}

TFE_TensorHandle* ReturnSingle(PyObject* r, TF_DataType want_dtype, bool must_be_physical,
                               TF_Status* status) {
  if (r == nullptr) {
    StatusFromPyErr(status);
    return nullptr;
  }
  TFE_TensorHandle* out = nullptr;
  if (!EagerTensor_CheckExact(r)) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT, "tf_ophandlers: a copy hook returned a non-tensor");
  } else {
    TFE_TensorHandle* h = EagerTensor_Handle(r);
    if (TFE_TensorHandleDataType(h) != want_dtype) {
      TF_SetStatus(status, TF_INVALID_ARGUMENT,
                   "tf_ophandlers: a copy hook returned a tensor of the wrong dtype");
    } else if (must_be_physical && PayloadOf(h) != nullptr) {
      TF_SetStatus(status, TF_INVALID_ARGUMENT,
                   "tf_ophandlers: copy-off returned a tensor that is still on a handler");
    } else {
      out = TFE_TensorHandleCopySharingTensor(h, status);
    }
  }
  Py_DECREF(r);
  return out;
}

TFE_TensorHandle* DeviceCopyTo(TFE_Context* context, TFE_TensorHandle* tensor,
                               TF_Status* status, void* device_info) {
  if (!PythonAlive()) {
    TF_SetStatus(status, TF_FAILED_PRECONDITION, "tf_ophandlers: interpreter is exiting");
    return nullptr;
  }
  PyGILState_STATE g = PyGILState_Ensure();
  TFE_TensorHandle* out = nullptr;
  TFE_TensorHandle* copy = TFE_TensorHandleCopySharingTensor(tensor, status);
  if (TF_GetCode(status) == TF_OK) {
    PyObject* t = EagerTensorFromHandle(copy, false);
    if (t == nullptr) {
      TFE_DeleteTensorHandle(copy);
      StatusFromPyErr(status);
    } else {
      PyObject* r = PyObject_CallOneArg(g_copy_to, t);
      out = ReturnSingle(r, TFE_TensorHandleDataType(tensor), false, status);
      Py_DECREF(t);
    }
  }
  PyGILState_Release(g);
  return out;
}

TFE_TensorHandle* DeviceCopyFrom(TFE_Context* context, TFE_TensorHandle* tensor,
                                 const char* target_device_name, TF_Status* status,
                                 void* device_info) {
  if (!PythonAlive()) {
    TF_SetStatus(status, TF_FAILED_PRECONDITION, "tf_ophandlers: interpreter is exiting");
    return nullptr;
  }
  PyGILState_STATE g = PyGILState_Ensure();
  DrainPending();
  TFE_TensorHandle* out = nullptr;
  TFE_TensorHandle* copy = TFE_TensorHandleCopySharingTensor(tensor, status);
  if (TF_GetCode(status) == TF_OK) {
    PyObject* t = EagerTensorFromHandle(copy, false);
    if (t == nullptr) {
      TFE_DeleteTensorHandle(copy);
      StatusFromPyErr(status);
    } else {
      PyObject* r = PyObject_CallFunction(g_copy_from, "Os", t, target_device_name);
      out = ReturnSingle(r, TFE_TensorHandleDataType(tensor), true, status);
      Py_DECREF(t);
    }
  }
  PyGILState_Release(g);
  return out;
}

void DeviceDelete(void* device_info) {}

// ---- Python-visible functions ---------------------------------------------------------

extern PyTypeObject OpBaseType;  // defined below

PyObject* PyInit(PyObject* self, PyObject* args) {
  PyObject* capsule;
  const char* device_name;
  PyObject *op_type, *execute, *copy_to, *copy_from, *stash, *num_dims, *dim, *summarize, *err;
  if (!PyArg_ParseTuple(args, "OsOOOOOOOOO", &capsule, &device_name, &op_type, &execute,
                        &copy_to, &copy_from, &stash, &num_dims, &dim, &summarize, &err)) {
    return nullptr;
  }
  if (g_ctx != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "tf_ophandlers: dispatcher already registered");
    return nullptr;
  }
  auto* ctx = static_cast<TFE_Context*>(PyCapsule_GetPointer(capsule, nullptr));
  if (ctx == nullptr) return nullptr;
  if (!PyType_Check(op_type) ||
      !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(op_type), &OpBaseType)) {
    PyErr_SetString(PyExc_TypeError, "op_type must be a subclass of _C.OpBase");
    return nullptr;
  }
  for (PyObject* o : {op_type, execute, copy_to, copy_from, stash, num_dims, dim, summarize, err})
    Py_INCREF(o);
  g_op_type = reinterpret_cast<PyTypeObject*>(op_type);
  g_execute = execute;
  g_copy_to = copy_to;
  g_copy_from = copy_from;
  g_stash_error = stash;
  g_num_dims = num_dims;
  g_dim = dim;
  g_summarize = summarize;
  g_error_text = err;

  TFE_CustomDevice device;
  device.copy_tensor_to_device = &DeviceCopyTo;
  device.copy_tensor_from_device = &DeviceCopyFrom;
  device.execute = &DeviceExecute;
  device.delete_device = &DeviceDelete;
  TF_Status* s = TF_NewStatus();
  TFE_RegisterCustomDevice(ctx, device, device_name, nullptr, s);
  if (TF_GetCode(s) != TF_OK) {
    PyErr_Format(PyExc_RuntimeError, "tf_ophandlers: cannot register the dispatcher: %s",
                 TF_Message(s));
    TF_DeleteStatus(s);
    return nullptr;
  }
  TF_DeleteStatus(s);
  g_ctx = ctx;
  g_device_name = device_name;
  Py_RETURN_NONE;
}

PyObject* PyWrap(PyObject* self, PyObject* args) {
  if (!RequireInit()) return nullptr;
  PyObject *stack, *value;
  int dtype;
  if (!PyArg_ParseTuple(args, "OOi", &stack, &value, &dtype)) return nullptr;
  return WrapHandlerTensor(stack, value, static_cast<TF_DataType>(dtype));
}

PyObject* PyPayload(PyObject* self, PyObject* t) {
  if (!EagerTensor_CheckExact(t)) Py_RETURN_NONE;
  TFOH_Payload* p = PayloadOf(EagerTensor_Handle(t));
  if (p == nullptr || p->kind != TFOH_PAYLOAD_PYTHON) Py_RETURN_NONE;
  return PyTuple_Pack(2, reinterpret_cast<PyObject*>(p->stack),
                      reinterpret_cast<PyObject*>(p->value));
}

// tensor_key(t) -> int: the identity of the TensorFlow tensor behind an EagerTensor.
// TensorFlow hands a callback a new Python wrapper for the same tensor each time
// (TFE_TensorHandleCopySharingTensor returns the same, re-referenced handle), so tapes
// key tensors by handle, not by Python object. The key is stable while `t` (or any
// wrapper of its handle) is alive. Other objects get id(t). GIL: held; never fails.
PyObject* PyTensorKey(PyObject* self, PyObject* t) {
  if (EagerTensor_CheckExact(t)) return PyLong_FromVoidPtr(EagerTensor_Handle(t));
  return PyLong_FromVoidPtr(t);
}

PyObject* PyStackOf(PyObject* self, PyObject* t) {
  if (!EagerTensor_CheckExact(t)) Py_RETURN_NONE;
  TFOH_Payload* p = PayloadOf(EagerTensor_Handle(t));
  if (p == nullptr || p->kind != TFOH_PAYLOAD_PYTHON) Py_RETURN_NONE;
  PyObject* s = reinterpret_cast<PyObject*>(p->stack);
  Py_INCREF(s);
  return s;
}

PyObject* PyExecute(PyObject* self, PyObject* args) {
  if (!RequireInit()) return nullptr;
  PyObject *op, *inputs;
  const char* device;
  if (!PyArg_ParseTuple(args, "O!Os", g_op_type, &op, &inputs, &device)) return nullptr;
  return ExecuteOp(reinterpret_cast<OpObject*>(op), inputs, device);
}

PyObject* PyNewOp(PyObject* self, PyObject* args) {
  if (!RequireInit()) return nullptr;
  const char* type;
  PyObject* attrs;  // dict[str, bytes]: serialized AttrValue protos
  int num_outputs = -1;  // only used when there is no OpDef (a function call)
  if (!PyArg_ParseTuple(args, "sO!|i", &type, &PyDict_Type, &attrs, &num_outputs)) {
    return nullptr;
  }
  TF_Status* s = TF_NewStatus();
  TFE_Op* tfe = TFE_NewOp(g_ctx, type, s);
  if (TF_GetCode(s) != TF_OK) {
    PyErr_Format(PyExc_ValueError, "tf_ophandlers: cannot create op %s: %s", type, TF_Message(s));
    TF_DeleteStatus(s);
    return nullptr;
  }
  PyObject *key, *val;
  Py_ssize_t pos = 0;
  while (PyDict_Next(attrs, &pos, &key, &val)) {
    const char* k = PyUnicode_AsUTF8(key);
    char* buf;
    Py_ssize_t len;
    if (k == nullptr || PyBytes_AsStringAndSize(val, &buf, &len) < 0) {
      TFE_DeleteOp(tfe);
      TF_DeleteStatus(s);
      return nullptr;
    }
    TFE_OpSetAttrValueProto(tfe, k, buf, static_cast<size_t>(len), s);
    if (TF_GetCode(s) != TF_OK) {
      PyErr_Format(PyExc_ValueError, "tf_ophandlers: bad attr %s for op %s: %s", k, type,
                   TF_Message(s));
      TFE_DeleteOp(tfe);
      TF_DeleteStatus(s);
      return nullptr;
    }
  }
  TF_DeleteStatus(s);
  std::vector<TF_DataType> dtypes;
  int n = ExpectedOutputs(tfe, &dtypes) ? static_cast<int>(dtypes.size()) : num_outputs;
  OpObject* op = NewOpObject(type, "", n);
  if (op == nullptr) {
    TFE_DeleteOp(tfe);
    return nullptr;
  }
  op->owned = tfe;
  return reinterpret_cast<PyObject*>(op);
}

// unwrap_inputs(stack, inputs) -> (values, foreign): tensors on `stack` replaced by their
// representation; `foreign` lists the indices of the others (to be copied on).
PyObject* PyUnwrapInputs(PyObject* self, PyObject* args) {
  PyObject *stack, *inputs;
  if (!PyArg_ParseTuple(args, "OO", &stack, &inputs)) return nullptr;
  PyObject* seq = PySequence_Fast(inputs, "inputs must be a sequence");
  if (seq == nullptr) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  PyObject* values = PyList_New(n);
  PyObject* foreign = PyList_New(0);
  if (values == nullptr || foreign == nullptr) {
    Py_XDECREF(values);
    Py_XDECREF(foreign);
    Py_DECREF(seq);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = items[i];
    TFOH_Payload* p = EagerTensor_CheckExact(item) ? PayloadOf(EagerTensor_Handle(item)) : nullptr;
    if (p != nullptr && p->kind == TFOH_PAYLOAD_PYTHON &&
        reinterpret_cast<PyObject*>(p->stack) == stack) {
      item = reinterpret_cast<PyObject*>(p->value);
    } else {
      PyObject* idx = PyLong_FromSsize_t(i);
      if (idx == nullptr || PyList_Append(foreign, idx) < 0) {
        Py_XDECREF(idx);
        Py_DECREF(values);
        Py_DECREF(foreign);
        Py_DECREF(seq);
        return nullptr;
      }
      Py_DECREF(idx);
    }
    Py_INCREF(item);
    PyList_SET_ITEM(values, i, item);
  }
  Py_DECREF(seq);
  PyObject* r = PyTuple_Pack(2, values, foreign);
  Py_DECREF(values);
  Py_DECREF(foreign);
  return r;
}

// wrap_outputs(stack, values, transient, value_dtype) -> list of tensors on `stack`.
// A tensor value gives its own dtype; other representations ask `value_dtype(value)`.
// With `transient`, resource-dtype tensor values are returned as they are (RFC
// "Placement of resource handles").
PyObject* PyWrapOutputs(PyObject* self, PyObject* args) {
  PyObject *stack, *values, *value_dtype;
  int transient;
  if (!PyArg_ParseTuple(args, "OOpO", &stack, &values, &transient, &value_dtype))
    return nullptr;
  if (!RequireInit()) return nullptr;
  PyObject* seq = PySequence_Tuple(values);  // a copy: value_dtype hooks cannot resize it
  if (seq == nullptr) return nullptr;
  Py_ssize_t n = PyTuple_GET_SIZE(seq);
  PyObject** items = n ? &PyTuple_GET_ITEM(seq, 0) : nullptr;
  PyObject* out = PyList_New(n);
  if (out == nullptr) {
    Py_DECREF(seq);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* v = items[i];
    PyObject* t = nullptr;
    if (EagerTensor_CheckExact(v)) {
      TF_DataType dt = TFE_TensorHandleDataType(EagerTensor_Handle(v));
      if (transient && dt == TF_RESOURCE) {
        Py_INCREF(v);
        t = v;
      } else {
        t = WrapHandlerTensor(stack, v, dt);
      }
    } else {
      PyObject* d = PyObject_CallOneArg(value_dtype, v);
      PyObject* e = d ? PyObject_GetAttrString(d, "as_datatype_enum") : nullptr;
      Py_XDECREF(d);
      if (e != nullptr) {
        long dt = PyLong_AsLong(e);
        Py_DECREF(e);
        if (!PyErr_Occurred()) t = WrapHandlerTensor(stack, v, static_cast<TF_DataType>(dt));
      }
    }
    if (t == nullptr) {
      Py_DECREF(out);
      Py_DECREF(seq);
      return nullptr;
    }
    PyList_SET_ITEM(out, i, t);
  }
  Py_DECREF(seq);
  return out;
}

PyObject* PyShutdown(PyObject* self, PyObject* unused) {
  g_shutdown.store(true, std::memory_order_release);
  Py_RETURN_NONE;
}

PyObject* PyDrain(PyObject* self, PyObject* unused) {
  DrainPending();
  Py_RETURN_NONE;
}

PyObject* PyDeviceName(PyObject* self, PyObject* t) {
  if (!EagerTensor_CheckExact(t)) {
    PyErr_SetString(PyExc_TypeError, "expected an EagerTensor");
    return nullptr;
  }
  TF_Status* s = TF_NewStatus();
  const char* d = TFE_TensorHandleDeviceName(EagerTensor_Handle(t), s);
  PyObject* r = TF_GetCode(s) == TF_OK ? PyUnicode_FromString(d) : nullptr;
  if (r == nullptr && !PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, TF_Message(s));
  TF_DeleteStatus(s);
  return r;
}

// ---- Op type ----------------------------------------------------------------------------

void OpDealloc(OpObject* op) {
  PyObject_GC_UnTrack(op);
  if (op->owned) TFE_DeleteOp(op->owned);
  Py_CLEAR(op->type);
  Py_CLEAR(op->device);
  Py_CLEAR(op->output_dtypes);
  Py_CLEAR(op->dict);
  Py_TYPE(op)->tp_free(reinterpret_cast<PyObject*>(op));
}

int OpTraverse(OpObject* op, visitproc visit, void* arg) {
  Py_VISIT(op->dict);
  return 0;
}

int OpClear(OpObject* op) {
  Py_CLEAR(op->dict);
  return 0;
}

PyObject* OpGetType(OpObject* op, void*) {
  Py_INCREF(op->type);
  return op->type;
}
PyObject* OpGetDevice(OpObject* op, void*) {
  Py_INCREF(op->device);
  return op->device;
}
PyObject* OpGetNumOutputs(OpObject* op, void*) { return PyLong_FromLong(op->num_outputs); }

PyObject* OpGetOutputDtypes(OpObject* op, void*) {
  if (op->output_dtypes == nullptr) {
    const TFE_Op* src = OpAttrSource(op);
    if (src == nullptr) return nullptr;
    std::vector<TF_DataType> dtypes;
    if (!ExpectedOutputs(src, &dtypes)) {
      Py_INCREF(Py_None);
      op->output_dtypes = Py_None;
    } else {
      PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(dtypes.size()));
      if (t == nullptr) return nullptr;
      for (size_t i = 0; i < dtypes.size(); ++i) {
        PyObject* v = PyLong_FromLong(static_cast<long>(dtypes[i]));
        if (v == nullptr) {
          Py_DECREF(t);
          return nullptr;
        }
        PyTuple_SET_ITEM(t, i, v);
      }
      op->output_dtypes = t;
    }
  }
  Py_INCREF(op->output_dtypes);
  return op->output_dtypes;
}

PyObject* OpAttrsProto(OpObject* op, PyObject*) {
  const TFE_Op* src = OpAttrSource(op);
  if (src == nullptr) return nullptr;
  TF_Buffer* buf = TF_NewBuffer();
  TF_Status* s = TF_NewStatus();
  TFE_OpAttrsSerialize(TFE_OpGetAttrs(src), buf, s);
  PyObject* r = nullptr;
  if (TF_GetCode(s) == TF_OK) {
    r = PyBytes_FromStringAndSize(static_cast<const char*>(buf->data),
                                  static_cast<Py_ssize_t>(buf->length));
  } else {
    PyErr_SetString(PyExc_RuntimeError, TF_Message(s));
  }
  TF_DeleteStatus(s);
  TF_DeleteBuffer(buf);
  return r;
}

PyObject* OpIsBorrowed(OpObject* op, void*) { return PyBool_FromLong(op->borrowed != nullptr); }

PyGetSetDef kOpGetSet[] = {
    {"type", reinterpret_cast<getter>(OpGetType), nullptr, "The op type, e.g. 'AddV2'.", nullptr},
    {"requested_device", reinterpret_cast<getter>(OpGetDevice), nullptr,
     "The device TensorFlow recorded for the op ('' when none was requested).", nullptr},
    {"num_outputs", reinterpret_cast<getter>(OpGetNumOutputs), nullptr,
     "Number of flat outputs the op must produce.", nullptr},
    {"output_dtype_enums", reinterpret_cast<getter>(OpGetOutputDtypes), nullptr,
     "Expected output dtypes (TF_DataType enums) from the OpDef, or None.", nullptr},
    {"_borrowed", reinterpret_cast<getter>(OpIsBorrowed), nullptr, nullptr, nullptr},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, nullptr, nullptr},
    {nullptr}};

PyMethodDef kOpMethods[] = {
    {"_attrs_proto", reinterpret_cast<PyCFunction>(OpAttrsProto), METH_NOARGS,
     "Serialized NameAttrList of the op's attributes."},
    {nullptr}};

PyTypeObject OpBaseType = {
    PyVarObject_HEAD_INIT(nullptr, 0) "tf_ophandlers._C.OpBase", /* tp_name */
    sizeof(OpObject),                                              /* tp_basicsize */
};

PyMethodDef kModuleMethods[] = {
    {"init", PyInit, METH_VARARGS, "Registers the dispatcher device (once per process)."},
    {"wrap", PyWrap, METH_VARARGS, "wrap(stack, value, dtype_enum) -> handler tensor."},
    {"payload", PyPayload, METH_O, "payload(t) -> (stack, value) or None."},
    {"stack_of", PyStackOf, METH_O, "stack_of(t) -> stack or None."},
    {"tensor_key", PyTensorKey, METH_O,
     "tensor_key(t) -> int identity of t's TensorFlow handle (stable across wrappers)."},
    {"execute", PyExecute, METH_VARARGS, "execute(op, inputs, device) -> list of tensors."},
    {"new_op", PyNewOp, METH_VARARGS,
     "new_op(type, {attr: AttrValue bytes}[, num_outputs]) -> Op. num_outputs is used "
     "only for ops without an OpDef (function calls); it defaults to unknown (-1)."},
    {"unwrap_inputs", PyUnwrapInputs, METH_VARARGS,
     "unwrap_inputs(stack, inputs) -> (values, foreign_indices)."},
    {"wrap_outputs", PyWrapOutputs, METH_VARARGS,
     "wrap_outputs(stack, values, transient, value_dtype) -> tensors on stack."},
    {"shutdown", PyShutdown, METH_NOARGS,
     "Stops callbacks from entering Python (atexit; irreversible)."},
    {"drain", PyDrain, METH_NOARGS, "Frees payloads released off the GIL."},
    {"device_name", PyDeviceName, METH_O, "The TensorFlow device name of a tensor."},
    {nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_C",
                       "tf-ophandlers C++ boundary (see cc/dispatcher.h).", -1, kModuleMethods};

}  // namespace

const TFE_Op* OpAttrSource(OpObject* op) {
  if (op->borrowed) return op->borrowed;
  if (op->owned) return op->owned;
  PyErr_SetString(PyExc_RuntimeError, "tf_ophandlers: Op has no attributes");
  return nullptr;
}

TFOH_Payload* PayloadOf(TFE_TensorHandle* handle) {
  if (g_ctx == nullptr) return nullptr;
  TF_Status* s = ThreadStatus();
  const char* d = TFE_TensorHandleDeviceName(handle, s);
  TFOH_Payload* p = nullptr;
  if (TF_GetCode(s) == TF_OK && d != nullptr && g_device_name == d) {
    p = static_cast<TFOH_Payload*>(TFE_TensorHandleDevicePointer(handle, s));
    if (TF_GetCode(s) != TF_OK) p = nullptr;
  }
  return p;
}

PyObject* WrapHandlerTensor(PyObject* stack, PyObject* value, TF_DataType dtype) {
  if (g_ctx == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "tf_ophandlers: dispatcher not initialized");
    return nullptr;
  }
  DrainPending();
  auto* p = new TFOH_Payload();
  p->kind = TFOH_PAYLOAD_PYTHON;
  Py_INCREF(stack);
  Py_INCREF(value);
  p->stack = stack;
  p->value = value;
  p->shape_source = nullptr;
  p->c_value = nullptr;
  p->c_methods = nullptr;
  TF_Status* s = TF_NewStatus();
  if (EagerTensor_CheckExact(value)) {
    p->shape_source = TFE_TensorHandleCopySharingTensor(EagerTensor_Handle(value), s);
    if (TF_GetCode(s) != TF_OK) p->shape_source = nullptr;
    TF_SetStatus(s, TF_OK, "");
  }
  TFE_CustomDeviceTensorHandle methods;
  methods.num_dims = &PayloadNumDims;
  methods.dim = &PayloadDim;
  methods.deallocator = &PayloadDeallocate;
  methods.summarize = &PayloadSummarize;
  // Takes ownership of `p` even on failure (calls the deallocator).
  TFE_TensorHandle* h =
      TFE_NewCustomDeviceTensorHandle(g_ctx, g_device_name.c_str(), dtype, p, methods, s);
  if (TF_GetCode(s) != TF_OK) {
    PyErr_Format(PyExc_RuntimeError, "tf_ophandlers: cannot create handler tensor: %s",
                 TF_Message(s));
    TF_DeleteStatus(s);
    return nullptr;
  }
  TF_DeleteStatus(s);
  PyObject* t = EagerTensorFromHandle(h, false);
  if (t == nullptr) TFE_DeleteTensorHandle(h);  // frees the payload through its deallocator
  return t;
}

PyObject* ExecuteOp(OpObject* op, PyObject* inputs, const char* device) {
  const TFE_Op* src = OpAttrSource(op);
  if (src == nullptr) return nullptr;
  if (!RequireInit()) return nullptr;
  PyObject* seq = PySequence_Tuple(inputs);  // a copy: copy-off hooks cannot resize it
  if (seq == nullptr) return nullptr;
  Py_ssize_t n_in = PyTuple_GET_SIZE(seq);
  PyObject** items = n_in ? &PyTuple_GET_ITEM(seq, 0) : nullptr;
  TF_Status* s = TF_NewStatus();
  const char* type = PyUnicode_AsUTF8(op->type);
  // Reuse this thread's TFE_Op (as TensorFlow's own Python fast path does): TFE_OpReset
  // keeps the allocation and skips re-parsing an unchanged device name. A nested
  // ExecuteOp on the same thread (a copy-off hook) takes the op out of the cache first.
  thread_local TFE_Op* cached_op = nullptr;
  TFE_Op* tfe = cached_op;
  cached_op = nullptr;
  if (tfe != nullptr) {
    TFE_OpReset(tfe, type, device, s);
    if (TF_GetCode(s) != TF_OK) {
      TFE_DeleteOp(tfe);
      tfe = nullptr;
    }
  }
  if (tfe == nullptr) {
    TF_SetStatus(s, TF_OK, "");
    tfe = TFE_NewOp(g_ctx, type, s);
  }
  PyObject* result = nullptr;
  int num = op->num_outputs;
  absl::InlinedVector<TFE_TensorHandle*, 4> rets;
  absl::InlinedVector<PyObject*, 2> keep;  // copied-off inputs, owned
  if (TF_GetCode(s) != TF_OK) goto fail;
  TFE_OpAddAttrs(tfe, TFE_OpGetAttrs(src));
  for (Py_ssize_t i = 0; i < n_in; ++i) {
    if (!EagerTensor_CheckExact(items[i])) {
      PyErr_Format(PyExc_TypeError, "tf_ophandlers: input %zd of %s is not an eager tensor", i,
                   type);
      goto cleanup;
    }
    TFE_TensorHandle* h = EagerTensor_Handle(items[i]);
    if (PayloadOf(h) != nullptr) {
      // A handler tensor reaching a physical device: copy it off its stack (RFC: CopyOn
      // on a physical device is the CopyOff of the tensor's own stack).
      PyObject* off = PyObject_CallFunction(g_copy_from, "Os", items[i], device);
      if (off == nullptr) goto cleanup;
      if (!EagerTensor_CheckExact(off) || PayloadOf(EagerTensor_Handle(off)) != nullptr) {
        Py_DECREF(off);
        PyErr_Format(PyExc_TypeError, "tf_ophandlers: copy-off for input %zd of %s did not "
                     "return a physical tensor", i, type);
        goto cleanup;
      }
      keep.push_back(off);
      h = EagerTensor_Handle(off);
    }
    TFE_OpAddInput(tfe, h, s);
    if (TF_GetCode(s) != TF_OK) goto fail;
  }
  TFE_OpSetDevice(tfe, device, s);
  if (TF_GetCode(s) != TF_OK) goto fail;
  if (num < 0) {
    PyErr_Format(PyExc_ValueError, "tf_ophandlers: unknown output count for %s", type);
    goto cleanup;
  }
  rets.resize(num > 0 ? num : 1);
  Py_BEGIN_ALLOW_THREADS;
  TFE_Execute(tfe, rets.data(), &num, s);
  Py_END_ALLOW_THREADS;
  if (TF_GetCode(s) != TF_OK) goto fail;
  result = PyList_New(num);
  for (int i = 0; i < num; ++i) {
    PyObject* t = result ? EagerTensorFromHandle(rets[i], false) : nullptr;
    if (t == nullptr) {
      for (int j = i; j < num; ++j) TFE_DeleteTensorHandle(rets[j]);
      Py_CLEAR(result);
      break;
    }
    PyList_SET_ITEM(result, i, t);
  }
  goto cleanup;
fail:
  RaiseFromStatus(s);
cleanup:
  for (PyObject* o : keep) Py_DECREF(o);
  if (tfe) {
    if (cached_op == nullptr && TF_GetCode(s) == TF_OK) {
      cached_op = tfe;  // inputs and attrs are cleared by the next TFE_OpReset
    } else {
      TFE_DeleteOp(tfe);
    }
  }
  TF_DeleteStatus(s);
  Py_DECREF(seq);
  return result;
}

}  // namespace tf_ophandlers

PyMODINIT_FUNC PyInit__C(void) {
  using namespace tf_ophandlers;
  OpBaseType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC;
  OpBaseType.tp_doc = "Base of tf_ophandlers.Op (see cc/dispatcher.h).";
  OpBaseType.tp_dealloc = reinterpret_cast<destructor>(OpDealloc);
  OpBaseType.tp_traverse = reinterpret_cast<traverseproc>(OpTraverse);
  OpBaseType.tp_clear = reinterpret_cast<inquiry>(OpClear);
  OpBaseType.tp_getset = kOpGetSet;
  OpBaseType.tp_methods = kOpMethods;
  OpBaseType.tp_dictoffset = offsetof(OpObject, dict);
  if (PyType_Ready(&OpBaseType) < 0) return nullptr;
  PyObject* m = PyModule_Create(&kModule);
  if (m == nullptr) return nullptr;
  Py_INCREF(&OpBaseType);
  PyModule_AddObject(m, "OpBase", reinterpret_cast<PyObject*>(&OpBaseType));
  return m;
}
