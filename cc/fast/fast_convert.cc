// tf-ophandlers: the inputs cc/fast/fast_trace.cc's skip_trace_execute converts itself, as
// TensorFlow converts them for the same op (declared in fast_internal.h).
//
// TensorFlow's C fast path (pywrap_tfe_src.cc, TFE_Py_FastPathExecute_C) takes inputs
// that are EagerTensors, resource variables, ndarrays or Python numbers; any other input
// (a list such as Keras's `perm=(0, 2, 3, 1)`, a Keras variable) makes it raise
// _FallbackException before running anything, and the generated wrapper's Python
// fallback converts every input with execute.py's args_to_matching_eager: a Python value
// with `tf.constant` (ConvertToEagerTensor, the function used here), an object with
// `__tf_tensor__` (a Keras variable) by calling it; an attribute no tensor gives is
// inferred from its first converted input. Both paths capture the Python stack, which
// skip_trace_execute skips.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "fast/fast_internal.h"
#include "boundary/runtime.h"
#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/core/framework/types.pb.h"

namespace tensorflow {
// tensorflow/python/eager/pywrap_tensor.h: a Python value as a new handle of `dtype`
// (DT_INVALID: inferred) on `device_name`, through TensorFlow's scalar cache.
TFE_TensorHandle* ConvertToEagerTensor(TFE_Context* ctx, PyObject* value, DataType dtype,
                                       const char* device_name);
}  // namespace tensorflow

namespace tf_ophandlers {
namespace fast {
namespace {

PyObject* g_tf_tensor_attr = nullptr;  // "__tf_tensor__"
PyObject* g_resource_variable = nullptr;  // BaseResourceVariable (strong)
PyObject* g_as_dtype = nullptr;  // tf.dtypes.as_dtype (strong)

// Whether `value` is a list or tuple (exactly) of Python ints and floats (exactly; not
// bools), or of such lists, at most 8 deep: what TensorFlow converts to a constant,
// never packs (no tensor inside). Never sets an exception.
bool PlainNumbers(PyObject* value, int depth) {
  if (depth > 8 || !(PyList_CheckExact(value) || PyTuple_CheckExact(value))) return false;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
  PyObject** items = PySequence_Fast_ITEMS(value);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* x = items[i];
    if (!PyLong_CheckExact(x) && !PyFloat_CheckExact(x) && !PlainNumbers(x, depth + 1)) {
      return false;
    }
  }
  return true;
}

// The tf.DType of `dtype` (new reference), or Py_None for 0 (inferred).
PyObject* DTypeObject(TF_DataType dtype) {
  if (dtype == 0) return Py_NewRef(Py_None);
  static PyObject* cache[256] = {nullptr};  // (enum values are < 256; strong)
  const int k = static_cast<int>(dtype);
  if (k < 0 || k >= 256) return nullptr;
  if (cache[k] == nullptr) {
    PyObject* e = PyLong_FromLong(k);
    cache[k] = e != nullptr ? PyObject_CallOneArg(g_as_dtype, e) : nullptr;
    Py_XDECREF(e);
    if (cache[k] == nullptr) return nullptr;
  }
  return Py_NewRef(cache[k]);
}

}  // namespace

bool SetupConvert() {
  if (g_as_dtype != nullptr) return true;
  g_tf_tensor_attr = PyUnicode_InternFromString("__tf_tensor__");
  PyObject* rv = PyImport_ImportModule("tensorflow.python.ops.resource_variable_ops");
  PyObject* dt = PyImport_ImportModule("tensorflow.python.framework.dtypes");
  g_resource_variable = rv != nullptr ? PyObject_GetAttrString(rv, "BaseResourceVariable")
                                      : nullptr;
  PyObject* as_dtype = dt != nullptr ? PyObject_GetAttrString(dt, "as_dtype") : nullptr;
  Py_XDECREF(rv);
  Py_XDECREF(dt);
  if (g_tf_tensor_attr == nullptr || g_resource_variable == nullptr || as_dtype == nullptr) {
    Py_XDECREF(as_dtype);
    return false;
  }
  g_as_dtype = as_dtype;
  return true;
}

InputKind ClassifyInput(PyObject* value) {
  if (EagerTensor_CheckExact(value)) return InputKind::kTensor;
  if (PyFloat_CheckExact(value) || PyLong_CheckExact(value)) return InputKind::kNumber;
  if (PlainNumbers(value, 0)) return InputKind::kList;
  // An object converting itself (a Keras variable), but not a resource variable: the
  // fast path reads those itself, with its own tape notifications.
  if (g_resource_variable != nullptr && !PyList_Check(value) && !PyTuple_Check(value) &&
      PyObject_HasAttr(reinterpret_cast<PyObject*>(Py_TYPE(value)), g_tf_tensor_attr)) {
    int rv = PyObject_IsInstance(value, g_resource_variable);
    if (rv == 0) return InputKind::kObject;
    PyErr_Clear();
  }
  return InputKind::kOther;
}

TFE_TensorHandle* ConvertInput(PyObject* value, InputKind kind, TF_DataType want,
                               const char* device_name) {
  if (kind != InputKind::kObject) {
    TFE_TensorHandle* h = tensorflow::ConvertToEagerTensor(
        g_ctx, value, static_cast<tensorflow::DataType>(want), device_name);
    if (h == nullptr) PyErr_Clear();
    return h;
  }
  // As tensor_conversion_registry.convert does: value.__tf_tensor__(dtype, None).
  PyObject* dtype = DTypeObject(want);
  PyObject* method = dtype != nullptr ? PyObject_GetAttr(value, g_tf_tensor_attr) : nullptr;
  PyObject* out = method != nullptr
                      ? PyObject_CallFunctionObjArgs(method, dtype, Py_None, nullptr)
                      : nullptr;
  Py_XDECREF(method);
  Py_XDECREF(dtype);
  TFE_TensorHandle* h = nullptr;
  if (out != nullptr && EagerTensor_CheckExact(out)) {
    TF_Status* status = TF_NewStatus();
    h = TFE_TensorHandleCopySharingTensor(EagerTensor_Handle(out), status);
    if (TF_GetCode(status) != TF_OK && h != nullptr) {
      TFE_DeleteTensorHandle(h);
      h = nullptr;
    }
    TF_DeleteStatus(status);
  }
  Py_XDECREF(out);
  PyErr_Clear();
  return h;
}

}  // namespace fast
}  // namespace tf_ophandlers
