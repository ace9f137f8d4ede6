// tf-ophandlers: a Python execute hook called from the fast path, and the hook frame
// (CallHook) the record path shares. Contracts: fast_internal.h.
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

// Runs `fn(a, b[, c])` as HandlerStack.call_hook does: `stack` pushed on state.frames and
// state.current set to `next` meanwhile (restored on failure too, keeping the error).
// Returns a new reference, or null with a Python exception set. GIL: held.
PyObject* CallHook(PyObject* stack, PyObject* next, PyObject* fn, PyObject* a, PyObject* b,
                   PyObject* c) {
  PyObject* frames = PyObject_GetAttr(g_state, s_frames);
  if (frames == nullptr) return nullptr;
  if (!PyList_Check(frames) || PyList_Append(frames, stack) < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "state.frames is not a list");
    Py_DECREF(frames);
    return nullptr;
  }
  PyObject* saved = PyObject_GetAttr(g_state, s_current);
  PyObject* r = nullptr;
  if (saved != nullptr && PyObject_SetAttr(g_state, s_current, next) == 0) {
    r = PyObject_CallFunctionObjArgs(fn, a, b, c, nullptr);
  }
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);
  if (saved != nullptr && PyObject_SetAttr(g_state, s_current, saved) < 0) PyErr_Clear();
  Py_ssize_t n = PyList_GET_SIZE(frames);
  if (n > 0 && PyList_SetSlice(frames, n - 1, n, nullptr) < 0) PyErr_Clear();
  PyErr_Restore(et, ev, tb);
  Py_XDECREF(saved);
  Py_DECREF(frames);
  return r;
}

int WantsCopy(PyObject* stack, PyObject* op, int index, TFE_TensorHandle* h) {
  TFOH_Payload* p = PayloadOf(h);
  if (p != nullptr && p->kind == TFOH_PAYLOAD_PYTHON &&
      reinterpret_cast<PyObject*>(p->stack) != stack) {
    PyObject* r =
        PyObject_CallMethodOneArg(stack, s_below, reinterpret_cast<PyObject*>(p->stack));
    int above = r != nullptr ? PyObject_IsTrue(r) : -1;
    Py_XDECREF(r);
    if (above != 0) return above;
  }
  PyObject* idx = PyLong_FromLong(index);
  PyObject* want =
      idx ? PyObject_CallMethodObjArgs(stack, s_wants_copy, op, idx, nullptr) : nullptr;
  Py_XDECREF(idx);
  int yes = want != nullptr ? PyObject_IsTrue(want) : -1;
  Py_XDECREF(want);
  return yes;
}

// HandlerStack.execute for a Python handler whose execute hook runs for the op, on the
// op's first stack: unwrap and copy-on, the hook, and the wrap, with only the hook (and
// copy_on hooks) in Python; then the dispatcher's output validation (TakeOutputs).
// Always handled: errors are reported through `status` as the Python path raises them.
// GIL: held.

