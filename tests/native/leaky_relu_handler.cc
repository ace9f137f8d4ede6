// A handler library for tests/handlers/test_substituting_handlers.py, built with the
// oh.sysconfig flags: a handler that *substitutes* an op (ABI version 3 op building).
//
//   LeakyRelu(config)  config "<alpha>": every Relu runs as LeakyRelu(alpha), an op the
//     handler builds and runs on the next stack; other ops are forwarded. Its gradient
//     is LeakyRelu's (alpha below zero), not Relu's: the test compares it under
//     tf.GradientTape, oh.GradientTape and tf.function with the program written with
//     tf.nn.leaky_relu. A config that is not a number fails `create`.
#include <cstdlib>
#include <cstring>
#include <string>

#include "tf_ophandlers/handler.h"

static const TFOH_RuntimeApi* api;

struct Config {
  float alpha;
  std::string text;
};

static void* Create(void*, const char* config, TF_Status* status) {
  std::string text = config;
  char* end = nullptr;
  float alpha = std::strtof(text.c_str(), &end);
  if (text.empty() || *end != '\0') {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 ("LeakyRelu needs a number, got '" + text + "'").c_str());
    return nullptr;
  }
  return new Config{alpha, text};
}

static void Delete(void* s) { delete static_cast<Config*>(s); }

static void Execute(void* s, TFOH_Context* ctx, const TFOH_Op* op, int n, TFOH_Tensor* const* in,
                    int* nout, TFOH_Tensor** out, TF_Status* status) {
  if (std::strcmp(api->op_type(op), "Relu") != 0) {
    api->execute_next(ctx, op, n, in, nout, out, status);
    return;
  }
  TFOH_Op* leaky = api->op_new(ctx, "LeakyRelu", status);
  if (leaky == nullptr) return;
  api->op_set_attr_type(leaky, "T", api->tensor_dtype(in[0]));
  api->op_set_attr_float(leaky, "alpha", static_cast<Config*>(s)->alpha);
  api->execute_next(ctx, leaky, n, in, nout, out, status);
  api->op_delete(leaky);
}

static void CacheKey(void* s, TF_Buffer* out, TF_Status*) {
  const std::string& text = static_cast<Config*>(s)->text;
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
    TF_SetStatus(status, TF_FAILED_PRECONDITION, "LeakyRelu needs a runtime of ABI version 3");
    return;
  }
  TFOH_HandlerType t;
  std::memset(&t, 0, sizeof(t));
  t.abi_version = TFOH_ABI_VERSION;
  t.struct_size = sizeof(t);
  t.name = "LeakyRelu";
  t.doc = "Runs every Relu as LeakyRelu(alpha), an op it builds.";
  t.create = Create;
  t.delete_state = Delete;
  t.execute = Execute;
  t.function_cache_key = CacheKey;
  api->register_type(lib, &t, status);
}
