// tf-ophandlers: the after_execute path of the fast path (OpHandler.after_execute: a
// handler that records what ran below it).
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
#include "boundary/owners.h"
#include "boundary/runtime.h"
#include "boundary/status.h"

namespace tf_ophandlers {
namespace fast {

namespace {

// Whether `handler.after_execute` is implemented in C (the hook slot's after_execute_c):
// its class's (looked up in the type cache, for a class with the generic attribute
// lookup) passes after_execute_is_c and is not replaced on the instance. Never sets an
// exception. GIL: held.
bool AfterExecuteInC(PyObject* handler) {
  if (g_handler_hooks.after_execute_is_c == nullptr) return false;
  if (Py_TYPE(handler)->tp_getattro != PyObject_GenericGetAttr) return false;
  PyObject* m = _PyType_Lookup(Py_TYPE(handler), s_after_execute);  // borrowed
  if (m == nullptr || !PyInstanceMethod_Check(m) ||
      !g_handler_hooks.after_execute_is_c(PyInstanceMethod_GET_FUNCTION(m))) {
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

// ---- kAfterExecute: a handler that records what ran (OpHandler.after_execute) --------
//
// HandlerStack.execute for a handler that defines `after_execute`: inputs on the stack
// are unwrapped in C (a physical input, when the next stack is PHYSICAL, is passed as it
// is: after_execute's contract says the handler's copy_on leaves it unchanged), the op
// runs on the next stack (RunOn, so further levels stay in C), then one Python call,
// `after_execute(op, inputs, outputs)` with the representations, in the hook's frame;
// the outputs are then wrapped as RunForward does.
//
// Over a Python execute hook (the next stack's decision is kHook or kPlugin: a recording
// handler inside one that executes ops itself) the next level runs from C too (RunHook), with exactly the values
// the Python path hands to `next.execute(op, values)`: this stack's unwrapped inputs and,
// on the op's first stack (depth 0, where no forwarding level's copy rules came first),
// inputs from elsewhere copied on as HandlerStack.execute does (`wants_copy` when copies
// defer, then the stack's `_copy_on_value`, which runs the handler's copy_on hook, which
// may record a CopyOn). Returns false (nothing done) for inputs that need a
// copy_on hook in any other case. After a copy-on or the op ran, always handled; an
// exception of a hook reaches the user through `status` (StatusFromPyErr). GIL: held.
bool RunAfterExecute(PyObject* stack, const Decision& d, const TFE_Op* src, const char* type,
                     const char* device, int n_in, TFE_TensorHandle** in, int* num_outputs,
                     TFE_TensorHandle** outputs, TF_Status* status, int depth) {
  absl::InlinedVector<TFE_TensorHandle*, 4> values(n_in);
  absl::InlinedVector<PyObject*, 4> own(n_in, nullptr);  // borrowed payload values
  // The next level when it is a Python execute hook (copied: Decide may clear the cache).
  Decision hook;
  bool over_hook = false;
  if (d.next != g_physical) {
    const Decision* nd = Decide(d.next, type);
    if (nd != nullptr && (nd->kind == kHook || nd->kind == kPlugin)) {  // (kPlugin: its hook)
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
  // Released in the reverse order of these declarations: the outputs not handed on, the
  // Op (taking the physical op that ran when a record keeps it), the physical op, the
  // copied-on inputs, then the Python values.
  PyRef py_in;
  PyRef py_out;
  PyRef handler;
  PyRef fn;
  PyRef r;
  PyRef producer;
  absl::InlinedVector<PyRef, 4> copied(n_in);  // copied-on inputs
  struct RanOp {  // the physical op that ran, when handed over (KeepNextPhysicalOp)
    TFE_Op* op = nullptr;
    ~RanOp() { ReturnPhysicalOp(op); }
  } ran;
  struct RecordOp {  // the Op after_execute gets; keeps `ran` when a record keeps it
    OpObject* op = nullptr;
    RanOp* ran;
    ~RecordOp() {
      if (op == nullptr) return;
      if (ran->op != nullptr && op->borrowed != nullptr && op->owned == nullptr &&
          Py_REFCNT(op) > 1) {
        op->owned = ran->op;  // kept (by a record): the attributes it ran with
        ran->op = nullptr;
      }
      EndBorrow(op, g_ctx);
      Py_DECREF(op);
    }
  } rec{nullptr, &ran};
  struct Outs {  // outputs that ran and were not handed on
    absl::InlinedVector<TFE_TensorHandle*, 4>* outs;
    int* n;
    ~Outs() {
      for (int j = 0; j < *n; ++j) {
        if ((*outs)[j] != nullptr) TFE_DeleteTensorHandle((*outs)[j]);
      }
    }
  } unused{&outs, &n};
  int done = 0;
  auto fail = [&]() {
    StatusFromPyErr(status);
    for (int j = 0; j < done; ++j) TFE_DeleteTensorHandle(outputs[j]);
    return true;
  };
  if (!foreign.empty()) {
    // HandlerStack.execute's copy-on, before the op runs (nothing was done before).
    rec.op = NewOpObject(type, device, capacity);
    if (rec.op == nullptr) return fail();
    rec.op->borrowed = src;
    for (int i : foreign) {
      if (!d.copy_all) {  // (the handler defers its copies to the hook's handler)
        if (!handler) {
          handler.reset(PyObject_GetAttr(stack, s_handler));
          if (!handler) return fail();
        }
        // The handler's copy-on would only pass the input on (the hook slot's
        // copies_through says so): the hook copies it on itself (RunHook), without a
        // frame of this handler or a tensor made and unwrapped at once; the record keeps
        // the input as it came.
        int through =
            AfterExecuteInC(handler.get()) && g_handler_hooks.copies_through != nullptr
                ? g_handler_hooks.copies_through(handler.get(), d.next, in[i])
                : 0;
        if (through < 0) return fail();
        if (through == 1) continue;
      }
      PyRef t(native_internal::EagerTensorSharing(in[i]));
      if (!t) return fail();
      if (!d.copy_all) {
        int yes = WantsCopy(stack, reinterpret_cast<PyObject*>(rec.op), i, in[i]);
        if (yes < 0) return fail();
        if (yes == 0) {
          copied[i] = std::move(t);  // passed down as it is
          continue;
        }
      }
      PyRef moved(PyObject_CallMethodOneArg(stack, s_copy_on_value, t.get()));
      t.reset();
      if (!moved) return fail();
      PyObject* m = moved.get();
      copied[i] = std::move(moved);
      if (!EagerTensor_CheckExact(m)) {
        PyErr_Format(PyExc_TypeError,
                     "tf_ophandlers: the copy_on hook of %R returned a %s for input %d of op "
                     "%s, not a tensor of the next stack (a handler with after_execute "
                     "represents a tensor by a tensor of the next stack)",
                     stack, Py_TYPE(m)->tp_name, i, type);
        return fail();
      }
      values[i] = EagerTensor_Handle(m);
    }
  }
  if (over_hook) {
    RunHook(d.next, hook, src, type, device, n_in, values.data(), &n, outs.data(), status);
  } else if (d.next == g_physical) {
    // The op's attributes, when a record keeps the Op, are those of the physical op that
    // ran: it is handed over below instead of copied (EndBorrow).
    KeepNextPhysicalOp();
    bool ran_here = RunPhysical(src, type, n_in, values.data(), &n, outs.data(), status);
    ran.op = TakeKeptPhysicalOp();
    if (!ran_here) return false;  // (nothing ran: no outputs, no physical op kept)
  } else if (!RunOn(d.next, src, type, device, n_in, values.data(), &n, outs.data(), status,
                    depth + 1)) {
    // Nothing done (no copy-on happened: `foreign` is only filled over a hook).
    return false;
  }
  if (TF_GetCode(status) != TF_OK) {
    n = 0;  // no outputs to release
    return true;
  }
  // From here on the op ran: always handled. Python views of inputs and outputs.
  py_in.reset(PyList_New(n_in));
  py_out.reset(py_in ? PyList_New(n) : nullptr);
  if (!py_out) return fail();
  for (int i = 0; i < n_in; ++i) {
    PyObject* v = own[i] != nullptr ? own[i] : copied[i].get();
    if (v != nullptr) {
      Py_INCREF(v);
    } else {
      v = native_internal::EagerTensorSharing(in[i]);
      if (v == nullptr) return fail();
    }
    PyList_SET_ITEM(py_in.get(), i, v);
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
    if (v == nullptr) return fail();
    PyList_SET_ITEM(py_out.get(), j, v);
  }
  if (rec.op == nullptr) {
    rec.op = NewOpObject(type, device, capacity);
    if (rec.op == nullptr) return fail();
    rec.op->borrowed = src;
  }
  if (!handler) handler.reset(PyObject_GetAttr(stack, s_handler));
  if (!handler) return fail();
  PyObject* op = reinterpret_cast<PyObject*>(rec.op);
  if (AfterExecuteInC(handler.get())) {
    // The C implementation of after_execute (the hook slot): no hook frame, no bound method.
    r.reset(g_handler_hooks.after_execute_c(handler.get(), stack, d.next, op, py_in.get(),
                                            py_out.get()));
  } else {
    fn.reset(PyObject_GetAttr(handler.get(), s_after_execute));
    if (!fn) return fail();
    r.reset(CallHook(stack, d.next, fn.get(), op, py_in.get(), py_out.get()));
  }
  if (!r) return fail();
  // Wrap (as RunForward does).
  producer.reset(InternedString(type));
  if (!producer) return fail();
  for (; done < n; ++done) {
    if (leaves[done]) {
      outputs[done] = outs[done];  // ownership moves to the caller
      outs[done] = nullptr;
      continue;
    }
    PyObject* value = PyList_GET_ITEM(py_out.get(), done);
    outputs[done] = NewHandlerTensorHandle(stack, value,
                                           TFE_TensorHandleDataType(EagerTensor_Handle(value)),
                                           producer.get(), true);
    if (outputs[done] == nullptr) return fail();
  }
  *num_outputs = n;
  return true;
}

}  // namespace fast
}  // namespace tf_ophandlers
