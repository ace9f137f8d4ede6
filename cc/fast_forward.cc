// tf-ophandlers: a forwarding level of the fast path (unwrap in C, run on the next
// stack, wrap in C). Contracts: fast_internal.h.
#define PY_SSIZE_T_CLEAN
#include "fast_internal.h"

#include <cstring>
#include <string>
#include <unordered_map>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "device.h"
#include "handler_tensor.h"
#include "native.h"
#include "native_internal.h"
#include "op.h"
#include "runtime.h"
#include "status.h"

namespace tf_ophandlers {
namespace fast {

// HandlerStack.execute's unwrap in C: `values[i]` (n_in slots) gets the physical handle
// of each input that is a Python payload of `stack` holding an EagerTensor (borrowed from
// the payload; `own[i]`, when `own` is not null, the payload's value, borrowed, else
// null), and `in[i]` itself for an input `pass` lets through. Returns false (nothing
// done) when an input needs Python: a payload of `stack` that is not an EagerTensor, or a
// foreign input needing a copy_on hook (unless `foreign` is not null: such an input then
// gets `values[i]` = `in[i]` and its index is appended to `*foreign`, for the caller to
// copy on). `in` borrowed. Never fails otherwise; no Python exception set. GIL: held.
bool UnwrapInputs(PyObject* stack, Pass pass, bool next_physical, int n_in,
                  TFE_TensorHandle** in, TFE_TensorHandle** values, PyObject** own,
                  absl::InlinedVector<int, 4>* foreign) {
  for (int i = 0; i < n_in; ++i) {
    TFOH_Payload* p = PayloadOf(in[i]);
    if (own != nullptr) own[i] = nullptr;
    if (p != nullptr && reinterpret_cast<PyObject*>(p->stack) == stack) {
      if (p->kind != TFOH_PAYLOAD_PYTHON) return false;
      if (own != nullptr) {
        PyObject* v = PayloadValue(p);  // made now if the payload has only a handle
        if (v == nullptr) {
          PyErr_Clear();
          return false;
        }
        if (!EagerTensor_CheckExact(v)) return false;
        own[i] = v;
      }
      values[i] = PayloadTensorHandle(p);
      if (values[i] == nullptr) return false;  // not a tensor: the handler's execute
    } else if (pass == Pass::kAny ||
               (pass == Pass::kPhysical && p == nullptr && next_physical)) {
      // kAny: the default copy-on moves a tensor that is not this stack's onto the next
      // stack (stack.move_onto), where the next level unwraps it, or copies it on in
      // turn: so it is passed down as it is. One that no level below owns reaches
      // PHYSICAL as a handler tensor, and RunPhysical hands the op to Python (nothing
      // done yet). kPhysical: after_execute's contract says the handler's copy_on
      // leaves a physical input unchanged.
      values[i] = in[i];
    } else if (foreign != nullptr) {
      values[i] = in[i];  // the caller copies it on
      foreign->push_back(i);
    } else {
      return false;  // a copy_on hook to run: Python
    }
  }
  return true;
}

// HandlerStack.execute's forwarding path for a handler that does not execute `type`:
// unwrap in C, run on the next stack, wrap in C. GIL: held.
bool RunForward(PyObject* stack, const Decision& d, const TFE_Op* src, const char* type,
                const char* device, int n_in, TFE_TensorHandle** in, int* num_outputs,
                TFE_TensorHandle** outputs, TF_Status* status, int depth) {
  absl::InlinedVector<TFE_TensorHandle*, 4> values(n_in);
  if (!UnwrapInputs(stack, d.default_copy_on ? Pass::kAny : Pass::kNone, false, n_in, in,
                    values.data(), nullptr)) {
    return false;
  }
  int n = *num_outputs;
  absl::InlinedVector<TFE_TensorHandle*, 4> outs(n > 0 ? n : 1, nullptr);
  if (!RunOn(d.next, src, type, device, n_in, values.data(), &n, outs.data(), status,
             depth + 1)) {
    return false;
  }
  if (TF_GetCode(status) != TF_OK) return true;
  PyObject* producer = InternedString(type);
  int done = 0;
  for (; producer != nullptr && done < n; ++done) {
    TFE_TensorHandle* h = outs[done];
    TF_DataType dt = TFE_TensorHandleDataType(h);
    bool leaves = d.transient && dt == TF_RESOURCE;  // RFC "Placement of resource handles"
    if (!leaves && d.next != g_physical) {
      TFOH_Payload* p = PayloadOf(h);
      leaves = p == nullptr || reinterpret_cast<PyObject*>(p->stack) != d.next;
    }
    if (leaves) {
      outputs[done] = h;  // ownership moves to the caller
      continue;
    }
    // No EagerTensor for the value: made only if Python asks (PayloadValue).
    outs[done] = nullptr;  // taken by the payload in every case
    outputs[done] = NewHandlerTensorHandleFromHandle(stack, h, dt, producer);
    if (outputs[done] == nullptr) break;
  }
  Py_XDECREF(producer);
  if (done < n) {  // a failure (Python exception set)
    StatusFromPyErr(status);
    for (int j = 0; j < done; ++j) TFE_DeleteTensorHandle(outputs[j]);
    for (int j = done; j < n; ++j) {
      if (outs[j] != nullptr) TFE_DeleteTensorHandle(outs[j]);
    }
    return true;
  }
  *num_outputs = n;
  return true;
}

}  // namespace fast
}  // namespace tf_ophandlers
