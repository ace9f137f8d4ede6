// tf-ophandlers: the dispatcher device's callbacks and the validation of what handlers
// return. Contracts: device.h.
#define PY_SSIZE_T_CLEAN
#include "boundary/device.h"

#include <string>
#include <vector>

#include "fast/fast_path.h"
#include "boundary/handler_tensor.h"
#include "native/native.h"
#include "boundary/op.h"
#include "boundary/owners.h"
#include "boundary/runtime.h"
#include "boundary/status.h"
#include "tensorflow/c/eager/tfe_tensorhandle_internal.h"
#include "tensorflow/core/common_runtime/eager/custom_device.h"

namespace tf_ophandlers {
namespace {

// A new EagerTensor sharing `h`'s buffer (it owns its own handle), for passing a
// tensor TensorFlow lends a callback to Python. Returns null with `status` set on
// failure. GIL: must be held.
PyObject* EagerTensorSharing(TFE_TensorHandle* h, TF_Status* status) {
  TFE_TensorHandle* copy = TFE_TensorHandleCopySharingTensor(h, status);
  if (TF_GetCode(status) != TF_OK) return nullptr;
  PyObject* t = EagerTensorFromHandle(copy, false);  // owns `copy` on success
  if (t == nullptr) {
    TFE_DeleteTensorHandle(copy);
    StatusFromPyErr(status);
  }
  return t;
}

}  // namespace

// The op of the innermost execute callback running on this thread (see CurrentOpType).
thread_local OpObject* t_current_op = nullptr;

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
  // Only a list or tuple: iterating anything else (a tensor's rows, a generator that
  // would run handler code now) could pass the checks below with wrong outputs.
  if (!PyList_Check(result) && !PyTuple_Check(result)) {
    return fail("type", std::string("the dispatcher returned a ") + Py_TYPE(result)->tp_name +
                            ", not a list of tensors");
  }
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

OpObject* SwapCurrentOp(OpObject* op) {
  OpObject* outer = t_current_op;
  t_current_op = op;
  return outer;
}

namespace {

// DeviceExecute with the GIL held and no Python exception pending: the op's stacks run
// it (the fast path, else the Python one). Whatever it made is released before it
// returns.
void RunOnStacks(const TFE_Op* tfe_op, int* num_outputs, TFE_TensorHandle** outputs,
                 TF_Status* status) {
  TFE_Context* ctx = TFE_OpGetContext(tfe_op, status);
  const char* name = TFE_OpGetName(tfe_op, status);
  const char* dev = TFE_OpGetDevice(tfe_op, status);
  int n_in = TFE_OpGetFlatInputCount(tfe_op, status);
  // Released in the reverse order of these declarations: the Op first (EndBorrow), then
  // the inputs, then the hook's result.
  PyRef result;
  PyRef inputs;
  OpRef op;
  if (TF_GetCode(status) != TF_OK) return;
  // Stacks that need no Python for this op (pass-through levels, C/C++ handlers) run it
  // in C (fast_path.h); every other op takes the Python path below.
  if (TryFastExecute(tfe_op, name, dev, n_in, num_outputs, outputs, status)) return;
  op.reset(NewOpObject(name, dev, *num_outputs), ctx);
  if (!op) {
    StatusFromPyErr(status);
    return;
  }
  op.get()->borrowed = tfe_op;
  inputs.reset(PyList_New(n_in));
  if (!inputs) {
    StatusFromPyErr(status);
    return;
  }
  for (int i = 0; i < n_in; ++i) {
    TFE_TensorHandle* h = TFE_OpGetFlatInput(tfe_op, i, status);
    if (TF_GetCode(status) != TF_OK) return;
    PyObject* t = EagerTensorSharing(h, status);
    if (t == nullptr) return;
    PyList_SET_ITEM(inputs.get(), i, t);
  }
  {
    OpObject* outer = t_current_op;
    t_current_op = op.get();
    result.reset(PyObject_CallFunctionObjArgs(g_execute, op.object(), inputs.get(), nullptr));
    t_current_op = outer;
  }
  if (!result) {
    StatusFromPyErr(status);
    return;
  }
  TakeOutputs(op.get(), tfe_op, result.get(), num_outputs, outputs, status);
}

void DeviceExecute(const TFE_Op* tfe_op, int* num_outputs, TFE_TensorHandle** outputs,
                   TF_Status* status, void* device_info) {
  if (!PythonAlive()) {
    TF_SetStatus(status, TF_FAILED_PRECONDITION, "tf_ophandlers: interpreter is exiting");
    return;
  }
  // A C/C++ handler directly over PHYSICAL runs without the GIL until its outputs are
  // wrapped (native.h).
  if (NativeNoGilExecute(tfe_op, num_outputs, outputs, status)) return;
  PyGILState_STATE g = PyGILState_Ensure();
  // TensorFlow's fast path can call TFE_Execute with a Python exception pending (an int
  // attribute past int64: PyLong_AsLongLong's OverflowError, unchecked there); it raises
  // that exception, not the op's status, after the op. The handlers' Python would clear
  // it (a silent wrong result) and a deferring handler would keep the op with a wrapped
  // attribute: the op fails here unrun, and TensorFlow raises the pending exception.
  // (TensorFlow's slow path, TFE_Py_Execute, raises this status instead: the message
  // names the pending exception.)
  if (PyErr_Occurred()) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject* text = value != nullptr ? PyObject_Str(value) : nullptr;
    const char* utf8 = text != nullptr ? PyUnicode_AsUTF8(text) : nullptr;
    if (utf8 == nullptr) PyErr_Clear();
    std::string message = std::string("tf_ophandlers: an op called with a Python exception "
                                      "pending (its attributes did not convert): ") +
                          reinterpret_cast<PyTypeObject*>(type)->tp_name + ": " +
                          (utf8 != nullptr ? utf8 : "?");
    Py_XDECREF(text);
    PyErr_Restore(type, value, tb);
    TF_SetStatus(status, TF_INVALID_ARGUMENT, message.c_str());
    PyGILState_Release(g);
    return;
  }
  DrainPending();
  RunOnStacks(tfe_op, num_outputs, outputs, status);
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
  PyObject* t = EagerTensorSharing(tensor, status);
  if (t != nullptr) {
    PyObject* r = PyObject_CallOneArg(g_copy_to, t);
    out = ReturnSingle(r, TFE_TensorHandleDataType(tensor), false, status);
    Py_DECREF(t);
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
  PyObject* t = EagerTensorSharing(tensor, status);
  if (t != nullptr) {
    PyObject* r = PyObject_CallFunction(g_copy_from, "Os", t, target_device_name);
    out = ReturnSingle(r, TFE_TensorHandleDataType(tensor), true, status);
    Py_DECREF(t);
  }
  PyGILState_Release(g);
  return out;
}

void DeviceDelete(void* device_info) {}

// TensorFlow asks a custom device whether an op with an input on it runs there
// (CustomDeviceOpHandler::MaybePinToCustomDevice). Without this callback TensorFlow builds
// an Unimplemented status with a message on every op and then applies its default rule;
// building and freeing that status costs time on every op. This callback
// answers what the default rule decides, so placement is unchanged:
// - the op's first resource input decides: on a custom device (necessarily this one:
//   TensorFlow has already rejected inputs on two custom devices) pins the op here; a
//   physical one leaves the op where its requested device name puts it;
// - without resource inputs, an op with no requested device runs here;
// - an op whose requested device is this device runs here either way (TensorFlow has
//   already found it by name).
// Returning false keeps the device TensorFlow found by name (none, or another custom
// device). Called on any thread, without the GIL; touches no Python object. TensorFlow
// ignores `s`.
bool DeviceShallPin(const TFE_Op* op, TF_Status* s) {
  const char* requested = TFE_OpGetDevice(op, s);
  if (TF_GetCode(s) != TF_OK || requested == nullptr) requested = "";
  const bool by_name = requested[0] != '\0' && g_device_name == requested;
  const int n = TFE_OpGetFlatInputCount(op, s);
  for (int i = 0; i < n && TF_GetCode(s) == TF_OK; ++i) {
    TFE_TensorHandle* h = TFE_OpGetFlatInput(op, i, s);
    if (TF_GetCode(s) != TF_OK || h == nullptr) break;
    if (TFE_TensorHandleDataType(h) == TF_RESOURCE) return by_name || PayloadOf(h) != nullptr;
  }
  return by_name || requested[0] == '\0';
}

}  // namespace

bool ExecuteOnDispatcherHeld(TFE_Op* op, int* num_outputs, TFE_TensorHandle** outputs,
                             TF_Status* status) {
  if (!PythonAlive() || NativeNoGilMayRun() || PyErr_Occurred()) return false;
  TF_Status* s = ThreadStatus();
  const char* device = TFE_OpGetDevice(op, s);
  const int n = TFE_OpGetFlatInputCount(op, s);
  bool ok = TF_GetCode(s) == TF_OK && device != nullptr && g_device_name == device;
  for (int i = 0; ok && i < n; ++i) {
    TFE_TensorHandle* h = TFE_OpGetFlatInput(op, i, s);
    ok = TF_GetCode(s) == TF_OK && h != nullptr && TFE_TensorHandleDataType(h) != TF_RESOURCE &&
         (!tensorflow::CustomDeviceTensorHandle::classof(tensorflow::unwrap(h)) ||
          PayloadOf(h) != nullptr);
  }
  if (!ok) {
    TF_SetStatus(s, TF_OK, "");
    return false;
  }
  // As DeviceExecute once it holds the GIL.
  DrainPending();
  RunOnStacks(op, num_outputs, outputs, status);
  return true;
}

void RegisterDispatcherDevice(TFE_Context* ctx, const char* device_name, TF_Status* status) {
  TFE_CustomDevice device;
  device.copy_tensor_to_device = &DeviceCopyTo;
  device.copy_tensor_from_device = &DeviceCopyFrom;
  device.execute = &DeviceExecute;
  device.delete_device = &DeviceDelete;
  device.shall_pin_to_this_device = &DeviceShallPin;
  TFE_RegisterCustomDevice(ctx, device, device_name, nullptr, status);
}

PyObject* CurrentOpType() { return t_current_op != nullptr ? t_current_op->type : nullptr; }

}  // namespace tf_ophandlers
