// Handlers that break handler.h's contract, for the C API's bad-input program
// (tests/native/c_api_errors.c): the C runtime must turn each into a TF_Status error.
//   WrongDtype()  answers every op with its first input (a wrong dtype for Shape);
//   TooFew()      answers every op with no outputs;
//   Throws()      throws a C++ exception from execute;
//   CreateFails() returns a state from create and sets an error too (the runtime must
//                 still delete the state: c_api_bad_handler_live_states tells).
#include <atomic>
#include <cstring>
#include <stdexcept>

#include "tf_ophandlers/handler.h"

static const TFOH_RuntimeApi* api;
static std::atomic<int> live_states{0};

static void* Create(void*, const char*, TF_Status*) {
  ++live_states;
  return new int(0);
}
static void Delete(void* s) {
  --live_states;
  delete static_cast<int*>(s);
}
static void* CreateWithError(void*, const char*, TF_Status* status) {
  TF_SetStatus(status, TF_INVALID_ARGUMENT, "CreateFails refuses every configuration");
  ++live_states;
  return new int(0);
}

// The states created and not yet deleted, of every type of this library.
extern "C" TFOH_EXPORT int c_api_bad_handler_live_states() { return live_states.load(); }

static void FirstInput(void*, TFOH_Context*, const TFOH_Op*, int n, TFOH_Tensor* const* in,
                       int* nout, TFOH_Tensor** out, TF_Status* status) {
  if (n < 1 || *nout < 1) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT, "WrongDtype needs an input and an output");
    return;
  }
  api->tensor_ref(in[0]);
  out[0] = in[0];
  *nout = 1;
}

static void NoOutputs(void*, TFOH_Context*, const TFOH_Op*, int, TFOH_Tensor* const*,
                      int* nout, TFOH_Tensor**, TF_Status*) {
  *nout = 0;
}

static void Throw(void*, TFOH_Context*, const TFOH_Op*, int, TFOH_Tensor* const*, int*,
                  TFOH_Tensor**, TF_Status*) {
  throw std::runtime_error("Throws() always throws");
}

static void Register(TFOH_Library* lib, const char* name,
                     void (*execute)(void*, TFOH_Context*, const TFOH_Op*, int,
                                     TFOH_Tensor* const*, int*, TFOH_Tensor**, TF_Status*),
                     TF_Status* status) {
  TFOH_HandlerType t;
  std::memset(&t, 0, sizeof(t));
  t.abi_version = TFOH_ABI_VERSION;
  t.struct_size = sizeof(t);
  t.name = name;
  t.create = Create;
  t.delete_state = Delete;
  t.execute = execute;
  api->register_type(lib, &t, status);
}

extern "C" TFOH_EXPORT void TFOH_InitHandlerLibrary(const TFOH_RuntimeApi* a, TFOH_Library* lib,
                                                    TF_Status* status) {
  api = a;
  Register(lib, "WrongDtype", FirstInput, status);
  if (TF_GetCode(status) == TF_OK) Register(lib, "TooFew", NoOutputs, status);
  if (TF_GetCode(status) == TF_OK) Register(lib, "Throws", Throw, status);
  if (TF_GetCode(status) == TF_OK) {
    TFOH_HandlerType t;
    std::memset(&t, 0, sizeof(t));
    t.abi_version = TFOH_ABI_VERSION;
    t.struct_size = sizeof(t);
    t.name = "CreateFails";
    t.create = CreateWithError;
    t.delete_state = Delete;
    t.execute = NoOutputs;
    api->register_type(lib, &t, status);
  }
}
