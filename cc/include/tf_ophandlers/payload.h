/* tf-ophandlers: the payload carried by every tensor that lives on a handler stack.

   Every handler tensor is a TensorFlow custom-device tensor of the single dispatcher
   device `/job:localhost/replica:0/task:0/device:OPHANDLER:0` (DESIGN.md decision 1).
   Its device memory (`TFE_TensorHandleDevicePointer`) is a `TFOH_Payload`.

   Every payload has kind TFOH_PAYLOAD_PYTHON, also for handlers written in C/C++ against
   tf_ophandlers/handler.h: their handler is a Python object (a NativeHandler) and their
   representation an EagerTensor of the next stack, so `stack` and `value` are Python
   objects for every handler (a C/C++ handler's representation with data of its own, ABI
   version 3 `tensor_set_data`, is a `_C.NativeValue` holding the EagerTensor). `kind` is
   the field a later layout would extend, and code reading a payload must check it. Handler
   libraries never see payloads: they get TFOH_Tensor handles (handler.h).

   Ownership: the dispatcher (cc/boundary/handler_tensor.cc, WrapHandlerTensor) allocates every
   payload (C++ new) when it creates a handler tensor; the TFE_TensorHandle that carries
   it owns it, and the handle's deallocator frees it (C++ delete) after releasing its
   Python references with the GIL (immediately, or, on a thread that must not wait for
   the GIL, at the next dispatcher entry that holds it). Nothing outside the dispatcher
   allocates, frees or modifies a payload.
*/
#ifndef TF_OPHANDLERS_PAYLOAD_H_
#define TF_OPHANDLERS_PAYLOAD_H_

#include <stdint.h>

#include "tensorflow/c/eager/c_api.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum TFOH_PayloadKind {
  TFOH_PAYLOAD_PYTHON = 0,  // `stack`, `value` (and `producer`) are PyObject* references.
} TFOH_PayloadKind;

typedef struct TFOH_Payload {
  TFOH_PayloadKind kind;
  // The handler stack (a tf_ophandlers.core.stack.HandlerStack) and the handler's own
  // representation of the tensor. Both are strong references (`stack`: unless `anchor` is
  // set, below); `stack` is never null.
  // `value` is null while the representation is the eager tensor `shape_source` and no
  // one has asked for a Python object of it yet (the C paths' outputs: the dispatcher
  // makes it on first use, with the GIL held, and keeps it).
  void* stack;  // PyObject*
  void* value;  // PyObject*
  // When the representation is a single TensorFlow tensor (the common case: a tensor of
  // the next stack), a handle to it that shares its buffer, so that rank and dims are
  // answered in C without the GIL. Owned; may be null.
  TFE_TensorHandle* shape_source;
  // The type (a str) of the op whose output this tensor is, for error messages about the
  // tensor's hooks (num_dims, dim); null when it was created outside an op's execution
  // (a copy onto the stack). Strong reference.
  void* producer;  // PyObject*
  // Forwarding levels skipped by the C fast path (RunForward), or null: the value is then,
  // when made, the tensor of those stacks over `shape_source` (a HandlerStack, or a tuple
  // of them from the highest down), built at the first PayloadValue exactly as the
  // skipped levels would have wrapped it; until then C paths unwrap `shape_source`, the
  // tensor those levels' default copy_on passes through. Strong reference; cleared once
  // the value is made.
  void* lazy;  // PyObject*
  // Null, or the dispatcher's hold on `stack` for a payload made without the GIL (the
  // no-GIL path, cc/native/native_nogil.cc): `stack` is then not a reference of the payload (the
  // hold keeps one for all its payloads), `producer` is borrowed from the dispatcher's
  // interned op types, which live for the process, and `lazy` (a single stack, the next
  // one) is borrowed too (the stack keeps it). Opaque (tf_ophandlers::StackAnchor).
  void* anchor;
} TFOH_Payload;

#ifdef __cplusplus
}
#endif

#endif  // TF_OPHANDLERS_PAYLOAD_H_
