// tf-ophandlers: oh.Async's execute hook for its common case, in C (called by RunHook
// instead of the Python hook, through the hook slot). Contracts: async_execute.h.
//
// The Python hook (handlers/async_execution.py Async.execute) stays the reference: this
// path takes only ops it runs exactly as the hook would, and declines everything else
// before running anything, so the hook then runs as before. Taken: an op whose kind is
// `_IMPLIED` (its attributes follow from its inputs' dtypes: Tanh, Mul, AddV2), placed on
// an Async stack over PHYSICAL, every input either a representation of this stack
// `(tensor, part, dtype)` holding a physical tensor or a physical tensor of a dtype that
// carries no value in its signature part (`_VALUELESS`), whose signature is already in
// `_inferred` with a non-resource output per output. Declined: anything else, including
// a failure of TensorFlow before the op was queued (the hook then reports it and clears
// the executor's error as it does).
#define PY_SSIZE_T_CLEAN
#include "handlers/async_execution/async_execute.h"

#include "fast/fast_internal.h"

#include <bitset>

#include "absl/container/inlined_vector.h"
#include "boundary/handler_tensor.h"
#include "native/native.h"
#include "boundary/op.h"
#include "boundary/owners.h"
#include "boundary/runtime.h"
#include "boundary/status.h"

