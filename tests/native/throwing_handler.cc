// A handler library that breaks the header's contracts at the boundary, for
// tests/reliability/test_native_boundary.py (each case runs in a subprocess):
//   Throws(config="<hook>" or "<hook>:int")  forwards ops; the hook named by `config`
//       throws a std::runtime_error ("<hook> blew up"), or an int with ":int". The
//       execute hook throws only for Sin. Hooks: create, execute, copy_on, copy_off,
//       num_dims, dim, debug_string, tensor_debug_string, query, function_input_summary,
//       static_value, function_cache_key, function_output, executes_op, delete_state.
//   OffThread()  runs execute_next of every op on a worker thread it joins.
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

#include "tf_ophandlers/handler.h"

static const TFOH_RuntimeApi* api;

struct Throws {
  std::string hook;
  bool as_int;
};

static void MaybeThrow(void* s, const char* hook) {
  auto* t = static_cast<Throws*>(s);
  if (t->hook != hook) return;
  if (t->as_int) throw 42;
  throw std::runtime_error(std::string(hook) + " blew up");
}

static void* ThrowsCreate(void*, const char* config, TF_Status*) {
  std::string c = config;
  bool as_int = c.size() > 4 && c.compare(c.size() - 4, 4, ":int") == 0;
  if (as_int) c.resize(c.size() - 4);
  if (c == "create") {
    if (as_int) throw 42;
    throw std::runtime_error("create blew up");
  }
  return new Throws{c, as_int};
}
static void ThrowsDelete(void* s) {
  MaybeThrow(s, "delete_state");
  delete static_cast<Throws*>(s);
}
static void ThrowsExecute(void* s, TFOH_Context* ctx, const TFOH_Op* op, int n,
                          TFOH_Tensor* const* in, int* nout, TFOH_Tensor** out,
                          TF_Status* status) {
  if (std::strcmp(api->op_type(op), "Sin") == 0) MaybeThrow(s, "execute");
  api->execute_next(ctx, op, n, in, nout, out, status);
}
static TFOH_Tensor* ThrowsCopyOn(void* s, TFOH_Context*, TFOH_Tensor* t, TF_Status*) {
  MaybeThrow(s, "copy_on");
  api->tensor_ref(t);
  return t;
}
static TFOH_Tensor* ThrowsCopyOff(void* s, TFOH_Context*, TFOH_Tensor* t, const char*,
                                  TF_Status*) {
  MaybeThrow(s, "copy_off");
  api->tensor_ref(t);
  return t;
}
static int ThrowsNumDims(void* s, const TFOH_Tensor* v, TF_Status* status) {
  MaybeThrow(s, "num_dims");
  return api->tensor_num_dims(v, status);
}
static int64_t ThrowsDim(void* s, const TFOH_Tensor* v, int i, TF_Status* status) {
  MaybeThrow(s, "dim");
  return api->tensor_dim(v, i, status);
}
static void ThrowsDebug(void* s, TF_Buffer* out) {
  MaybeThrow(s, "debug_string");
  static const char kName[] = "Throws(...)";
  out->data = kName;
  out->length = sizeof(kName) - 1;
  out->data_deallocator = nullptr;
}
static void ThrowsTensorDebug(void* s, const TFOH_Tensor*, TF_Buffer* out, TF_Status*) {
  MaybeThrow(s, "tensor_debug_string");
  static const char kText[] = "<Throws tensor>";
  out->data = kText;
  out->length = sizeof(kText) - 1;
  out->data_deallocator = nullptr;
}
static void ThrowsQuery(void* s, const char*, TF_Buffer* out, TF_Status*) {
  MaybeThrow(s, "query");
  out->data = "ok";
  out->length = 2;
  out->data_deallocator = nullptr;
}
static void ThrowsSummary(void* s, const TFOH_Tensor*, TF_Buffer*, TF_Status*) {
  MaybeThrow(s, "function_input_summary");
}
static int ThrowsStatic(void* s, const TFOH_Tensor*, TF_Tensor**, TF_Status*) {
  MaybeThrow(s, "static_value");
  return 0;
}
static void ThrowsCacheKey(void* s, TF_Buffer* out, TF_Status*) {
  MaybeThrow(s, "function_cache_key");
  out->data = "k";
  out->length = 1;
  out->data_deallocator = nullptr;
}
static TFOH_Tensor* ThrowsFunctionOutput(void* s, const char*, size_t, TFOH_Tensor* t,
                                         TF_Status*) {
  MaybeThrow(s, "function_output");
  api->tensor_ref(t);
  return t;
}
static int ThrowsExecutesOp(void* s, const char* type) {
  if (std::strcmp(type, "Sin") == 0) MaybeThrow(s, "executes_op");
  return 1;
}

static void* PlainCreate(void*, const char*, TF_Status*) { return new int(0); }
static void PlainDelete(void* s) { delete static_cast<int*>(s); }

static void OffThreadExecute(void*, TFOH_Context* ctx, const TFOH_Op* op, int n,
                             TFOH_Tensor* const* in, int* nout, TFOH_Tensor** out,
                             TF_Status* status) {
  std::thread worker([&] { api->execute_next(ctx, op, n, in, nout, out, status); });
  worker.join();
}

extern "C" TFOH_EXPORT void TFOH_InitHandlerLibrary(const TFOH_RuntimeApi* a, TFOH_Library* lib,
                                                    TF_Status* status) {
  api = a;
  TFOH_HandlerType t;
  std::memset(&t, 0, sizeof(t));
  t.abi_version = TFOH_ABI_VERSION;
  t.struct_size = sizeof(t);
  t.name = "Throws";
  t.create = ThrowsCreate;
  t.delete_state = ThrowsDelete;
  t.execute = ThrowsExecute;
  t.copy_on = ThrowsCopyOn;
  t.copy_off = ThrowsCopyOff;
  t.num_dims = ThrowsNumDims;
  t.dim = ThrowsDim;
  t.debug_string = ThrowsDebug;
  t.tensor_debug_string = ThrowsTensorDebug;
  t.query = ThrowsQuery;
  t.function_input_summary = ThrowsSummary;
  t.static_value = ThrowsStatic;
  t.function_cache_key = ThrowsCacheKey;
  t.function_output = ThrowsFunctionOutput;
  t.executes_op = ThrowsExecutesOp;
  api->register_type(lib, &t, status);
  if (TF_GetCode(status) != TF_OK) return;

  std::memset(&t, 0, sizeof(t));
  t.abi_version = TFOH_ABI_VERSION;
  t.struct_size = sizeof(t);
  t.name = "OffThread";
  t.create = PlainCreate;
  t.delete_state = PlainDelete;
  t.execute = OffThreadExecute;
  api->register_type(lib, &t, status);
}
