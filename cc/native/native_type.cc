// tf-ophandlers: the Python type _C.NativeHandlerBase (its methods call the hooks from
// Python). Contracts: native.h, native_internal.h and include/tf_ophandlers/handler.h.
#define PY_SSIZE_T_CLEAN
#include "native/native_internal.h"

#include <string>

#include "native/native_hooks.h"
#include "boundary/op.h"
#include "boundary/status.h"

namespace tf_ophandlers {
namespace native_internal {

// ---- helpers ----------------------------------------------------------------------------

std::string DebugString(NativeHandlerObject* self, std::string* threw) {
  if (self->type->hooks.debug_string != nullptr && self->state != nullptr) {
    TF_Buffer* b = TF_NewBuffer();
    try {
      self->type->hooks.debug_string(self->state, b);
    } catch (...) {  // (the hook has no status: the name stands in for it)
      if (threw != nullptr) *threw = ThrownText();
      TF_DeleteBuffer(b);
      return self->type->name + "()";
    }
    std::string r = ValidUtf8(static_cast<const char*>(b->data ? b->data : ""),
                              b->data ? b->length : 0);
    TF_DeleteBuffer(b);
    return r;
  }
  return self->type->name + "()";
}

void HookThrew(NativeHandlerObject* self, const char* hook, const char* op_type,
               TF_Status* status) noexcept {
  std::string text = ThrownText();
  PyGILState_STATE g = PyGILState_Ensure();  // (DebugString's hook runs with it)
  std::string handler = DebugString(self);
  PyGILState_Release(g);
  SetHandlerError(status, HookThrewMessage(handler, hook, op_type, text));
}

// Calls delete_state; an exception it throws cannot be raised to anyone (the state goes
// away from a deallocator), so it is reported as unraisable. GIL: held.
static void DeleteState(TypeRecord* type, void* state) {
  try {
    type->hooks.delete_state(state);
  } catch (...) {
    std::string m = HookThrewMessage(type->name, "delete_state", nullptr, ThrownText());
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    RaiseHandlerError(m);
    PyErr_WriteUnraisable(nullptr);
    PyErr_Restore(et, ev, tb);
  }
}

// Prefixes a failed `status` with the handler and op. GIL: held.
void PrefixStatus(NativeHandlerObject* self, const char* hook, const char* op_type,
                  TF_Status* status) {
  std::string m = "tf_ophandlers: " + DebugString(self) + "." + hook;
  // (a hook's message may be in another encoding: TensorFlow decodes it as UTF-8)
  if (op_type != nullptr) m += std::string(" failed for op ") + op_type;
  else m += " failed";
  m += ": ";
  m += ValidUtf8(TF_Message(status));
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

bool ExecutesOp(NativeHandlerObject* self, const char* type, std::string* threw) {
  const TFOH_HandlerType& k = self->type->hooks;
  if (k.execute == nullptr) return false;
  if (k.executes_op == nullptr) return true;
  try {
    return k.executes_op(self->state, type) != 0;
  } catch (...) {
    if (threw != nullptr) {
      *threw = HookThrewMessage(DebugString(self), "executes_op", type, ThrownText());
    }
    return true;
  }
}

namespace {

// ---- NativeHandlerBase methods ------------------------------------------------------------

void NativeDealloc(NativeHandlerObject* self) {
  if (self->state != nullptr && self->type != nullptr) DeleteState(self->type, self->state);
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
  void* st = nullptr;
  try {
    st = rec->hooks.create(rec->hooks.type_data, config, s);
  } catch (...) {
    std::string m = HookThrewMessage(rec->name + "(" + ValidUtf8(config) + ")", "create",
                                     nullptr, ThrownText());
    TF_DeleteStatus(s);
    RaiseHandlerError(m);
    return nullptr;
  }
  if (TF_GetCode(s) != TF_OK || st == nullptr) {
    if (TF_GetCode(s) == TF_OK) TF_SetStatus(s, TF_INTERNAL, "create returned NULL");
    std::string m = "tf_ophandlers: " + rec->name + "(" + config + ") could not be created: " +
                    TF_Message(s);
    TF_SetStatus(s, TF_GetCode(s), m.c_str());
    if (st != nullptr) DeleteState(rec, st);
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

// The Python tensor a hook returning a tensor gave (`out`, its status `s`), or nullptr
// with the hook's error raised (named `hook`; NULL without an error is an internal
// error). Releases `in`, `out` and `s`.
static PyObject* TensorResult(NativeHandlerObject* self, const char* hook, TFOH_Tensor* in,
                              TFOH_Tensor* out, TF_Status* s) {
  PyObject* r = nullptr;
  if (TF_GetCode(s) != TF_OK || out == nullptr) {
    if (TF_GetCode(s) == TF_OK) TF_SetStatus(s, TF_INTERNAL, "returned NULL");
    Unref(out);
    PrefixStatus(self, hook, nullptr, s);
    RaiseStatus(s);
  } else {
    r = PyOf(out);
    Unref(out);
  }
  Unref(in);
  TF_DeleteStatus(s);
  return r;
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
  TFOH_Tensor* out = CallHook<TFOH_Tensor*>(
      self, kind == 0 ? "copy_on" : "copy_off", nullptr, s, nullptr, [&] {
        return kind == 0 ? on(self->state, &ctx, in, s) : off(self->state, &ctx, in, device, s);
      });
  PyObject* r = TensorResult(self, kind == 0 ? "copy_on" : "copy_off", in, out, s);
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
  int64_t r = CallHook<int64_t>(self, index < 0 ? "num_dims" : "dim", nullptr, s, -1, [&] {
    return index < 0 ? static_cast<int64_t>(self->type->hooks.num_dims(self->state, in, s))
                     : self->type->hooks.dim(self->state, in, index, s);
  });
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
  CallVoidHook(self, hook, nullptr, s, [&] { call(b, s); });
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
  std::string threw;
  std::string text = DebugString(self, &threw);
  if (!threw.empty()) {
    RaiseHandlerError(HookThrewMessage(text, "debug_string", nullptr, threw));
    return nullptr;
  }
  return PyUnicode_FromString(text.c_str());
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

// _oh_function_output(summary, value) -> value (the function_output hook; ABI 3).
PyObject* NativeFunctionOutput(NativeHandlerObject* self, PyObject* args) {
  const char* summary;
  Py_ssize_t length;
  PyObject* value;
  if (!PyArg_ParseTuple(args, "y#O", &summary, &length, &value)) return nullptr;
  if (!CheckState(self)) return nullptr;
  auto hook = self->type->hooks.function_output;
  if (hook == nullptr) {
    Py_INCREF(value);
    return value;
  }
  TFOH_Tensor* in = TensorFromPy(value);
  TF_Status* s = TF_NewStatus();
  TFOH_Tensor* out = CallHook<TFOH_Tensor*>(self, "function_output", nullptr, s, nullptr, [&] {
    return hook(self->state, summary, static_cast<size_t>(length), in, s);
  });
  return TensorResult(self, "function_output", in, out, s);
}

// _oh_cache_key() -> bytes, or None when the type has no function_cache_key hook.
PyObject* NativeCacheKey(NativeHandlerObject* self, PyObject*) {
  if (!CheckState(self)) return nullptr;
  auto key = self->type->hooks.function_cache_key;
  return BufferCall(self, key != nullptr, "function_cache_key",
                    [&](TF_Buffer* b, TF_Status* s) { key(self->state, b, s); });
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

// _oh_executes_op(op_type) -> bool: whether the execute hook runs for ops of `op_type`
// (the class's `handles_ops`; ExecutesOp).
PyObject* NativeExecutesOp(NativeHandlerObject* self, PyObject* op_type) {
  if (!CheckState(self)) return nullptr;
  const char* type = PyUnicode_AsUTF8(op_type);
  if (type == nullptr) return nullptr;
  std::string threw;
  bool executes = ExecutesOp(self, type, &threw);
  if (!threw.empty()) {
    RaiseHandlerError(threw);
    return nullptr;
  }
  return PyBool_FromLong(executes);
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
    {"_oh_function_output", reinterpret_cast<PyCFunction>(NativeFunctionOutput), METH_VARARGS,
     "_oh_function_output(summary, value) -> value (the function_output hook)."},
    {"_oh_cache_key", reinterpret_cast<PyCFunction>(NativeCacheKey), METH_NOARGS,
     "_oh_cache_key() -> bytes or None (the function_cache_key hook)."},
    {"_oh_executes_op", reinterpret_cast<PyCFunction>(NativeExecutesOp), METH_O,
     "_oh_executes_op(op_type) -> bool: whether the execute hook runs for the op type."},
    {"query", reinterpret_cast<PyCFunction>(NativeQuery), METH_VARARGS,
     "query(key) -> bytes: a read-only request the handler defines."},
    {"_oh_debug_string", reinterpret_cast<PyCFunction>(NativeDebugString), METH_NOARGS, nullptr},
    {nullptr}};

PyGetSetDef kNativeGetSet[] = {
    {"native_type_name", reinterpret_cast<getter>(NativeTypeName), nullptr,
     "The handler type's registered name.", nullptr},
    {nullptr}};

}  // namespace
}  // namespace native_internal

using namespace native_internal;  // NOLINT: this file's own internals

PyTypeObject NativeHandlerBaseType = {
    PyVarObject_HEAD_INIT(nullptr, 0) "tf_ophandlers._C.NativeHandlerBase", /* tp_name */
    sizeof(NativeHandlerObject),                                            /* tp_basicsize */
};

bool ReadyNativeTypes() {
  NativeHandlerBaseType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE;
  NativeHandlerBaseType.tp_doc = "Base of handlers from handler libraries (see cc/native/native.h).";
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

}  // namespace tf_ophandlers
