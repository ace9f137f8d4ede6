// tf-ophandlers: the `_C` module: init and the functions tf_ophandlers.core calls.
// Each function's contract is in its docstring (kModuleMethods) and the comment above it;
// all run with the GIL held and report errors as Python exceptions.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "boundary/device.h"
#include "fast/fast_path.h"
#include "boundary/handler_tensor.h"
#include "native/native.h"
#include "native/native_internal.h"  // _C.NativeValue (ABI 3 handler data)
#include "boundary/op.h"
#include "boundary/runtime.h"
#include "boundary/status.h"
#include "tensorflow/c/eager/tfe_tensorhandle_internal.h"
#include "tensorflow/core/framework/types.pb.h"

// TensorFlow's cache of the handles of Python scalars (pywrap_tensor_conversion.h, a
// private symbol of lib_pywrap_tensorflow_common.so; its header needs headers the wheel
// lacks). Only the two members called here are declared. Lookup returns a borrowed
// handle or null. GIL: held.
namespace tensorflow {
struct TFE_TensorHandleCache {
  static TFE_TensorHandleCache* Get();
  TFE_TensorHandle* Lookup(PyObject* value, tensorflow::DataType dtype, TFE_Context* ctx,
                           std::string_view device_name) const;
};
}  // namespace tensorflow

namespace tf_ophandlers {
namespace {

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

