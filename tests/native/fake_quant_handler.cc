// A handler library for ABI version 3 (tests/native/test_abi_v3.py), built with the
// oh.sysconfig flags: fake quantization that *emits ops* (op_new + execute_next).
//
//   FakeQuant(config)  config "<scale>[;<fault>]": every float32 input of MatMul and
//     Conv2D is replaced by its fake quantization with a straight-through gradient,
//         q(x) = x + StopGradient(Round(x * scale) * (1 / scale) - x),
//     computed by ops the handler builds and runs on the next stack (Const, Mul, Round,
//     Sub, StopGradient, AddV2), so a tape below the handler records them and gives the
//     straight-through gradient. Other ops are forwarded. Its function_cache_key is the
//     config, so handlers of one config share replays of a tf.function.
//     Faults (tests of the runtime's checks reaching Python with their messages):
//       "no_type_attr"  builds Round without its "T" attribute;
//       "unknown_op"    asks op_new for an op type that does not exist.
//   A scale that is not a positive number fails `create`.
#include <cstdlib>
#include <cstring>
#include <string>

#include "tf_ophandlers/handler.h"

static const TFOH_RuntimeApi* api;

struct Config {
  float scale;
  std::string fault;
  std::string text;
};

static void* Create(void*, const char* config, TF_Status* status) {
  std::string text = config;
  std::string head = text.substr(0, text.find(';'));
  char* end = nullptr;
  float scale = std::strtof(head.c_str(), &end);
  if (head.empty() || *end != '\0' || !(scale > 0.0f)) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 ("FakeQuant needs a positive scale, got '" + head + "'").c_str());
    return nullptr;
  }
  std::string fault = text.find(';') == std::string::npos ? "" : text.substr(text.find(';') + 1);
  return new Config{scale, fault, text};
}

static void Delete(void* s) { delete static_cast<Config*>(s); }

// Runs a one-output op `type` (attribute T = float32 unless `typed` is false) on the next
// stack. Returns a new tensor, or NULL with `status` set.
static TFOH_Tensor* Run(TFOH_Context* ctx, const char* type, TFOH_Tensor* a, TFOH_Tensor* b,
                        bool typed, TF_Status* status) {
  TFOH_Op* op = api->op_new(ctx, type, status);
  if (op == nullptr) return nullptr;
  if (typed) api->op_set_attr_type(op, "T", TF_FLOAT);
  TFOH_Tensor* ins[2] = {a, b};
  TFOH_Tensor* out = nullptr;
  int n = 1;
  api->execute_next(ctx, op, b != nullptr ? 2 : 1, ins, &n, &out, status);
  api->op_delete(op);
  return TF_GetCode(status) == TF_OK ? out : nullptr;
}

// A float32 scalar constant on the next stack (a Const op).
static TFOH_Tensor* Constant(TFOH_Context* ctx, float v, TF_Status* status) {
  TFOH_Op* op = api->op_new(ctx, "Const", status);
  if (op == nullptr) return nullptr;
  TF_Tensor* value = TF_AllocateTensor(TF_FLOAT, nullptr, 0, sizeof(float));
  *static_cast<float*>(TF_TensorData(value)) = v;
  api->op_set_attr_type(op, "dtype", TF_FLOAT);
  api->op_set_attr_tensor(op, "value", value, status);
  TF_DeleteTensor(value);  // the op keeps its own copy
  TFOH_Tensor* out = nullptr;
  int n = 1;
  if (TF_GetCode(status) == TF_OK) api->execute_next(ctx, op, 0, nullptr, &n, &out, status);
  api->op_delete(op);
  return TF_GetCode(status) == TF_OK ? out : nullptr;
}

