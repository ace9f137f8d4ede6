// tf-ophandlers: the record path of the fast path (OpHandler.after_execute; a tape).
// Contracts: fast_internal.h.
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
#include "handlers/gradient_tape/tape_record.h"

namespace tf_ophandlers {
namespace fast {

namespace {

// Whether `handler.after_execute` is the C recording of a tape: its class's (looked up in
// the type cache, for a class with the generic attribute lookup) and not replaced on the
// instance. Never sets an exception. GIL: held.
bool IsTape(PyObject* handler) {
  if (Py_TYPE(handler)->tp_getattro != PyObject_GenericGetAttr) return false;
  PyObject* m = _PyType_Lookup(Py_TYPE(handler), s_after_execute);  // borrowed
  if (m == nullptr || !PyInstanceMethod_Check(m) ||
      !IsTapeAfterExecute(PyInstanceMethod_GET_FUNCTION(m))) {
    return false;
  }
  PyObject* dict = PyObject_GenericGetDict(handler, nullptr);
  bool own = dict == nullptr || !PyDict_Check(dict) ||
             PyDict_GetItemWithError(dict, s_after_execute) != nullptr;
  Py_XDECREF(dict);
  PyErr_Clear();
  return !own;
}

}  // namespace

// ---- kRecord: a handler that records what ran (OpHandler.after_execute, a tape) -------
//
// HandlerStack.execute for a handler that defines `after_execute`: inputs on the stack
// are unwrapped in C (a physical input, when the next stack is PHYSICAL, is passed as it
// is: after_execute's contract says the handler's copy_on leaves it unchanged), the op
// runs on the next stack (RunOn, so further levels stay in C), then one Python call,
// `after_execute(op, inputs, outputs)` with the representations, in the hook's frame;
// the outputs are then wrapped as RunForward does.
//
// Over a Python execute hook (the next stack's decision is kHook: a tape inside
// oh.vectorized_map) the next level runs from C too (RunHook), with exactly the values
// the Python path hands to `next.execute(op, values)`: this stack's unwrapped inputs and,
// on the op's first stack (depth 0, where no forwarding level's copy rules came first),
// inputs from elsewhere copied on as HandlerStack.execute does (`wants_copy` when copies
// defer, then the stack's `_copy_on_value`, which runs the handler's copy_on hook; a
// tape records a CopyOn there). Returns false (nothing done) for inputs that need a
// copy_on hook in any other case. After a copy-on or the op ran, always handled; an
// exception of a hook reaches the user through `status` (StatusFromPyErr). GIL: held.
bool RunRecord(PyObject* stack, const Decision& d, const TFE_Op* src, const char* type,
               const char* device, int n_in, TFE_TensorHandle** in, int* num_outputs,
               TFE_TensorHandle** outputs, TF_Status* status, int depth) {
  absl::InlinedVector<TFE_TensorHandle*, 4> values(n_in);
  absl::InlinedVector<PyObject*, 4> own(n_in, nullptr);  // borrowed payload values
  // The next level when it is a Python execute hook (copied: Decide may clear the cache).
  Decision hook;
  bool over_hook = false;
  if (d.next != g_physical) {
    const Decision* nd = Decide(d.next, type);
    if (nd != nullptr && (nd->kind == kHook || nd->kind == kLazy)) {  // (Lazy: its hook)
      hook = *nd;
      over_hook = true;
    }
  }
  // Inputs from elsewhere to copy on in C (over a hook, on the op's first stack only):
  // UnwrapInputs lists them instead of declining.
  absl::InlinedVector<int, 4> foreign;
  if (!UnwrapInputs(stack, Pass::kPhysical, d.next == g_physical, n_in, in, values.data(),
                    own.data(), over_hook && depth == 0 ? &foreign : nullptr)) {
    return false;
  }
  const int capacity = *num_outputs;
  int n = capacity;
  absl::InlinedVector<TFE_TensorHandle*, 4> outs(n > 0 ? n : 1, nullptr);
  absl::InlinedVector<bool, 4> leaves(n > 0 ? n : 1, false);
  absl::InlinedVector<PyObject*, 4> copied(n_in, nullptr);  // owned: copied-on inputs
  PyObject* py_in = nullptr;
  PyObject* py_out = nullptr;
  PyObject* handler = nullptr;
  PyObject* fn = nullptr;
  PyObject* r = nullptr;
  PyObject* producer = nullptr;
  OpObject* op = nullptr;
  TFE_Op* ran = nullptr;  // the physical op that ran, when handed over (KeepNextPhysicalOp)
  int done = 0;
  if (!foreign.empty()) {
    // HandlerStack.execute's copy-on, before the op runs (nothing was done before).
    op = NewOpObject(type, device, capacity);
    if (op == nullptr) goto fail;
    op->borrowed = src;
    for (int i : foreign) {
      if (!d.copy_all) {  // (the tape defers its copies to the hook's handler)
        if (handler == nullptr) {
          handler = PyObject_GetAttr(stack, s_handler);
          if (handler == nullptr) goto fail;
        }
        // The tape's copy-on would only pass the input on (tape_record.h): the hook
        // copies it on itself (RunHook), without a tape frame or a tensor made and
        // unwrapped at once; the record keeps the input as it came.
        int through = IsTape(handler) ? TapeCopiesThrough(handler, d.next, in[i]) : 0;
        if (through < 0) goto fail;
        if (through == 1) continue;
      }
      PyObject* t = native_internal::EagerTensorSharing(in[i]);
      if (t == nullptr) goto fail;
      if (!d.copy_all) {
        int yes = WantsCopy(stack, reinterpret_cast<PyObject*>(op), i, in[i]);
        if (yes <= 0) {
          if (yes < 0) {
            Py_DECREF(t);
            goto fail;
          }
          copied[i] = t;  // passed down as it is
          continue;
        }
      }
      PyObject* moved = PyObject_CallMethodOneArg(stack, s_copy_on_value, t);
      Py_DECREF(t);
      if (moved == nullptr) goto fail;
      copied[i] = moved;
      if (!EagerTensor_CheckExact(moved)) {
        PyErr_Format(PyExc_TypeError,
                     "tf_ophandlers: the copy_on hook of %R returned a %s for input %d of op "
                     "%s, not a tensor of the next stack (a handler with after_execute "
                     "represents a tensor by a tensor of the next stack)",
                     stack, Py_TYPE(moved)->tp_name, i, type);
        goto fail;
      }
      values[i] = EagerTensor_Handle(moved);
    }
  }
  if (over_hook) {
    RunHook(d.next, hook, src, type, device, n_in, values.data(), &n, outs.data(), status);
  } else if (d.next == g_physical) {
    // The op's attributes, when a record keeps the Op, are those of the physical op that
    // ran: it is handed over below instead of copied (EndBorrow).
    KeepNextPhysicalOp();
    bool ran_here = RunPhysical(src, type, n_in, values.data(), &n, outs.data(), status);
    ran = TakeKeptPhysicalOp();
    if (!ran_here) {
      if (op != nullptr) {
        EndBorrow(op, g_ctx);
        Py_DECREF(op);
      }
      return false;
    }
  } else if (!RunOn(d.next, src, type, device, n_in, values.data(), &n, outs.data(), status,
                    depth + 1)) {
    // Nothing done (no copy-on happened: `foreign` is only filled over a hook).
    if (op != nullptr) {
      EndBorrow(op, g_ctx);
      Py_DECREF(op);
    }
    return false;
  }
  if (TF_GetCode(status) != TF_OK) {
    n = 0;  // no outputs to release
    goto cleanup;
  }
  // From here on the op ran: always handled. Python views of inputs and outputs.
  py_in = PyList_New(n_in);
  py_out = py_in != nullptr ? PyList_New(n) : nullptr;
  if (py_out == nullptr) goto fail;
  for (int i = 0; i < n_in; ++i) {
    PyObject* v = own[i] != nullptr ? own[i] : copied[i];
    if (v != nullptr) {
      Py_INCREF(v);
    } else {
      v = native_internal::EagerTensorSharing(in[i]);
      if (v == nullptr) goto fail;
    }
    PyList_SET_ITEM(py_in, i, v);
  }
  for (int j = 0; j < n; ++j) {
    TFE_TensorHandle* h = outs[j];
    TF_DataType dt = TFE_TensorHandleDataType(h);
    bool leave = d.transient && dt == TF_RESOURCE;  // RFC "Placement of resource handles"
    if (!leave && d.next != g_physical) {
      TFOH_Payload* p = PayloadOf(h);
      leave = p == nullptr || reinterpret_cast<PyObject*>(p->stack) != d.next;
    }
    leaves[j] = leave;
    PyObject* v;
    if (leave) {
      v = native_internal::EagerTensorSharing(h);  // the handle itself goes to the caller
    } else {
      v = EagerTensorFromHandle(h, false);  // owns `h` on success
      if (v != nullptr) outs[j] = nullptr;
    }
    if (v == nullptr) goto fail;
    PyList_SET_ITEM(py_out, j, v);
  }
  if (op == nullptr) {
    op = NewOpObject(type, device, capacity);
    if (op == nullptr) goto fail;
    op->borrowed = src;
  }
  if (handler == nullptr) handler = PyObject_GetAttr(stack, s_handler);
  if (handler == nullptr) goto fail;
  if (IsTape(handler)) {
    // An oh.GradientTape's C recording: no hook frame, no bound method (tape_record.h).
    r = TapeAfterExecuteDirect(handler, stack, d.next, reinterpret_cast<PyObject*>(op), py_in,
                               py_out);
  } else {
    fn = PyObject_GetAttr(handler, s_after_execute);
    if (fn == nullptr) goto fail;
    r = CallHook(stack, d.next, fn, reinterpret_cast<PyObject*>(op), py_in, py_out);
  }
  if (r == nullptr) goto fail;
  // Wrap (as RunForward does).
  producer = InternedString(type);
  if (producer == nullptr) goto fail;
  for (; done < n; ++done) {
    if (leaves[done]) {
      outputs[done] = outs[done];  // ownership moves to the caller
      outs[done] = nullptr;
      continue;
    }
    PyObject* value = PyList_GET_ITEM(py_out, done);
    outputs[done] = NewHandlerTensorHandle(stack, value,
                                           TFE_TensorHandleDataType(EagerTensor_Handle(value)),
                                           producer, true);
    if (outputs[done] == nullptr) goto fail;
  }
  *num_outputs = n;
  goto cleanup;
fail:
  StatusFromPyErr(status);
  for (int j = 0; j < done; ++j) TFE_DeleteTensorHandle(outputs[j]);
cleanup:
  for (int j = 0; j < n; ++j) {
    if (outs[j] != nullptr) TFE_DeleteTensorHandle(outs[j]);
  }
  if (op != nullptr) {
    if (ran != nullptr && op->borrowed != nullptr && op->owned == nullptr &&
        Py_REFCNT(op) > 1) {
      op->owned = ran;  // kept (by a record): the attributes it ran with
      ran = nullptr;
    }
    EndBorrow(op, g_ctx);
    Py_DECREF(op);
  }
  ReturnPhysicalOp(ran);
  for (PyObject* c : copied) Py_XDECREF(c);
  Py_XDECREF(producer);
  Py_XDECREF(r);
  Py_XDECREF(fn);
  Py_XDECREF(handler);
  Py_XDECREF(py_out);
  Py_XDECREF(py_in);
  return true;
}

}  // namespace fast
}  // namespace tf_ophandlers