  TF_Status* s = TF_NewStatus();
  RegisterDispatcherDevice(ctx, device_name, s);
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

// context_changed(capsule): TensorFlow's eager context was replaced
// (context._reset_context) and the runtime starts in the new one: registers the
// dispatcher device there and runs ops there from now on (g_ctx). TFE_Ops of the old
// context are not reused (ResetOrNewOp, ForgetPooledOps). The caller keeps the old
// context alive during the call.
PyObject* PyContextChanged(PyObject* self, PyObject* capsule) {
  if (!RequireInit()) return nullptr;
  auto* ctx = static_cast<TFE_Context*>(PyCapsule_GetPointer(capsule, nullptr));
  if (ctx == nullptr) return nullptr;
  if (ctx == g_ctx) Py_RETURN_NONE;
  TF_Status* s = TF_NewStatus();
  RegisterDispatcherDevice(ctx, g_device_name.c_str(), s);
  if (TF_GetCode(s) != TF_OK) {
    PyErr_Format(PyExc_RuntimeError,
                 "tf_ophandlers: cannot register the dispatcher in the new eager context: %s",
                 TF_Message(s));
    TF_DeleteStatus(s);
    return nullptr;
  }
  TF_DeleteStatus(s);
  ForgetPooledOps(g_ctx);
  g_ctx = ctx;
  Py_RETURN_NONE;
}

// Reads a dtype enum a handler's `value_dtype` gave (`enum_obj`, borrowed). Returns true
// with `*dtype` set, or false with a HandlerOutputError naming the handler of `stack`, the
// hook and the op (`op_type`, borrowed, may be null). GIL: held.
bool DtypeFromHook(PyObject* stack, PyObject* enum_obj, PyObject* op_type, const char* what,
                   TF_DataType* dtype) {
  int overflow = 0;
  long v = PyLong_Check(enum_obj) ? PyLong_AsLongAndOverflow(enum_obj, &overflow) : -1;
  if (PyErr_Occurred()) return false;
  if (overflow != 0 || !ValidDataType(v)) {
    SetHookOutputError(stack, "value_dtype", op_type,
                       std::string("a dtype with enum ") + SafeRepr(enum_obj) + " for " + what +
                           ", which is not a TensorFlow dtype");
    return false;
  }
  *dtype = static_cast<TF_DataType>(v);
  return true;
}

// wrap(stack, value, dtype_enum) -> a handler tensor on `stack` for `value`. The dtype
// comes from the handler's value_dtype: an invalid one is a HandlerOutputError.
PyObject* PyWrap(PyObject* self, PyObject* args) {
  if (!RequireInit()) return nullptr;
  PyObject *stack, *value, *dtype_obj;
  if (!PyArg_ParseTuple(args, "OOO", &stack, &value, &dtype_obj)) return nullptr;
  TF_DataType dtype;
  if (!DtypeFromHook(stack, dtype_obj, CurrentOpType(), "a tensor it wraps", &dtype)) {
    return nullptr;
  }
  return WrapHandlerTensor(stack, value, dtype, nullptr, !HasNativeShapeHooks(stack));
}

PyObject* PyPayload(PyObject* self, PyObject* t) {
  if (!EagerTensor_CheckExact(t)) Py_RETURN_NONE;
  TFOH_Payload* p = PayloadOf(EagerTensor_Handle(t));
  if (p == nullptr || p->kind != TFOH_PAYLOAD_PYTHON) Py_RETURN_NONE;
  PyObject* value = PayloadValue(p);  // borrowed
  if (value == nullptr) return nullptr;
  return PyTuple_Pack(2, reinterpret_cast<PyObject*>(p->stack), value);
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

// The TFE_TensorHandle* slot of EagerTensor `t`, or null. TensorFlow's struct
// (python/eager/pywrap_tensor.cc) is PyObject_HEAD, 64 bytes for the parent class, then
// the handle; no header declares it, so the slot is used only after checking that it
// holds the handle EagerTensor_Handle returns: another layout refuses, never writes.
// Handler tensors (a payload) are refused too. GIL: held.
TFE_TensorHandle** PhysicalHandleSlot(PyObject* t) {
  constexpr size_t kOffset = sizeof(PyObject) + 64;
  if (!EagerTensor_CheckExact(t) ||
      static_cast<size_t>(Py_TYPE(t)->tp_basicsize) < kOffset + sizeof(void*)) {
    return nullptr;
  }
  auto** slot = reinterpret_cast<TFE_TensorHandle**>(reinterpret_cast<char*>(t) + kOffset);
  TFE_TensorHandle* h = EagerTensor_Handle(t);
  if (*slot != h || h == nullptr || PayloadOf(h) != nullptr) return nullptr;
  return slot;
}

// handle_shared(t): whether physical EagerTensor `t`'s TensorHandle is referenced by
// something else too: another EagerTensor wrapping it, or TensorFlow's cache of Python
// scalars, which hands equal scalars (two tf.constant(3.0)) one handle. False for
// anything else. GIL: held; never fails.
PyObject* PyHandleShared(PyObject* self, PyObject* t) {
  if (PhysicalHandleSlot(t) == nullptr) Py_RETURN_FALSE;
  return PyBool_FromLong(!tensorflow::unwrap(EagerTensor_Handle(t))->RefCountIsOne());
}

// scalar_cached(t, value, dtype_enum, device_name): whether TensorFlow's cache of Python
// scalars (ConvertToEagerTensor's TFE_TensorHandleCache) maps (`value`, the dtype
// requested, the eager context, `device_name`) to t's handle, i.e. `t` is a
// tf.constant(value) created under that device scope and shares its handle with every
// equal one. The requested dtype is DT_INVALID (0) when none was given. False for
// anything but a physical EagerTensor. Raises if the runtime is not initialized.
// GIL: held.
PyObject* PyScalarCached(PyObject* self, PyObject* args) {
  PyObject *t, *value;
  int dtype;
  const char* device_name;
  if (!PyArg_ParseTuple(args, "OOis", &t, &value, &dtype, &device_name)) return nullptr;
  if (!RequireInit()) return nullptr;
  if (PhysicalHandleSlot(t) == nullptr) Py_RETURN_FALSE;
  TFE_TensorHandle* h = EagerTensor_Handle(t);
  TFE_TensorHandle* cached = tensorflow::TFE_TensorHandleCache::Get()->Lookup(
      value, static_cast<tensorflow::DataType>(dtype), g_ctx, device_name);
  if (PyErr_Occurred()) return nullptr;  // (the value's comparison raised)
  return PyBool_FromLong(cached == h);
}

// swap_handles(a, b): exchanges the TensorHandles of physical EagerTensors `a` and `b`
// of one dtype; returns whether it did (False: not both physical EagerTensors of a known
// layout, or dtypes differ; nothing changed). Each Python object keeps its TensorFlow
// tensor id, shape and dtype. For giving a tensor a handle of its own (a copy sharing its
// buffer, from an Identity op): tensor_key then tells it from the tensors it shared a
// handle with, as TensorFlow's tape tells them apart by object. GIL: held; never fails.
PyObject* PySwapHandles(PyObject* self, PyObject* args) {
  PyObject *a, *b;
  if (!PyArg_ParseTuple(args, "OO", &a, &b)) return nullptr;
  TFE_TensorHandle** sa = PhysicalHandleSlot(a);
  TFE_TensorHandle** sb = PhysicalHandleSlot(b);
  if (sa == nullptr || sb == nullptr || a == b ||
      TFE_TensorHandleDataType(*sa) != TFE_TensorHandleDataType(*sb)) {
    Py_RETURN_FALSE;
  }
  std::swap(*sa, *sb);
  Py_RETURN_TRUE;
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
      item = PayloadValue(p);  // borrowed
      if (item == nullptr) {
        Py_DECREF(values);
        Py_DECREF(foreign);
        Py_DECREF(seq);
        return nullptr;
      }
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

// wrap_outputs(stack, values, transient, value_dtype[, op]) -> list of tensors on `stack`.
// `values` is what the handler's execute returned for `op` (default: the op of the
// innermost execute callback on this thread): it must be a list or tuple. A tensor value
// gives its own dtype; other representations ask `value_dtype(value)`, which must give a
// tf.DType. With `transient`, resource-dtype tensor values are returned as they are (RFC
// "Placement of resource handles"). Anything else is a HandlerOutputError naming the
// handler, the hook and the op.
PyObject* PyWrapOutputs(PyObject* self, PyObject* args) {
  PyObject *stack, *values, *value_dtype, *op = Py_None;
  int transient;
  if (!PyArg_ParseTuple(args, "OOpO|O", &stack, &values, &transient, &value_dtype, &op))
    return nullptr;
  if (!RequireInit()) return nullptr;
  PyObject* op_type = nullptr;  // borrowed
  if (PyObject_TypeCheck(op, &OpBaseType)) {
    op_type = reinterpret_cast<OpObject*>(op)->type;
  } else {
    op_type = CurrentOpType();
  }
  return WrapOutputs(stack, values, transient != 0, value_dtype, op_type);
}

}  // namespace

PyObject* WrapOutputs(PyObject* stack, PyObject* values, bool transient,
                      PyObject* value_dtype, PyObject* op_type) {
  if (!PyList_Check(values) && !PyTuple_Check(values)) {
    // A generator or coroutine execute: close it so that it does not run later (or warn
    // that it was never awaited).
    if (PyGen_Check(values) || PyCoro_CheckExact(values)) {
      PyObject* r = PyObject_CallMethod(values, "close", nullptr);
      Py_XDECREF(r);
      PyErr_Clear();
    }
    SetHookOutputError(stack, "execute", op_type,
                       std::string("a ") + Py_TYPE(values)->tp_name +
                           " (it must return a list of outputs)");
    return nullptr;
  }
  const bool shape_from_value = !HasNativeShapeHooks(stack);
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
        t = WrapHandlerTensor(stack, v, dt, op_type, shape_from_value);
      }
    } else {
      std::string what = "output " + std::to_string(i);
      PyObject* d = PyObject_CallOneArg(value_dtype, v);
      PyObject* e = nullptr;
      if (d != nullptr) {
        // Only a tf.DType has as_datatype_enum: a numpy dtype (a numpy array returned as
        // an output) does not.
        e = PyObject_GetAttrString(d, "as_datatype_enum");
        if (e == nullptr && PyErr_ExceptionMatches(PyExc_AttributeError)) {
          PyErr_Clear();
          SetHookOutputError(
              stack, "execute", op_type,
              what + " as a " + Py_TYPE(v)->tp_name + " whose value_dtype is " + SafeRepr(d) +
                  ", not a tf.DType (return tensors, or override value_dtype to give the "
                  "tf.DType of the handler's own representation)");
        }
        Py_DECREF(d);
      }
      TF_DataType dt;
      if (e != nullptr && DtypeFromHook(stack, e, op_type, what.c_str(), &dt)) {
        t = WrapHandlerTensor(stack, v, dt, op_type, shape_from_value);
      }
      Py_XDECREF(e);
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

namespace {

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

PyMethodDef kModuleMethods[] = {
    {"init", PyInit, METH_VARARGS, "Registers the dispatcher device (once per process)."},
    {"context_changed", PyContextChanged, METH_O,
     "context_changed(context_capsule): the runtime moves to a new eager context "
     "(context._reset_context): registers the dispatcher device there."},
    {"wrap", PyWrap, METH_VARARGS, "wrap(stack, value, dtype_enum) -> handler tensor."},
    {"payload", PyPayload, METH_O, "payload(t) -> (stack, value) or None."},
    {"stack_of", PyStackOf, METH_O, "stack_of(t) -> stack or None."},
    {"handle_shared", PyHandleShared, METH_O,
     "handle_shared(t) -> whether physical EagerTensor t's handle is referenced elsewhere "
     "too (TensorFlow's scalar cache, another wrapper)."},
    {"scalar_cached", PyScalarCached, METH_VARARGS,
     "scalar_cached(t, value, dtype_enum, device_name) -> whether t's handle is "
     "TensorFlow's cached handle of Python scalar `value` converted with dtype "
     "`dtype_enum` (0: none given) under device scope `device_name`."},
    {"swap_handles", PySwapHandles, METH_VARARGS,
     "swap_handles(a, b) -> bool: exchanges the handles of two physical EagerTensors of "
     "one dtype (False, nothing changed, for anything else)."},
    {"tensor_key", PyTensorKey, METH_O,
     "tensor_key(t) -> int identity of t's TensorFlow handle (stable across wrappers)."},
    {"execute", PyExecute, METH_VARARGS, "execute(op, inputs, device) -> list of tensors."},
    {"new_op", PyNewOp, METH_VARARGS,
     "new_op(type, {attr: AttrValue bytes}[, num_outputs]) -> Op. num_outputs is used "
     "only for ops without an OpDef (function calls); it defaults to unknown (-1)."},
    {"unwrap_inputs", PyUnwrapInputs, METH_VARARGS,
     "unwrap_inputs(stack, inputs) -> (values, foreign_indices)."},
    {"wrap_outputs", PyWrapOutputs, METH_VARARGS,
     "wrap_outputs(stack, values, transient, value_dtype[, op]) -> tensors on stack."},
    {"shutdown", PyShutdown, METH_NOARGS,
     "Stops callbacks from entering Python (atexit; irreversible)."},
    {"drain", PyDrain, METH_NOARGS, "Frees payloads released off the GIL."},
    {"device_name", PyDeviceName, METH_O, "The TensorFlow device name of a tensor."},
    {nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_C",
                       "tf-ophandlers C++ boundary (see cc/boundary/dispatcher.h).", -1, kModuleMethods};


}  // namespace
}  // namespace tf_ophandlers

PyMODINIT_FUNC PyInit__C(void) {
  using namespace tf_ophandlers;
  if (!ReadyOpBaseType() || !ReadyNativeTypes() || !native_internal::ReadyNativeValueType()) {
    return nullptr;
  }
  PyObject* m = PyModule_Create(&kModule);
  if (m == nullptr) return nullptr;
  if (PyModule_AddFunctions(m, kNativeModuleMethods) < 0) return nullptr;
  if (PyModule_AddFunctions(m, kFastModuleMethods) < 0) return nullptr;
  if (PyModule_AddFunctions(m, kTraceModuleMethods) < 0) return nullptr;
  // Handler-specific C++ (cc/handlers/), through the fast path's one hook slot.
  if (!InstallHandlerHooks(m)) return nullptr;
  Py_INCREF(&NativeHandlerBaseType);
  PyModule_AddObject(m, "NativeHandlerBase", reinterpret_cast<PyObject*>(&NativeHandlerBaseType));
  Py_INCREF(&native_internal::NativeValueType);
  PyModule_AddObject(m, "NativeValue",
                     reinterpret_cast<PyObject*>(&native_internal::NativeValueType));
  Py_INCREF(&OpBaseType);
  PyModule_AddObject(m, "OpBase", reinterpret_cast<PyObject*>(&OpBaseType));
  return m;
}
