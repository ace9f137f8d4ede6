// tf-ophandlers: ABI version 3's handler-defined tensor state (tensor_set_data,
// tensor_data): the Python type _C.NativeValue, a C/C++ handler's representation of a
// tensor that carries its own data. Contracts: native_internal.h and
// include/tf_ophandlers/handler.h.
#define PY_SSIZE_T_CLEAN
#include "native/native_internal.h"

namespace tf_ophandlers {
namespace native_internal {
namespace {

void ValueDealloc(NativeValueObject* self) {
  if (self->del != nullptr) self->del(self->data);  // GIL held (handler.h)
  self->data = nullptr;
  Py_CLEAR(self->tensor);
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyObject* ValueTensor(NativeValueObject* self, void*) {
  Py_INCREF(self->tensor);
  return self->tensor;
}

PyObject* ValueAttr(NativeValueObject* self, void* name) {
  return PyObject_GetAttrString(self->tensor, static_cast<const char*>(name));
}

PyObject* ValueRepr(NativeValueObject* self) {
  return PyUnicode_FromFormat("<NativeValue of %R>", self->tensor);
}

PyGetSetDef kValueGetSet[] = {
    {"tensor", reinterpret_cast<getter>(ValueTensor), nullptr,
     "The tensor of the next stack the value carries.", nullptr},
    {"dtype", reinterpret_cast<getter>(ValueAttr), nullptr, "tensor.dtype",
     const_cast<char*>("dtype")},
    {"shape", reinterpret_cast<getter>(ValueAttr), nullptr, "tensor.shape",
     const_cast<char*>("shape")},
    {"device", reinterpret_cast<getter>(ValueAttr), nullptr, "tensor.device",
     const_cast<char*>("device")},
    {nullptr}};

}  // namespace

PyTypeObject NativeValueType = {
    PyVarObject_HEAD_INIT(nullptr, 0) "tf_ophandlers._C.NativeValue", /* tp_name */
    sizeof(NativeValueObject),                                        /* tp_basicsize */
};

bool ReadyNativeValueType() {
  NativeValueType.tp_flags = Py_TPFLAGS_DEFAULT;
  NativeValueType.tp_doc =
      "A C/C++ handler's representation of a tensor with data of its own (tensor_set_data): "
      "`tensor` (of the next stack) and the handler's data, deleted with the value.";
  NativeValueType.tp_dealloc = reinterpret_cast<destructor>(ValueDealloc);
  NativeValueType.tp_getset = kValueGetSet;
  NativeValueType.tp_repr = reinterpret_cast<reprfunc>(ValueRepr);
  return PyType_Ready(&NativeValueType) >= 0;
}

PyObject* NewNativeValue(PyObject* tensor, void* data, void (*del)(void*)) {
  auto* v = PyObject_New(NativeValueObject, &NativeValueType);
  if (v == nullptr) {
    if (del != nullptr) del(data);
    return nullptr;
  }
  Py_INCREF(tensor);
  v->tensor = tensor;
  v->data = data;
  v->del = del;
  return reinterpret_cast<PyObject*>(v);
}

void ApiTensorSetData(TFOH_Tensor* t, void* data, void (*del)(void*)) {
  if (t == nullptr) {
    if (del != nullptr) del(data);
    return;
  }
  if (t->del != nullptr) t->del(t->data);  // replaced before it was used
  t->data = data;
  t->del = del;
  t->has_data = true;
  Py_CLEAR(t->wrapper);  // the tensor now carries the new data
}

void* ApiTensorData(const TFOH_Tensor* t) {
  if (t == nullptr) return nullptr;
  if (t->has_data) return t->data;
  return t->wrapper != nullptr ? reinterpret_cast<NativeValueObject*>(t->wrapper)->data : nullptr;
}

}  // namespace native_internal
}  // namespace tf_ophandlers
