// A tiny third-party handler library for the tests, built with the oh.sysconfig flags:
//   FailOn(config="Sin")   forwards every op except those of type `config`, which fail
//                          with TF_INVALID_ARGUMENT and a message naming the op;
//   NoCopyOff()            forwards ops and refuses copy-off (TF_FAILED_PRECONDITION);
//   HiddenDims()           forwards ops; its tensors' axis lengths are unknown (dim hook);
//   OldLayout()            forwards ops; registered with a shorter struct_size.
#include <cstddef>
#include <cstring>
#include <string>

#include "tf_ophandlers/handler.h"

static const TFOH_RuntimeApi* api;

struct FailOn { std::string type; };

static void* FailCreate(void*, const char* config, TF_Status*) { return new FailOn{config}; }
static void FailDelete(void* s) { delete static_cast<FailOn*>(s); }
static void FailExecute(void* s, TFOH_Context* ctx, const TFOH_Op* op, int n, TFOH_Tensor* const* in,
                        int* nout, TFOH_Tensor** out, TF_Status* status) {
  if (static_cast<FailOn*>(s)->type == api->op_type(op)) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 (std::string("FailOn refuses op ") + api->op_type(op)).c_str());
    return;
  }
  api->execute_next(ctx, op, n, in, nout, out, status);
}

static void* NoCopyCreate(void*, const char*, TF_Status*) { return new int(0); }
static void NoCopyDelete(void* s) { delete static_cast<int*>(s); }
static TFOH_Tensor* NoCopyOff(void*, TFOH_Context*, TFOH_Tensor*, const char*, TF_Status* status) {
  TF_SetStatus(status, TF_FAILED_PRECONDITION, "NoCopyOff keeps its tensors");
  return nullptr;
}
static void NoCopyDebug(void*, TF_Buffer* out) {
  static const char kName[] = "NoCopyOff(strict)";
  out->data = kName;
  out->length = sizeof(kName) - 1;
  out->data_deallocator = nullptr;
}

// HiddenDims(): forwards ops; its tensors report rank from the representation and every
// axis length as unknown (-1), through the num_dims/dim hooks.
static int HiddenNumDims(void*, const TFOH_Tensor* value, TF_Status* status) {
  return api->tensor_num_dims(value, status);
}
static int64_t HiddenDim(void*, const TFOH_Tensor*, int, TF_Status*) { return -1; }
static void* HiddenCreate(void*, const char*, TF_Status*) { return new int(0); }
static void HiddenDelete(void* s) { delete static_cast<int*>(s); }
static void Forward(void*, TFOH_Context* ctx, const TFOH_Op* op, int n, TFOH_Tensor* const* in,
                    int* nout, TFOH_Tensor** out, TF_Status* status) {
  api->execute_next(ctx, op, n, in, nout, out, status);
}

extern "C" TFOH_EXPORT void TFOH_InitHandlerLibrary(const TFOH_RuntimeApi* a, TFOH_Library* lib,
                                                    TF_Status* status) {
  api = a;
  TFOH_HandlerType t;
  std::memset(&t, 0, sizeof(t));
  t.abi_version = TFOH_ABI_VERSION;
  t.struct_size = sizeof(t);
  t.name = "FailOn";
  t.create = FailCreate;
  t.delete_state = FailDelete;
  t.execute = FailExecute;
  api->register_type(lib, &t, status);
  if (TF_GetCode(status) != TF_OK) return;
  t.name = "NoCopyOff";
  t.create = NoCopyCreate;
  t.delete_state = NoCopyDelete;
  t.copy_off = NoCopyOff;
  t.debug_string = NoCopyDebug;
  api->register_type(lib, &t, status);
  if (TF_GetCode(status) != TF_OK) return;
  std::memset(&t, 0, sizeof(t));
  t.abi_version = TFOH_ABI_VERSION;
  t.struct_size = sizeof(t);
  t.name = "HiddenDims";
  t.create = HiddenCreate;
  t.delete_state = HiddenDelete;
  t.execute = Forward;
  t.num_dims = HiddenNumDims;
  t.dim = HiddenDim;
  api->register_type(lib, &t, status);
  if (TF_GetCode(status) != TF_OK) return;
  // OldLayout(): a type as a library built against a shorter TFOH_HandlerType would
  // register it: the fields past its struct_size (set to garbage here) must be ignored.
  std::memset(&t, 0, sizeof(t));
  t.abi_version = TFOH_ABI_VERSION;
  t.struct_size = offsetof(TFOH_HandlerType, copy_on);
  t.name = "OldLayout";
  t.create = HiddenCreate;
  t.delete_state = HiddenDelete;
  t.execute = Forward;
  t.copy_on = reinterpret_cast<decltype(t.copy_on)>(0x1);
  t.query = reinterpret_cast<decltype(t.query)>(0x1);
  api->register_type(lib, &t, status);
}

