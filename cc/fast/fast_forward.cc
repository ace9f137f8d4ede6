// tf-ophandlers: a forwarding level of the fast path (unwrap in C, run on the next
// stack, wrap in C). Contracts: fast_internal.h.
#define PY_SSIZE_T_CLEAN
#include "fast/fast_internal.h"

#include <cstring>
#include <string>
#include <unordered_map>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "boundary/device.h"
#include "boundary/handler_tensor.h"
#include "native/native.h"
#include "native/native_internal.h"
#include "boundary/op.h"
#include "boundary/runtime.h"
#include "boundary/status.h"

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

// The most forwarding levels RunForward skips below one level (their stacks are kept in
// the outputs' payloads: payload.h `lazy`).
constexpr int kMaxSkipped = 8;

// HandlerStack.execute's forwarding path for a handler that does not execute `type`:
// unwrap in C, run on the next stack, wrap in C. Forwarding levels right below that take
// every input as it is (transient, default copy_on) are skipped: their unwrap runs here,
// the op runs on the first level below them, and the outputs' payloads record them, so
// their tensors are built only if Python asks for this level's value (PayloadValue). A
// further pass-through level then costs a decision and an unwrap per op, not a handler
// tensor per output. GIL: held.
bool RunForward(PyObject* stack, const Decision& d, const TFE_Op* src, const char* type,
                const char* device, int n_in, TFE_TensorHandle** in, int* num_outputs,
                TFE_TensorHandle** outputs, TF_Status* status, int depth) {
  absl::InlinedVector<TFE_TensorHandle*, 4> values(n_in);
  if (!UnwrapInputs(stack, d.default_copy_on ? Pass::kAny : Pass::kNone, false, n_in, in,
                    values.data(), nullptr)) {
    return false;
  }
  // The levels below to skip (borrowed: each stack keeps the next alive).
  absl::InlinedVector<PyObject*, 2> skipped;
  PyObject* run_on = d.next;
  while (run_on != g_physical && static_cast<int>(skipped.size()) < kMaxSkipped &&
         depth + 1 + static_cast<int>(skipped.size()) < kMaxDepth) {
    const Decision* nd = Decide(run_on, type);
    if (nd == nullptr || nd->kind != kForward || !nd->transient || !nd->default_copy_on) break;
    PyObject* below = nd->next;  // copied before UnwrapInputs (no Decide runs in it)
    if (!UnwrapInputs(run_on, Pass::kAny, false, n_in, values.data(), values.data(),
                      nullptr)) {
      break;  // (an input of that level that is not a tensor: it runs as a level)
    }
    skipped.push_back(run_on);
    run_on = below;
  }
  int n = *num_outputs;
  absl::InlinedVector<TFE_TensorHandle*, 4> outs(n > 0 ? n : 1, nullptr);
  if (!RunOn(run_on, src, type, device, n_in, values.data(), &n, outs.data(), status,
             depth + 1 + static_cast<int>(skipped.size()))) {
    return false;
  }
  if (TF_GetCode(status) != TF_OK) return true;
  if (depth == 0 && run_on == g_physical && skipped.size() <= 1) {
    // This thread's next ops of this type on this stack may run without the GIL.
    RememberNoGilForward(stack, type, d.transient, d.default_copy_on,
                         skipped.empty() ? nullptr : skipped[0]);
  }
  PyObject* producer = InternedString(type);
  PyObject* lazy = nullptr;  // the skipped stacks (new reference), shared by the outputs
  if (skipped.size() == 1) {
    lazy = skipped[0];
    Py_INCREF(lazy);
  } else if (skipped.size() > 1) {
    lazy = PyTuple_New(static_cast<Py_ssize_t>(skipped.size()));
    for (size_t i = 0; lazy != nullptr && i < skipped.size(); ++i) {
      Py_INCREF(skipped[i]);
      PyTuple_SET_ITEM(lazy, i, skipped[i]);
    }
    if (lazy == nullptr) {  // no memory: nothing wrapped yet
      StatusFromPyErr(status);
      Py_XDECREF(producer);
      for (int j = 0; j < n; ++j) TFE_DeleteTensorHandle(outs[j]);
      return true;
    }
  }
  int done = 0;
  for (; producer != nullptr && done < n; ++done) {
    TFE_TensorHandle* h = outs[done];
    TF_DataType dt = TFE_TensorHandleDataType(h);
    // RFC "Placement of resource handles": a transient level leaves them on its next
    // stack (every skipped level is transient, so they leave from the lowest one up).
    bool leaves = (d.transient || !skipped.empty()) && dt == TF_RESOURCE;
    if (!leaves && run_on != g_physical) {
      TFOH_Payload* p = PayloadOf(h);
      leaves = p == nullptr || reinterpret_cast<PyObject*>(p->stack) != run_on;
    }
    if (leaves) {
      outputs[done] = h;  // ownership moves to the caller
      continue;
    }
    // No EagerTensor for the value: made only if Python asks (PayloadValue).
    outs[done] = nullptr;  // taken by the payload in every case
    outputs[done] = NewHandlerTensorHandleFromHandle(stack, h, dt, producer, lazy);
    if (outputs[done] == nullptr) break;
  }
  Py_XDECREF(producer);
  Py_XDECREF(lazy);
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