bool RunHook(PyObject* stack, const Decision& d, const TFE_Op* src, const char* type,
             const char* device, int n_in, TFE_TensorHandle** in, int* num_outputs,
             TFE_TensorHandle** outputs, TF_Status* status) {
  // Released in the reverse order of these declarations: the swap of the current op,
  // the values made here, then the handler's attributes, then the Op (EndBorrow).
  OpRef op;
  // Read per op (the handler may rebind them); not cached, so the cache keeps no handler
  // alive.
  PyRef handler(PyObject_GetAttr(stack, s_handler));
  PyRef execute(handler ? PyObject_GetAttr(handler.get(), s_execute) : nullptr);
  if (execute && d.next == g_physical && g_handler_hooks.execute_in_c != nullptr &&
      g_handler_hooks.execute_in_c(execute.get(), stack, src, type, n_in, in, num_outputs,
                                   outputs, status)) {
    // The hook's C implementation (the hook slot) took it: no Op object, no hook frame.
    return true;
  }
  op.reset(PyErr_Occurred() ? nullptr : NewOpObject(type, device, *num_outputs), g_ctx);
  if (!op) {
    StatusFromPyErr(status);
    return true;
  }
  op.get()->borrowed = src;
  PyRef value_dtype;
  PyRef physical_copy;  // handler.physical_copy_on, asked at the first use
  PyRef values(execute ? PyList_New(n_in) : nullptr);
  PyRef result;
  PyRef wrapped;
  absl::InlinedVector<int, 4> foreign;
  // Names the op in wrap errors (CurrentOpType) until the outputs are taken.
  struct CurrentOp {
    OpObject* outer;
    bool swapped = true;
    void Restore() {
      if (swapped) SwapCurrentOp(outer);
      swapped = false;
    }
    ~CurrentOp() { Restore(); }
  } current{SwapCurrentOp(op.get())};
  auto fail = [status]() {
    StatusFromPyErr(status);
    return true;
  };
  if (!values) return fail();
  for (int i = 0; i < n_in; ++i) {
    TFOH_Payload* p = PayloadOf(in[i]);
    PyObject* v;
    if (p != nullptr && p->kind == TFOH_PAYLOAD_PYTHON &&
        reinterpret_cast<PyObject*>(p->stack) == stack) {
      v = PayloadValue(p);  // borrowed; made now if the payload has only a handle
      if (v == nullptr) return fail();
      Py_INCREF(v);
    } else {
      v = native_internal::EagerTensorSharing(in[i]);
      if (v == nullptr) return fail();
      foreign.push_back(i);
    }
    PyList_SET_ITEM(values.get(), i, v);
  }
  for (int i : foreign) {
    if (!d.copy_all) {
      int yes = WantsCopy(stack, op.object(), i, in[i]);
      if (yes < 0) return fail();
      if (yes == 0) continue;
    }
    if (!physical_copy && d.next == g_physical && PayloadOf(in[i]) == nullptr) {
      // A physical tensor onto a stack over PHYSICAL: the handler's `physical_copy_on`,
      // when it declares one, gives what its copy_on would (OpHandler), with no frame.
      // The stack holds the one that applies (core/fast_decision.py physical_copy_of):
      // None when a subclass or the instance set its own copy_on.
      physical_copy.reset(PyObject_GetAttr(stack, s_physical_copy));
      if (!physical_copy) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return fail();
        PyErr_Clear();  // (a stack without the field: its copy_on)
        physical_copy.reset(Py_NewRef(Py_None));
      }
    }
    PyObject* moved =
        physical_copy && physical_copy.get() != Py_None && PayloadOf(in[i]) == nullptr
            ? PyObject_CallOneArg(physical_copy.get(), PyList_GET_ITEM(values.get(), i))
            : PyObject_CallMethodOneArg(stack, s_copy_on_value, PyList_GET_ITEM(values.get(), i));
    if (moved == nullptr) return fail();
    PyList_SetItem(values.get(), i, moved);  // steals `moved`, releases the input
  }
  result.reset(CallHook(stack, d.next, execute.get(), op.object(), values.get()));
  if (!result) return fail();
  if (!PyList_Check(result.get()) && !PyTuple_Check(result.get())) {
    PyRef r(PyObject_CallMethodObjArgs(stack, s_not_a_list, op.object(), result.get(), nullptr));
    r.reset();  // raises
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "execute did not return a list");
    return fail();
  }
  if (d.next == g_physical) {
    value_dtype.reset(PyObject_GetAttr(handler.get(), s_value_dtype));
    if (!value_dtype) return fail();
    wrapped.reset(
        WrapOutputs(stack, result.get(), d.transient, value_dtype.get(), op.get()->type));
  } else {
    // Outputs that left the stacks below (HandlerStack._wrap_eager).
    wrapped.reset(PyObject_CallMethodOneArg(stack, s_wrap_eager, result.get()));
  }
  if (!wrapped) return fail();
  current.Restore();
  TakeOutputs(op.get(), src, wrapped.get(), num_outputs, outputs, status);
  return true;
}

}  // namespace fast
}  // namespace tf_ophandlers
