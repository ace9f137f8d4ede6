// A handler library whose type's struct_size (8) does not cover the fields every ABI
// version requires (abi_version .. execute): loading it must fail with a clear error,
// never register a type whose create is NULL (tests/reliability/test_native_boundary.py).
#include <cstring>

#include "tf_ophandlers/handler.h"

static void* Create(void*, const char*, TF_Status*) { return new int(0); }
static void Delete(void* s) { delete static_cast<int*>(s); }
static void Execute(void*, TFOH_Context*, const TFOH_Op*, int, TFOH_Tensor* const*, int*,
                    TFOH_Tensor**, TF_Status*) {}

extern "C" TFOH_EXPORT void TFOH_InitHandlerLibrary(const TFOH_RuntimeApi* api, TFOH_Library* lib,
                                                    TF_Status* status) {
  TFOH_HandlerType t;
  std::memset(&t, 0, sizeof(t));
  t.abi_version = TFOH_ABI_VERSION;
  t.struct_size = 8;  // the fields past it are not the library's to give
  t.name = "Tiny";
  t.create = Create;
  t.delete_state = Delete;
  t.execute = Execute;
  api->register_type(lib, &t, status);
}
