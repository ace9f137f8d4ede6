// The hooks ABI version 2 added: see native_hooks.h.
#include "native/native_hooks.h"

#include "boundary/runtime.h"
#include "boundary/status.h"
#include "tensorflow/c/eager/c_api.h"

namespace tf_ophandlers {

bool KnownAbiVersion(int abi_version) {
  return abi_version >= 1 && abi_version <= TFOH_ABI_VERSION;
}

std::string UnknownAbiVersionMessage(int abi_version) {
  return "tf_ophandlers: register_type: unknown abi_version " + std::to_string(abi_version) +
         " (this runtime knows 1 to " + std::to_string(TFOH_ABI_VERSION) + ")";
}

size_t HandlerTypeBytes(const TFOH_HandlerType* type) {
  size_t defined = type->abi_version == 1   ? TFOH_HANDLER_TYPE_V1_SIZE
                   : type->abi_version == 2 ? TFOH_HANDLER_TYPE_V2_SIZE
                   : type->abi_version == 3 ? TFOH_HANDLER_TYPE_V3_SIZE
                                            : sizeof(TFOH_HandlerType);
  return type->struct_size < defined ? type->struct_size : defined;
}

namespace {

// Raises `status` (failed) with the handler and hook prefix. GIL: held.
PyObject* RaiseHookStatus(TF_Status* status, const std::string& handler) {
  std::string m = "tf_ophandlers: " + handler + ".static_value failed: " + TF_Message(status);
  TF_SetStatus(status, TF_GetCode(status), m.c_str());
  RaiseFromStatus(status);
  return nullptr;
}

}  // namespace

PyObject* CallStaticValueHook(int (*hook)(void*, const TFOH_Tensor*, TF_Tensor**, TF_Status*),
                              void* state, const TFOH_Tensor* value, TF_DataType dtype,
                              const std::string& handler) {
  TF_Status* s = TF_NewStatus();
  TF_Tensor* out = nullptr;
  int known = 0;
  try {
    known = hook(state, value, &out, s);
  } catch (...) {  // handler.h forbids exceptions; one must not end the process
    std::string m = HookThrewMessage(handler, "static_value", nullptr, ThrownText());
    TF_DeleteStatus(s);
    RaiseHandlerError(m);
    return nullptr;
  }
  PyObject* result = nullptr;
  if (TF_GetCode(s) != TF_OK) {
    result = RaiseHookStatus(s, handler);
  } else if (!known) {
    Py_INCREF(Py_None);
    result = Py_None;
  } else if (out == nullptr) {
    TF_SetStatus(s, TF_INTERNAL, "the hook returned 1 (known) without a tensor");
    result = RaiseHookStatus(s, handler);
  } else if (TF_TensorType(out) != dtype) {
    std::string m = "it returned a tensor of dtype enum " +
                    std::to_string(static_cast<int>(TF_TensorType(out))) +
                    " for a tensor of dtype enum " + std::to_string(static_cast<int>(dtype));
    TF_SetStatus(s, TF_INVALID_ARGUMENT, m.c_str());
    result = RaiseHookStatus(s, handler);
  } else {
    TFE_TensorHandle* h = TFE_NewTensorHandle(out, s);
    if (TF_GetCode(s) != TF_OK) {
      result = RaiseHookStatus(s, handler);
    } else {
      result = EagerTensorFromHandle(h, false);  // takes `h` on success
      if (result == nullptr) TFE_DeleteTensorHandle(h);
    }
  }
  if (out != nullptr) TF_DeleteTensor(out);  // the handle holds its own reference
  TF_DeleteStatus(s);
  return result;
}

}  // namespace tf_ophandlers
