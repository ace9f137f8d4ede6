/* tf-ophandlers: the payload carried by every tensor that lives on a handler stack.

   Every handler tensor is a TensorFlow custom-device tensor of the single dispatcher
   device `/job:localhost/replica:0/task:0/device:OPHANDLER:0` (DESIGN.md decision 1).
   Its device memory (`TFE_TensorHandleDevicePointer`) is a `TFOH_Payload`.

   The payload is the C-level contract between the dispatcher and handler
   implementations. Python handlers use kind TFOH_PAYLOAD_PYTHON; a handler written in
   C/C++ plugs into the same dispatcher with kind TFOH_PAYLOAD_C and a methods table, so
   the dispatcher never needs to know which language a handler is written in.

   Ownership: the dispatcher allocates every payload (C++ new) when it creates a handler
   tensor, the TFE_TensorHandle that carries it owns it, and the handle's deallocator
   frees it (C++ delete), after releasing `stack`/`value` (Python, with the GIL) or
   calling `c_methods->release(c_value)` (C). A C handler therefore never allocates or
   frees a TFOH_Payload itself: it hands `c_value` and `c_methods` to the dispatcher's
   creation function (exported with the C handler API) and receives them back in hooks.
*/
#ifndef TF_OPHANDLERS_PAYLOAD_H_
#define TF_OPHANDLERS_PAYLOAD_H_

#include <stdint.h>

#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/tf_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum TFOH_PayloadKind {
  TFOH_PAYLOAD_PYTHON = 0,  // `stack` and `value` are owned PyObject* references.
  TFOH_PAYLOAD_C = 1,       // `c_state`/`c_value` with `c_methods`.
} TFOH_PayloadKind;

// Methods a handler written in C provides for its tensor representation.
// Every function is called WITHOUT the Python GIL held and must not call Python.
typedef struct TFOH_CTensorMethods {
  // Rank of the tensor; -1 for unknown rank. Sets `status` on error.
  int (*num_dims)(void* c_value, TF_Status* status);
  // Length of axis `dim_index`; -1 for unknown. Sets `status` on error.
  int64_t (*dim)(void* c_value, int dim_index, TF_Status* status);
  // Releases `c_value`. Called exactly once, on any thread.
  void (*release)(void* c_value);
} TFOH_CTensorMethods;

typedef struct TFOH_Payload {
  TFOH_PayloadKind kind;
  // Python handlers: the handler stack (a tf_ophandlers.core.stack.HandlerStack) and the
  // handler's own representation of the tensor. Both are strong references.
  void* stack;  // PyObject*
  void* value;  // PyObject*
  // When the representation is a single TensorFlow tensor (the common case: a tensor of
  // the next stack), a handle to it that shares its buffer, so that rank and dims are
  // answered in C without the GIL. Owned; may be null.
  TFE_TensorHandle* shape_source;
  // C handlers.
  void* c_value;
  const TFOH_CTensorMethods* c_methods;
} TFOH_Payload;

#ifdef __cplusplus
}
#endif

#endif  // TF_OPHANDLERS_PAYLOAD_H_
