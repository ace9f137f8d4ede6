/* tf-ophandlers C++ boundary: the Op Python type (`_C.OpBase`, subclassed by
   tf_ophandlers.core.op.Op) and running an Op on a device (internal header).
   Implementation: op.cc.

   An `Op` describes one operation a handler is asked to execute: its type, attributes,
   requested device and expected outputs. Inside the execute callback the Op *borrows*
   TensorFlow's `const TFE_Op*` (no copy: the pass-through path pays nothing for
   attributes). When the callback returns, an Op that Python still references (a tape
   that recorded it, a lazy trace) *detaches*: it takes its own copy of the attributes
   (EndBorrow; a tape's record path instead hands it the physical TFE_Op that ran, with
   its inputs released: fast_record.cc). An Op is therefore always safe to keep.
*/
#ifndef TF_OPHANDLERS_OP_H_
#define TF_OPHANDLERS_OP_H_

#include <Python.h>

#include <vector>

#include "absl/container/inlined_vector.h"
#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/eager/c_api_experimental.h"
#include "kernels/op_outputs.h"

namespace tf_ophandlers {

struct OpObject {
  PyObject_HEAD
  const TFE_Op* borrowed;  // Valid only while the execute callback runs. Not owned.
  TFE_Op* owned;           // Owned attribute template (no inputs). May be null.
  PyObject* type;          // str, owned.
  PyObject* device;        // str, owned: the device TensorFlow recorded for the op.
  int num_outputs;         // Expected number of flat outputs (-1: unknown).
  PyObject* output_dtypes; // tuple[int] of TF_DataType, None if unknown; owned, lazy.
  PyObject* dict;          // __dict__ for the Python subclass; owned.
};

// The static type `_C.OpBase`. Usable only after ReadyOpBaseType() returned true.
extern PyTypeObject OpBaseType;

// Fills in and readies OpBaseType. Returns false with a Python exception set on failure.
// Called once, from PyInit__C. GIL: must be held.
bool ReadyOpBaseType();

// Returns a new Op of the registered subclass (g_op_type) with neither a borrowed nor an
// owned attribute source: the caller sets one. `device` may be null (""). Returns a new
// reference, or null with a Python exception set. GIL: must be held; g_op_type set.
OpObject* NewOpObject(const char* type, const char* device, int num_outputs);

// Ends the borrow of `op` (no-op if it does not borrow): an Op still referenced from
// Python beyond the caller's reference copies the attributes it borrowed into a TFE_Op it
// owns, created in `ctx`. A failed copy leaves the Op without attributes (later attribute
// reads raise). Never sets a Python exception. GIL: must be held.
void EndBorrow(OpObject* op, TFE_Context* ctx);

// Owns the caller's reference to an Op (`op`, may be null) that may borrow the attributes
// of the op being executed: when it dies, EndBorrow(op, ctx) ends the borrow, then the
// reference is released, as every callback that makes an Op must do before it returns.
// GIL: must be held wherever a non-empty one dies. Move-only in effect (not copyable).
class OpRef {
 public:
  OpRef() = default;
  OpRef(OpObject* op, TFE_Context* ctx) : op_(op), ctx_(ctx) {}
  OpRef(const OpRef&) = delete;
  OpRef& operator=(const OpRef&) = delete;
  ~OpRef() { reset(); }
  OpObject* get() const { return op_; }
  PyObject* object() const { return reinterpret_cast<PyObject*>(op_); }
  explicit operator bool() const { return op_ != nullptr; }
  // Ends the held Op's borrow and releases it, then holds `op` (created in `ctx`).
  void reset(OpObject* op = nullptr, TFE_Context* ctx = nullptr) {
    OpObject* old = op_;
    TFE_Context* old_ctx = ctx_;
    op_ = op;
    ctx_ = ctx;
    if (old != nullptr) {
      EndBorrow(old, old_ctx);
      Py_DECREF(reinterpret_cast<PyObject*>(old));
    }
  }

 private:
  OpObject* op_ = nullptr;
  TFE_Context* ctx_ = nullptr;
};

// A TFE_Op no longer used (its inputs may still be attached: TFE_OpReset releases them),
// kept for reuse by TakePooledOp in a bounded pool, or deleted. TakePooledOp returns one
// (to TFE_OpReset before use; owned by the caller) or null. GIL: must be held.
void PoolOp(TFE_Op* op);
TFE_Op* TakePooledOp();

// A TFE_Op for `type` on `device` (may be "") in the current eager context, g_ctx:
// `reuse` reset with TFE_OpReset (as TensorFlow's own fast path reuses one: it keeps the
// allocation and skips re-parsing an unchanged device name), else a new one (TFE_NewOp,
// TFE_OpSetDevice). `reuse` (owned by the caller, or null: a thread's cached op, a
// pooled one) is consumed in every case: reset, deleted if the reset fails, or dropped
// without deleting it when it was made in an earlier eager context (replaced by
// context._reset_context, ContextChanged; that context may be gone, and a reused op would
// run there). Returns an op owned by the caller with `status` TF_OK, or null with
// `status` set. GIL: not needed (g_ctx changes only with the GIL held, between ops).
TFE_Op* ResetOrNewOp(TFE_Op* reuse, const char* type, const char* device, TF_Status* status);

// The eager context was replaced (context._reset_context): drops the pooled ops of
// `old_ctx` (deleted: the caller keeps that context alive during the call; ops of older
// contexts are dropped without deleting). GIL: must be held.
void ForgetPooledOps(TFE_Context* old_ctx);

// Returns the attribute source of `op` (borrowed or owned; not transferred), or null with
// a RuntimeError set if it has neither (which indicates a bug). GIL: must be held.
const TFE_Op* OpAttrSource(OpObject* op);

// Executes `op` (its type and attributes) on `inputs` (a sequence of EagerTensors; handler
// tensors among them are first copied off their stack with dispatch.copy_from_device), on
// `device` ("" lets TensorFlow place it; inside a callback always name one). Returns a
// new list of new EagerTensors, or null with a Python exception set (the original handler
// exception where the failure came from a nested handler).
// GIL: must be held; it is released around TFE_Execute.
PyObject* ExecuteOp(OpObject* op, PyObject* inputs, const char* device);

}  // namespace tf_ophandlers

#endif  // TF_OPHANDLERS_OP_H_
