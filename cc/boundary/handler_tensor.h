/* tf-ophandlers C++ boundary: handler tensors and their payloads (internal header).
   Implementation: handler_tensor.cc. Payload layout: include/tf_ophandlers/payload.h.

   A handler tensor is a custom-device TFE_TensorHandle on the dispatcher device whose
   payload holds (stack, value). TensorFlow asks it for its rank, dims and summary through
   the payload methods below, which call the handler's `num_dims`, `dim` and
   `tensor_debug_string` hooks (through tf_ophandlers.core.dispatch) unless the value is a
   tensor whose shape can be read in C. A handler with `value_shape` answers the whole
   shape at the rank query; the dims that follow are read from a one-entry cache
   (handler_tensor.cc: GIL held to write it, cleared when its payload is freed).
*/
#ifndef TF_OPHANDLERS_HANDLER_TENSOR_H_
#define TF_OPHANDLERS_HANDLER_TENSOR_H_

#include <Python.h>

#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/eager/c_api_experimental.h"
#include "tf_ophandlers/payload.h"

namespace tf_ophandlers {

// Creates a handler tensor on the dispatcher device whose payload refers to `stack`,
// `value` and `producer` (a str naming the op that produced it, or null; all borrowed: the
// payload takes new references). `dtype` must be valid (ValidDataType); the caller checks
// it and names the hook that gave it. Returns a new EagerTensor, or null with a Python
// exception set (the payload is then already released).
// GIL: must be held. Also drains the pending-free queue (DrainPending).
// `shape_from_value`: answer rank and dims from `value` in C when it is an EagerTensor
// (false: always ask the handler's num_dims/dim hooks).
PyObject* WrapHandlerTensor(PyObject* stack, PyObject* value, TF_DataType dtype,
                            PyObject* producer, bool shape_from_value = true);

// As WrapHandlerTensor, but returns the new TFE_TensorHandle (owned by the caller)
// instead of an EagerTensor. Null with a Python exception set on failure.
TFE_TensorHandle* NewHandlerTensorHandle(PyObject* stack, PyObject* value, TF_DataType dtype,
                                         PyObject* producer, bool shape_from_value);

// As NewHandlerTensorHandle for a value that is the physical-or-next-stack tensor
// `value`, without a Python object for it: `value` (owned: taken in every case, deleted
// on failure) becomes the payload's shape_source and its value is made only when
// something asks for it (PayloadValue). Rank and dims are answered from `value` in C.
// The C paths' outputs (a forwarding level, a C/C++ handler) use it: most outputs of a
// pass-through level never need a Python object. Null with a Python exception set on
// failure. GIL: must be held. Also drains the pending-free queue.
TFE_TensorHandle* NewHandlerTensorHandleFromHandle(PyObject* stack, TFE_TensorHandle* value,
                                                   TF_DataType dtype, PyObject* producer,
                                                   PyObject* lazy = nullptr);
// (`lazy`, borrowed, may be null: the payload's forwarding levels skipped in between,
// payload.h; the payload takes a reference.)

// The payload's value (borrowed; `p` kind TFOH_PAYLOAD_PYTHON), made on first use for a
// payload created from a handle (an EagerTensor sharing shape_source's tensor, kept in
// the payload from then on). Null with a Python exception set when it cannot be made.
// GIL: must be held (the payload is only ever changed with it).
PyObject* PayloadValue(TFOH_Payload* p);

// The TensorFlow handle of the payload's value when it is a single eager tensor
// (borrowed: valid while the payload is): shape_source for a payload created from a
// handle, the EagerTensor's handle otherwise; null for another representation or kind.
// Never fails; makes no Python object. GIL: must be held.
TFE_TensorHandle* PayloadTensorHandle(TFOH_Payload* p);

// Returns the payload of `handle` (borrowed: valid while `handle` is) if it lives on the
// dispatcher device, else null. Never sets an error. GIL: not needed.
TFOH_Payload* PayloadOf(TFE_TensorHandle* handle);

// Releases the Python references of payloads whose handles were deleted on threads that
// could not take the GIL (TensorFlow executor threads), and frees them.
// GIL: must be held. Never fails.
void DrainPending();

// ---- handler tensors made without the GIL (the no-GIL path, native_nogil.cc) ----------
//
// A StackAnchor holds one Python reference to a stack for a count of users: the thread
// plan that made it (native_nogil.cc, one count until the plan is dropped) and each
// payload made through it. Counts change without the GIL except the last release, which
// drops the stack's reference and so needs the GIL: a release that would be the last
// one without it is left to the deallocator's GIL paths. While a plan holds its count,
// payloads can be added without the GIL.
struct StackAnchor;

// A new anchor of `stack` (borrowed; the anchor takes a reference) with one count, the
// caller's. Never fails (C++ new). GIL: must be held.
StackAnchor* NewStackAnchor(PyObject* stack);

// Drops one count; the last drops the stack's reference and frees the anchor. GIL: must
// be held.
void ReleaseStackAnchor(StackAnchor* anchor);

// A handler tensor of the anchor's stack whose payload holds `value` (owned: taken in
// every case) as its shape_source and no Python object, like
// NewHandlerTensorHandleFromHandle; `producer` (an op type str InternedString keeps for
// the process) and `lazy` (null, or the one skipped forwarding level: the stack's next
// stack, alive as long as the stack) are borrowed for the payload's life. The payload
// takes a count of `anchor`, which the caller must hold (a count of its own). Returns
// null with `status` set on failure. GIL: not needed.
TFE_TensorHandle* NewAnchoredHandle(StackAnchor* anchor, TFE_TensorHandle* value,
                                    TF_DataType dtype, PyObject* producer, PyObject* lazy,
                                    TF_Status* status);

// Whether payloads may be queued for DrainPending (the no-GIL path leaves the op to the
// GIL path, which drains them). GIL: not needed.
bool PendingQueued();

// Maximum rank of a TensorFlow tensor (TensorShape's limit); num_dims results above it
// are rejected.
constexpr int kMaxRank = 254;

}  // namespace tf_ophandlers

#endif  // TF_OPHANDLERS_HANDLER_TENSOR_H_
