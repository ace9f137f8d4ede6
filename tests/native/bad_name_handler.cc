// A handler library whose type name "Caf\xe9" is not valid UTF-8 (Latin-1, as a library
// built with a legacy encoding has it), nor is its debug_string or its error message: the
// real error must still reach Python (tests/reliability/test_native_boundary.py).
#include <cstring>

#include "tf_ophandlers/handler.h"

static const TFOH_RuntimeApi* api;

// Caf\xe9: not valid UTF-8 (Latin-1), as a library built with a legacy encoding has it.
static void* PlainCreate(void*, const char*, TF_Status*) { return new int(0); }
static void PlainDelete(void* s) { delete static_cast<int*>(s); }
static void BadNameExecute(void*, TFOH_Context* ctx, const TFOH_Op* op, int n,
                           TFOH_Tensor* const* in, int* nout, TFOH_Tensor** out,
                           TF_Status* status) {
  if (std::strcmp(api->op_type(op), "Sin") == 0) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT, "Caf\xe9 refuses op Sin");
    return;
  }
  api->execute_next(ctx, op, n, in, nout, out, status);
}
static void BadNameDebug(void*, TF_Buffer* out) {
  static const char kName[] = "Caf\xe9(\xff)";
  out->data = kName;
  out->length = sizeof(kName) - 1;
  out->data_deallocator = nullptr;
}

extern "C" TFOH_EXPORT void TFOH_InitHandlerLibrary(const TFOH_RuntimeApi* a, TFOH_Library* lib,
                                                    TF_Status* status) {
  api = a;
  TFOH_HandlerType t;
  std::memset(&t, 0, sizeof(t));
  t.abi_version = TFOH_ABI_VERSION;
  t.struct_size = sizeof(t);
  t.name = "Caf\xe9";
  t.create = PlainCreate;
  t.delete_state = PlainDelete;
  t.execute = BadNameExecute;
  t.debug_string = BadNameDebug;
  api->register_type(lib, &t, status);
}