// q(x) as described above; a new tensor, or NULL with `status` set.
static TFOH_Tensor* Quantize(const Config& c, TFOH_Context* ctx, TFOH_Tensor* x,
                             TF_Status* status) {
  if (c.fault == "unknown_op") return Run(ctx, "NoSuchOpForFakeQuant", x, nullptr, true, status);
  TFOH_Tensor* t[8] = {nullptr};
  TFOH_Tensor* y = nullptr;
  if ((t[0] = Constant(ctx, c.scale, status)) &&
      (t[1] = Constant(ctx, 1.0f / c.scale, status)) &&
      (t[2] = Run(ctx, "Mul", x, t[0], true, status)) &&
      (t[3] = Run(ctx, "Round", t[2], nullptr, c.fault != "no_type_attr", status)) &&
      (t[4] = Run(ctx, "Mul", t[3], t[1], true, status)) &&
      (t[5] = Run(ctx, "Sub", t[4], x, true, status)) &&
      (t[6] = Run(ctx, "StopGradient", t[5], nullptr, true, status))) {
    y = Run(ctx, "AddV2", x, t[6], true, status);
  }
  for (TFOH_Tensor* u : t) {
    if (u != nullptr) api->tensor_unref(u);
  }
  return y;
}

static void Execute(void* s, TFOH_Context* ctx, const TFOH_Op* op, int n, TFOH_Tensor* const* in,
                    int* nout, TFOH_Tensor** out, TF_Status* status) {
  const Config& c = *static_cast<Config*>(s);
  const char* type = api->op_type(op);
  if (std::strcmp(type, "MatMul") != 0 && std::strcmp(type, "Conv2D") != 0) {
    api->execute_next(ctx, op, n, in, nout, out, status);
    return;
  }
  TFOH_Tensor* q[2] = {nullptr, nullptr};
  for (int i = 0; i < n && i < 2 && TF_GetCode(status) == TF_OK; ++i) {
    if (api->tensor_dtype(in[i]) == TF_FLOAT) {
      q[i] = Quantize(c, ctx, in[i], status);
    } else {
      api->tensor_ref(in[i]);
      q[i] = in[i];
    }
  }
  if (TF_GetCode(status) == TF_OK) api->execute_next(ctx, op, n, q, nout, out, status);
  for (TFOH_Tensor* u : q) {
    if (u != nullptr) api->tensor_unref(u);
  }
}

static void CacheKey(void* s, TF_Buffer* out, TF_Status*) {
  const std::string& text = static_cast<Config*>(s)->text;
  char* copy = static_cast<char*>(std::malloc(text.size()));
  std::memcpy(copy, text.data(), text.size());
  out->data = copy;
  out->length = text.size();
  out->data_deallocator = [](void* data, size_t) { std::free(data); };
}

static void DebugString(void* s, TF_Buffer* out) {
  std::string text = "FakeQuant(" + static_cast<Config*>(s)->text + ")";
  char* copy = static_cast<char*>(std::malloc(text.size()));
  std::memcpy(copy, text.data(), text.size());
  out->data = copy;
  out->length = text.size();
  out->data_deallocator = [](void* data, size_t) { std::free(data); };
}

extern "C" TFOH_EXPORT void TFOH_InitHandlerLibrary(const TFOH_RuntimeApi* a, TFOH_Library* lib,
                                                    TF_Status* status) {
  api = a;
  if (api->abi_version < 3) {
    TF_SetStatus(status, TF_FAILED_PRECONDITION, "FakeQuant needs a runtime of ABI version 3");
    return;
  }
  TFOH_HandlerType t;
  std::memset(&t, 0, sizeof(t));
  t.abi_version = TFOH_ABI_VERSION;
  t.struct_size = sizeof(t);
  t.name = "FakeQuant";
  t.doc = "Fake quantization of MatMul/Conv2D inputs, built from ops it emits.";
  t.create = Create;
  t.delete_state = Delete;
  t.execute = Execute;
  t.debug_string = DebugString;
  t.function_cache_key = CacheKey;
  api->register_type(lib, &t, status);
}