namespace tf_ophandlers {
namespace fast {
namespace {

// Set once by async_setup (handlers/async_execution.py at import); strong references for
// the process. Null: the C path is off.
PyObject* g_async_execute = nullptr;  // the function Async.execute
PyObject* g_async_kinds = nullptr;    // _op_kinds: op type -> kind (a dict subclass)
PyObject* g_async_implied = nullptr;  // _IMPLIED (an int)
PyObject* g_async_inferred = nullptr; // _inferred: signature key -> [(part, dtype)] or None
PyObject* g_async_resource = nullptr; // tf.resource (an output of that dtype stays raw)
std::bitset<256> g_valueless;         // _VALUELESS: dtype enums carrying no value
uint64_t g_async_ops = 0;             // ops run here (async_stats); guarded by the GIL

// The signature part `(enum, dims, None)` of the physical tensor `h`, as the hook's
// `(v._datatype_enum(), v._shape_tuple(), None)`. Null (no Python exception left set)
// when it cannot be made here.
PyObject* OutsidePart(TFE_TensorHandle* h, TF_DataType enum_value) {
  TF_Status* s = ThreadStatus();
  const int rank = TFE_TensorHandleNumDims(h, s);  // waits as _shape_tuple would
  if (TF_GetCode(s) != TF_OK) return nullptr;
  PyObject* dims = PyTuple_New(rank);
  if (dims == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  for (int i = 0; i < rank; ++i) {
    const int64_t d = TFE_TensorHandleDim(h, i, s);
    PyObject* v = TF_GetCode(s) == TF_OK ? (d < 0 ? (Py_INCREF(Py_None), Py_None)
                                                  : PyLong_FromLongLong(d))
                                         : nullptr;
    if (v == nullptr) {
      PyErr_Clear();
      Py_DECREF(dims);
      return nullptr;
    }
    PyTuple_SET_ITEM(dims, i, v);
  }
  PyObject* part = Py_BuildValue("(lNO)", static_cast<long>(enum_value), dims, Py_None);
  if (part == nullptr) PyErr_Clear();
  return part;
}

}  // namespace

bool AsyncHookIs(PyObject* execute) {
  return g_async_execute != nullptr && PyMethod_Check(execute) &&
         PyMethod_GET_FUNCTION(execute) == g_async_execute;
}

bool AsyncExecute(PyObject* stack, const TFE_Op* src, const char* type, int n_in,
                  TFE_TensorHandle** in, int* num_outputs, TFE_TensorHandle** outputs,
                  TF_Status* status) {
  PyObject* op_type = InternedStringKept(type);  // borrowed; the hook's key holds op.type
  if (op_type == nullptr) return false;
  PyObject* kind = PyDict_GetItemWithError(g_async_kinds, op_type);  // borrowed
  if (kind == nullptr || PyObject_RichCompareBool(kind, g_async_implied, Py_EQ) != 1) {
    PyErr_Clear();
    return false;
  }
  absl::InlinedVector<TFE_TensorHandle*, 4> tensors(n_in);
  absl::InlinedVector<TF_DataType, 4> expected;
  // Released in the reverse order of these declarations.
  PyRef parts(PyTuple_New(n_in));
  if (!parts) {
    PyErr_Clear();
    return false;
  }
  PyRef key;
  PyRef hold;  // the cache entry `inferred`: another thread may evict it while the op runs
  for (int i = 0; i < n_in; ++i) {
    TFOH_Payload* p = PayloadOf(in[i]);
    PyObject* part;
    if (p == nullptr) {  // from outside the handler (a constant): computed
      const TF_DataType e = TFE_TensorHandleDataType(in[i]);
      if (static_cast<unsigned>(e) >= g_valueless.size() || !g_valueless[e]) return false;
      part = OutsidePart(in[i], e);
      if (part == nullptr) return false;
      tensors[i] = in[i];
    } else {
      if (p->kind != TFOH_PAYLOAD_PYTHON || reinterpret_cast<PyObject*>(p->stack) != stack) {
        return false;
      }
      PyObject* v = PayloadValue(p);  // borrowed
      if (v == nullptr) {
        PyErr_Clear();
        return false;
      }
      if (!PyTuple_CheckExact(v) || PyTuple_GET_SIZE(v) != 3) return false;
      PyObject* t = PyTuple_GET_ITEM(v, 0);
      if (!EagerTensor_CheckExact(t)) return false;
      TFE_TensorHandle* h = EagerTensor_Handle(t);
      if (PayloadOf(h) != nullptr) return false;  // not physical: a copy-off, the hook's
      tensors[i] = h;
      part = PyTuple_GET_ITEM(v, 1);
      Py_INCREF(part);
    }
    PyTuple_SET_ITEM(parts.get(), i, part);
  }
  // The hook's key for an _IMPLIED op: (op type, None, parts).
  key.reset(PyTuple_Pack(3, op_type, Py_None, parts.get()));
  if (!key) {
    PyErr_Clear();
    return false;
  }
  PyObject* inferred = PyDict_GetItemWithError(g_async_inferred, key.get());  // borrowed
  if (inferred == nullptr || !PyList_CheckExact(inferred)) {
    PyErr_Clear();
    return false;
  }
  hold = PyRef::Borrow(inferred);
  const Py_ssize_t n_out = PyList_GET_SIZE(inferred);
  // The dispatcher's output check (TakeOutputs) done first, on the inferred dtypes: a
  // mismatch is the hook's to report.
  if (n_out > *num_outputs || !ExpectedOutputs(src, &expected) ||
      static_cast<Py_ssize_t>(expected.size()) != n_out) {
    return false;
  }
  for (Py_ssize_t i = 0; i < n_out; ++i) {
    PyObject* entry = PyList_GET_ITEM(inferred, i);
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2 ||
        PyTuple_GET_ITEM(entry, 1) == g_async_resource) {
      return false;  // a resource output is returned as it is: the hook's
    }
    PyObject* part = PyTuple_GET_ITEM(entry, 0);
    if (!PyTuple_CheckExact(part) || PyTuple_GET_SIZE(part) != 3 ||
        PyLong_AsLong(PyTuple_GET_ITEM(part, 0)) != static_cast<long>(expected[i])) {
      PyErr_Clear();
      return false;
    }
  }
  PyObject* device_obj = StateGet(s_device);  // borrowed; no Python runs before its use
  const char* device = device_obj != nullptr ? PyUnicode_AsUTF8(device_obj) : nullptr;
  if (device == nullptr) {
    PyErr_Clear();
    return false;
  }
  {
    absl::InlinedVector<TFE_TensorHandle*, 4> outs(n_out > 0 ? n_out : 1);
    int num = static_cast<int>(n_out);
    StatusPtr s(TF_NewStatus());
    ExecuteOnPhysical(src, type, device, n_in, tensors.data(), &num, outs.data(), s.get());
    // Nothing was queued: the hook runs it and reports the error.
    if (TF_GetCode(s.get()) != TF_OK) return false;
    const bool shape_from_value = !HasNativeShapeHooks(stack);
    int made = 0;
    if (num != n_out) {
      PyErr_Format(PyExc_RuntimeError, "tf_ophandlers: %s gave %d outputs, %zd inferred",
                   type, num, n_out);
    }
    // Each output: the representation (tensor, part, dtype), wrapped on the stack.
    for (; made < num && num == n_out; ++made) {
      PyRef t(EagerTensorFromHandle(outs[made], false));
      if (!t) break;
      outs[made] = nullptr;  // the EagerTensor owns it
      PyObject* entry = PyList_GET_ITEM(inferred, made);  // (part, dtype)
      PyRef value(PyTuple_Pack(3, t.get(), PyTuple_GET_ITEM(entry, 0),
                               PyTuple_GET_ITEM(entry, 1)));
      t.reset();
      if (!value) break;
      outputs[made] = NewHandlerTensorHandle(stack, value.get(), expected[made], op_type,
                                             shape_from_value);
      value.reset();
      if (outputs[made] == nullptr) break;
    }
    if (made == num && num == n_out) {
      *num_outputs = num;
      ++g_async_ops;
    } else {
      for (int j = 0; j < made; ++j) TFE_DeleteTensorHandle(outputs[j]);
      for (int j = made; j < num; ++j) {
        if (outs[j] != nullptr) TFE_DeleteTensorHandle(outs[j]);
      }
      StatusFromPyErr(status);
    }
  }
  return true;
}

// async_setup(execute, op_kinds, implied, inferred, resource, valueless)
PyObject* PyAsyncSetup(PyObject*, PyObject* args) {
  PyObject *execute, *kinds, *implied, *inferred, *resource, *valueless;
  if (!PyArg_ParseTuple(args, "OO!OO!OO", &execute, &PyDict_Type, &kinds, &implied,
                        &PyDict_Type, &inferred, &resource, &valueless)) {
    return nullptr;
  }
  PyObject* it = PyObject_GetIter(valueless);
  if (it == nullptr) return nullptr;
  std::bitset<256> bits;
  while (PyObject* e = PyIter_Next(it)) {
    const long v = PyLong_AsLong(e);
    Py_DECREF(e);
    if (v >= 0 && v < 256) bits.set(v);
  }
  Py_DECREF(it);
  if (PyErr_Occurred()) return nullptr;
  PyObject* refs[] = {execute, kinds, implied, inferred, resource};
  for (PyObject* r : refs) Py_INCREF(r);
  Py_XSETREF(g_async_execute, execute);
  Py_XSETREF(g_async_kinds, kinds);
  Py_XSETREF(g_async_implied, implied);
  Py_XSETREF(g_async_inferred, inferred);
  Py_XSETREF(g_async_resource, resource);
  g_valueless = bits;
  Py_RETURN_NONE;
}

PyObject* PyAsyncStats(PyObject*, PyObject*) {
  return Py_BuildValue("{sK}", "c_ops", static_cast<unsigned long long>(g_async_ops));
}

bool AsyncExecuteInC(PyObject* execute, PyObject* stack, const TFE_Op* src, const char* type,
                     int n_in, TFE_TensorHandle** in, int* num_outputs,
                     TFE_TensorHandle** outputs, TF_Status* status) {
  return AsyncHookIs(execute) &&
         AsyncExecute(stack, src, type, n_in, in, num_outputs, outputs, status);
}

PyMethodDef kAsyncModuleMethods[] = {
    {"async_setup", PyAsyncSetup, METH_VARARGS,
     "async_setup(execute, op_kinds, implied, inferred, resource, valueless): oh.Async's "
     "tables, for its hook's common case in C (cc/handlers/async_execution/fast_async.cc)."},
    {"async_stats", PyAsyncStats, METH_NOARGS,
     "async_stats() -> {c_ops}: ops oh.Async's hook ran in C "
     "(cc/handlers/async_execution/fast_async.cc)."},
    {nullptr}};

}  // namespace fast
}  // namespace tf_ophandlers
