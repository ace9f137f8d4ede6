// tf-ophandlers: a measurement aid for benchmarks/, not used by the package.
//
// `tf_ophandlers._null_device.register(context_capsule, device_name)` registers a
// TensorFlow custom device whose execute callback runs nothing and calls no Python: it
// returns, for each output the OpDef implies, a new custom-device tensor with the shape
// of the op's first input. Timing user code under `tf.device(<that device>)` therefore
// measures what *any* per-op interception through a custom device costs on TF 2.21 (the
// TensorFlow Python API, TFE_Execute's placement, one custom-device call and a new
// output handle and EagerTensor per output) with zero work of its own: the floor under
// which no handler, in Python or in C, can record an op. benchmarks/lazy.py uses it to
// bound what `oh.Lazy()` can reach. Only shape-preserving ops with one dtype make sense
// on it (a chain of elementwise ops); values cannot be read back (copy-off fails).
//
// Contracts (as cc/boundary/dispatcher.h): callbacks take no GIL and call no Python; ownership of
// every returned handle passes to TensorFlow; the payload (a dims vector) is freed by the
// handle's deallocator. `register` may be called once per process; GIL held.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string>
#include <vector>

#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/eager/c_api_experimental.h"

namespace {

TFE_Context* g_ctx = nullptr;
std::string g_name;

using Dims = std::vector<int64_t>;

int NumDims(void* data, TF_Status*) { return static_cast<int>(static_cast<Dims*>(data)->size()); }
int64_t Dim(void* data, int i, TF_Status*) { return (*static_cast<Dims*>(data))[i]; }
void Release(void* data) { delete static_cast<Dims*>(data); }

TFE_TensorHandle* NewHandle(TF_DataType dtype, Dims* dims, TF_Status* status) {
  TFE_CustomDeviceTensorHandle methods;
  methods.num_dims = &NumDims;
  methods.dim = &Dim;
  methods.deallocator = &Release;
  methods.summarize = nullptr;
  // Takes ownership of `dims` (frees it through the deallocator on failure too).
  return TFE_NewCustomDeviceTensorHandle(g_ctx, g_name.c_str(), dtype, dims, methods, status);
}

Dims* ShapeOf(TFE_TensorHandle* h, TF_Status* status) {
  auto* dims = new Dims();
  int n = TFE_TensorHandleNumDims(h, status);
  for (int i = 0; i < n && TF_GetCode(status) == TF_OK; ++i)
    dims->push_back(TFE_TensorHandleDim(h, i, status));
  return dims;
}

void Execute(const TFE_Op* op, int* num_outputs, TFE_TensorHandle** outputs, TF_Status* status,
             void*) {
  if (TFE_OpGetFlatInputCount(op, status) < 1) {
    TF_SetStatus(status, TF_UNIMPLEMENTED, "null device: ops without inputs are not supported");
    return;
  }
  TFE_TensorHandle* first = TFE_OpGetFlatInput(op, 0, status);
  if (TF_GetCode(status) != TF_OK) return;
  TF_DataType dtype = TFE_TensorHandleDataType(first);
  for (int i = 0; i < *num_outputs; ++i) {
    outputs[i] = NewHandle(dtype, ShapeOf(first, status), status);
    if (TF_GetCode(status) != TF_OK) {
      for (int j = 0; j < i; ++j) TFE_DeleteTensorHandle(outputs[j]);
      return;
    }
  }
}

TFE_TensorHandle* CopyTo(TFE_Context*, TFE_TensorHandle* tensor, TF_Status* status, void*) {
  return NewHandle(TFE_TensorHandleDataType(tensor), ShapeOf(tensor, status), status);
}

TFE_TensorHandle* CopyFrom(TFE_Context*, TFE_TensorHandle*, const char*, TF_Status* status,
                           void*) {
  TF_SetStatus(status, TF_UNIMPLEMENTED, "null device: it computes no values");
  return nullptr;
}

void Delete(void*) {}

PyObject* Register(PyObject*, PyObject* args) {
  PyObject* capsule;
  const char* name;
  if (!PyArg_ParseTuple(args, "Os", &capsule, &name)) return nullptr;
  if (g_ctx != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "null device: already registered");
    return nullptr;
  }
  auto* ctx = static_cast<TFE_Context*>(PyCapsule_GetPointer(capsule, nullptr));
  if (ctx == nullptr) return nullptr;
  TFE_CustomDevice device;
  device.copy_tensor_to_device = &CopyTo;
  device.copy_tensor_from_device = &CopyFrom;
  device.execute = &Execute;
  device.delete_device = &Delete;
  TF_Status* s = TF_NewStatus();
  TFE_RegisterCustomDevice(ctx, device, name, nullptr, s);
  if (TF_GetCode(s) != TF_OK) {
    PyErr_Format(PyExc_RuntimeError, "null device: %s", TF_Message(s));
    TF_DeleteStatus(s);
    return nullptr;
  }
  TF_DeleteStatus(s);
  g_ctx = ctx;
  g_name = name;
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"register", Register, METH_VARARGS,
     "register(context_capsule, device_name): registers the null device."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_null_device",
                       "A custom device that runs nothing (benchmark floor).", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__null_device(void) { return PyModule_Create(&kModule); }
