// A handler library whose type claims an ABI version the runtime does not know: loading
// it must fail with a clear error (tests/native/test_native_handlers.py).
#include <cstring>

#include "tf_ophandlers/handler.h"

static void* Create(void*, const char*, TF_Status*) { return nullptr; }
static void Delete(void*) {}
static void Execute(void*, TFOH_Context*, const TFOH_Op*, int, TFOH_Tensor* const*, int*,
                    TFOH_Tensor**, TF_Status*) {}

extern "C" TFOH_EXPORT void TFOH_InitHandlerLibrary(const TFOH_RuntimeApi* api, TFOH_Library* lib,
                                                    TF_Status* status) {
  TFOH_HandlerType t;
  std::memset(&t, 0, sizeof(t));
  t.abi_version = TFOH_ABI_VERSION + 1;
  t.struct_size = sizeof(t);
  t.name = "FromTheFuture";
  t.create = Create;
  t.delete_state = Delete;
  t.execute = Execute;
  api->register_type(lib, &t, status);
}
