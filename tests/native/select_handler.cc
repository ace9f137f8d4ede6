// A handler library for tests/native/test_abi_v4.py (ABI version 4): `OnlyMatMul`
// executes MatMul only (its executes_op hook names it) and forwards it, counting the
// calls of its execute hook; every other op is forwarded by the runtime without a call.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tf_ophandlers/handler.h"

namespace {

const TFOH_RuntimeApi* g_api = nullptr;

struct State {
  std::atomic<long long> calls{0};
  std::atomic<long long> asked{0};  // executes_op calls
};

void* Create(void*, const char*, TF_Status*) { return new State(); }
void Delete(void* s) { delete static_cast<State*>(s); }

int ExecutesOp(void* s, const char* type) {
  static_cast<State*>(s)->asked.fetch_add(1);
  return std::strcmp(type, "MatMul") == 0;
}

void Execute(void* s, TFOH_Context* ctx, const TFOH_Op* op, int n_in, TFOH_Tensor* const* in,
             int* n_out, TFOH_Tensor** out, TF_Status* status) {
  if (std::strcmp(g_api->op_type(op), "MatMul") != 0) {
    TF_SetStatus(status, TF_INTERNAL, (std::string("execute called for ") +
                                       g_api->op_type(op)).c_str());
    return;
  }
  g_api->execute_next(ctx, op, n_in, in, n_out, out, status);
  if (TF_GetCode(status) == TF_OK) static_cast<State*>(s)->calls.fetch_add(1);
}

void Query(void* s, const char* key, TF_Buffer* out, TF_Status* status) {
  auto* st = static_cast<State*>(s);
  std::string text;
  if (std::strcmp(key, "calls") == 0) {
    text = std::to_string(st->calls.load());
  } else if (std::strcmp(key, "asked") == 0) {
    text = std::to_string(st->asked.load());
  } else {
    TF_SetStatus(status, TF_INVALID_ARGUMENT, "unknown query");
    return;
  }
  void* data = std::malloc(text.size() + 1);
  std::memcpy(data, text.data(), text.size());
  out->data = data;
  out->length = text.size();
  out->data_deallocator = [](void* d, size_t) { std::free(d); };
}

}  // namespace

extern "C" TFOH_EXPORT void TFOH_InitHandlerLibrary(const TFOH_RuntimeApi* api,
                                                    TFOH_Library* library, TF_Status* status) {
  g_api = api;
  TFOH_HandlerType t;
  std::memset(&t, 0, sizeof(t));
  t.abi_version = TFOH_ABI_VERSION;
  t.struct_size = sizeof(t);
  t.name = "OnlyMatMul";
  t.create = Create;
  t.delete_state = Delete;
  t.execute = Execute;
  t.executes_op = ExecutesOp;
  t.query = Query;
  api->register_type(library, &t, status);
}
