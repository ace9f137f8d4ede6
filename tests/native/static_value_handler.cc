// A handler library for the ABI version 2 static_value hook (tests/native/test_abi_v2.py),
// built with the oh.sysconfig flags. Every type forwards its ops to the next stack.
//   StaticValue(config)  answers tf.get_static_value of its tensors by `config`:
//     "resolve"    the representation's value (TFE_TensorHandleResolve; eager only);
//     "unknown"    never known (tf.get_static_value returns None);
//     "fail"       fails with TF_INVALID_ARGUMENT;
//     "bad_dtype"  an int32 scalar whatever the tensor's dtype;
//     "bad_shape"  a float tensor of shape [7];
//     "no_tensor"  says known without a tensor.
//   V1Layout()  a type registered with abi_version 1 and the full (version 2) struct_size,
//               its static_value set to garbage: the runtime must not read the field.
#include <cstring>
#include <string>

#include "tf_ophandlers/handler.h"

static const TFOH_RuntimeApi* api;

struct Mode { std::string name; };

static void* Create(void*, const char* config, TF_Status*) { return new Mode{config}; }
static void Delete(void* s) { delete static_cast<Mode*>(s); }
static void Forward(void*, TFOH_Context* ctx, const TFOH_Op* op, int n, TFOH_Tensor* const* in,
                    int* nout, TFOH_Tensor** out, TF_Status* status) {
  api->execute_next(ctx, op, n, in, nout, out, status);
}

static TF_Tensor* FloatVector(int n) {
  int64_t dims[1] = {n};
  TF_Tensor* t = TF_AllocateTensor(TF_FLOAT, dims, 1, sizeof(float) * n);
  float* data = static_cast<float*>(TF_TensorData(t));
  for (int i = 0; i < n; ++i) data[i] = static_cast<float>(i);
  return t;
}

static int StaticValue(void* s, const TFOH_Tensor* value, TF_Tensor** out, TF_Status* status) {
  const std::string& mode = static_cast<Mode*>(s)->name;
  if (mode == "resolve") {
    TFE_TensorHandle* h = api->tensor_handle(value);
    if (h == nullptr) return 0;  // symbolic: not known
    TF_Tensor* t = TFE_TensorHandleResolve(h, status);
    if (TF_GetCode(status) != TF_OK) return 0;
    *out = t;
    return 1;
  }
  if (mode == "fail") {
    TF_SetStatus(status, TF_INVALID_ARGUMENT, "StaticValue(fail) knows nothing");
    return 0;
  }
  if (mode == "bad_dtype") {
    TF_Tensor* t = TF_AllocateTensor(TF_INT32, nullptr, 0, sizeof(int32_t));
    *static_cast<int32_t*>(TF_TensorData(t)) = 7;
    *out = t;
    return 1;
  }
  if (mode == "bad_shape") {
    *out = FloatVector(7);
    return 1;
  }
  if (mode == "no_tensor") return 1;
  return 0;  // "unknown"
}

extern "C" TFOH_EXPORT void TFOH_InitHandlerLibrary(const TFOH_RuntimeApi* a, TFOH_Library* lib,
                                                    TF_Status* status) {
  api = a;
  TFOH_HandlerType t;
  std::memset(&t, 0, sizeof(t));
  t.abi_version = TFOH_ABI_VERSION;
  t.struct_size = sizeof(t);
  t.name = "StaticValue";
  t.create = Create;
  t.delete_state = Delete;
  t.execute = Forward;
  t.static_value = StaticValue;
  api->register_type(lib, &t, status);
  if (TF_GetCode(status) != TF_OK) return;
  t.abi_version = 1;
  t.name = "V1Layout";
  t.static_value = reinterpret_cast<decltype(t.static_value)>(0x1);
  api->register_type(lib, &t, status);
}
