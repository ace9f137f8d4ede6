// A handler library for ABI version 3's handler-defined tensor state
// (tests/native/test_abi_v3_data.py), built with the oh.sysconfig flags.
//
//   Lineage()  every output of an op it executes carries its *depth*, 1 + the largest
//     depth of the op's inputs (0 for a tensor from elsewhere): per-tensor data set with
//     api->tensor_set_data and read back with api->tensor_data. repr() of its tensors
//     shows "depth=N"; the depth crosses function boundaries through
//     function_input_summary / function_output; query("live") is the number of depth
//     records not yet deleted (the runtime's delete_data calls).
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tf_ophandlers/handler.h"

static const TFOH_RuntimeApi* api;
static std::atomic<long> live{0};

struct Depth {
  long value;
};

static void* NewDepth(long value) {
  live.fetch_add(1);
  return new Depth{value};
}

static void DeleteDepth(void* d) {
  live.fetch_sub(1);
  delete static_cast<Depth*>(d);
}

static long DepthOf(const TFOH_Tensor* t) {
  const Depth* d = static_cast<const Depth*>(api->tensor_data(t));
  return d != nullptr ? d->value : 0;
}

static void Write(TF_Buffer* out, const std::string& text) {
  char* copy = static_cast<char*>(std::malloc(text.size() + 1));
  std::memcpy(copy, text.data(), text.size());
  out->data = copy;
  out->length = text.size();
  out->data_deallocator = [](void* data, size_t) { std::free(data); };
}

static void* Create(void*, const char*, TF_Status*) { return new int(0); }
static void Delete(void* s) { delete static_cast<int*>(s); }

static void Execute(void*, TFOH_Context* ctx, const TFOH_Op* op, int n, TFOH_Tensor* const* in,
                    int* nout, TFOH_Tensor** out, TF_Status* status) {
  long depth = 0;
  for (int i = 0; i < n; ++i) {
    long d = DepthOf(in[i]);
    if (d > depth) depth = d;
  }
  api->execute_next(ctx, op, n, in, nout, out, status);
  if (TF_GetCode(status) != TF_OK) return;
  for (int i = 0; i < *nout; ++i) api->tensor_set_data(out[i], NewDepth(depth + 1), DeleteDepth);
}

static void TensorText(void*, const TFOH_Tensor* value, TF_Buffer* out, TF_Status*) {
  Write(out, "depth=" + std::to_string(DepthOf(value)));
}

static void Summary(void*, const TFOH_Tensor* value, TF_Buffer* out, TF_Status*) {
  Write(out, std::to_string(DepthOf(value)));
}

static TFOH_Tensor* FunctionOutput(void*, const char* summary, size_t length,
                                   TFOH_Tensor* tensor, TF_Status* status) {
  std::string text(summary, length);
  char* end = nullptr;
  long depth = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0') {
    TF_SetStatus(status, TF_INVALID_ARGUMENT, ("Lineage: bad summary '" + text + "'").c_str());
    return nullptr;
  }
  api->tensor_ref(tensor);
  api->tensor_set_data(tensor, NewDepth(depth), DeleteDepth);
  return tensor;
}

static void Query(void*, const char* key, TF_Buffer* out, TF_Status* status) {
  if (std::strcmp(key, "live") != 0) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT, "Lineage: unknown query");
    return;
  }
  Write(out, std::to_string(live.load()));
}

extern "C" TFOH_EXPORT void TFOH_InitHandlerLibrary(const TFOH_RuntimeApi* a, TFOH_Library* lib,
                                                    TF_Status* status) {
  api = a;
  if (api->abi_version < 3) {
    TF_SetStatus(status, TF_FAILED_PRECONDITION, "Lineage needs a runtime of ABI version 3");
    return;
  }
  TFOH_HandlerType t;
  std::memset(&t, 0, sizeof(t));
  t.abi_version = TFOH_ABI_VERSION;
  t.struct_size = sizeof(t);
  t.name = "Lineage";
  t.doc = "Each tensor carries its depth in the op graph (handler-defined tensor state).";
  t.create = Create;
  t.delete_state = Delete;
  t.execute = Execute;
  t.tensor_debug_string = TensorText;
  t.function_input_summary = Summary;
  t.function_output = FunctionOutput;
  t.query = Query;
  api->register_type(lib, &t, status);
}
