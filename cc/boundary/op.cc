// tf-ophandlers: the Op Python type and ExecuteOp. Contracts: op.h.
#define PY_SSIZE_T_CLEAN
#include "boundary/op.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <utility>

#include <string>

#include "absl/container/inlined_vector.h"
#include "boundary/handler_tensor.h"
#include "boundary/owners.h"
#include "boundary/runtime.h"
#include "boundary/status.h"
#include "tensorflow/c/eager/abstract_op_attrs.h"
#include "tensorflow/c/eager/immediate_execution_operation.h"
#include "tensorflow/c/eager/tfe_op_internal.h"
#include "tensorflow/core/framework/attr_value.pb.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_def.pb.h"

namespace tf_ophandlers {
namespace {

// ---- Op type slots ----------------------------------------------------------------------

// Ops released by Ops that owned one (a record's), for the next physical execution to
// reset instead of allocating one (TakePooledOp). Guarded by the GIL.
constexpr size_t kPoolMax = 128;
TFE_Op* g_pool[kPoolMax];
size_t g_pooled = 0;

void OpDealloc(OpObject* op) {
  PyObject_GC_UnTrack(op);
  if (op->owned) PoolOp(op->owned);
  Py_CLEAR(op->type);
  Py_CLEAR(op->device);
  Py_CLEAR(op->output_dtypes);
  Py_CLEAR(op->dict);
  Py_TYPE(op)->tp_free(reinterpret_cast<PyObject*>(op));
}

int OpTraverse(OpObject* op, visitproc visit, void* arg) {
  Py_VISIT(op->dict);
  return 0;
}

int OpClear(OpObject* op) {
  Py_CLEAR(op->dict);
  return 0;
}

PyObject* OpGetType(OpObject* op, void*) {
  Py_INCREF(op->type);
  return op->type;
}
PyObject* OpGetDevice(OpObject* op, void*) {
  Py_INCREF(op->device);
  return op->device;
}
PyObject* OpGetNumOutputs(OpObject* op, void*) { return PyLong_FromLong(op->num_outputs); }

PyObject* OpGetOutputDtypes(OpObject* op, void*) {
  if (op->output_dtypes == nullptr) {
    const TFE_Op* src = OpAttrSource(op);
    if (src == nullptr) return nullptr;
    std::vector<TF_DataType> dtypes;
    if (!ExpectedOutputs(src, &dtypes)) {
      Py_INCREF(Py_None);
      op->output_dtypes = Py_None;
    } else {
      PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(dtypes.size()));
      if (t == nullptr) return nullptr;
      for (size_t i = 0; i < dtypes.size(); ++i) {
        PyObject* v = PyLong_FromLong(static_cast<long>(dtypes[i]));
        if (v == nullptr) {
          Py_DECREF(t);
          return nullptr;
        }
        PyTuple_SET_ITEM(t, i, v);
      }
      op->output_dtypes = t;
    }
  }
  Py_INCREF(op->output_dtypes);
  return op->output_dtypes;
}

// TensorFlow serializes an op's attribute map in its hash table's order, which differs
// between ops with the same attributes (one Conv2D call site gives dozens of byte strings),
// so caches keyed by the bytes miss. Sorting the top-level fields (the op name and one
// length-delimited map entry per attribute) gives one byte string per content: exactly
// what core/op.py's `_canonical` computes, at C speed. False (bytes left as they are,
// `_canonical` then parses) on any encoding other than one-byte tags of wire type 2.
bool SortTopLevelFields(const char* data, size_t n, std::string* out) {
  absl::InlinedVector<std::pair<size_t, size_t>, 16> fields;  // (start, length)
  const auto* p = reinterpret_cast<const unsigned char*>(data);
  size_t i = 0;
  while (i < n) {
    const size_t start = i;
    if ((p[i] & 7) != 2 || p[i] >= 0x80) return false;
    ++i;
    uint64_t length = 0;
    int shift = 0;
    while (true) {
      if (i >= n || shift > 63) return false;
      const unsigned char b = p[i++];
      length |= static_cast<uint64_t>(b & 0x7F) << shift;
      if (b < 0x80) break;
      shift += 7;
    }
    if (length > n - i) return false;
    i += length;
    fields.emplace_back(start, i - start);
  }
  std::sort(fields.begin(), fields.end(),
            [data](const std::pair<size_t, size_t>& a, const std::pair<size_t, size_t>& b) {
              const int c = std::memcmp(data + a.first, data + b.first,
                                        std::min(a.second, b.second));
              return c != 0 ? c < 0 : a.second < b.second;
            });
  out->reserve(n);
  for (const auto& f : fields) out->append(data + f.first, f.second);
  return true;
}

PyObject* OpAttrsProto(OpObject* op, PyObject*) {
  const TFE_Op* src = OpAttrSource(op);
  if (src == nullptr) return nullptr;
  TF_Buffer* buf = TF_NewBuffer();
  TF_Status* s = TF_NewStatus();
  TFE_OpAttrsSerialize(TFE_OpGetAttrs(src), buf, s);
  PyObject* r = nullptr;
  if (TF_GetCode(s) == TF_OK) {
    const char* data = static_cast<const char*>(buf->data);
    std::string sorted;
    if (SortTopLevelFields(data, buf->length, &sorted)) {
      r = PyBytes_FromStringAndSize(sorted.data(), static_cast<Py_ssize_t>(sorted.size()));
    } else {
      r = PyBytes_FromStringAndSize(data, static_cast<Py_ssize_t>(buf->length));
    }
  } else {
    PyErr_SetString(PyExc_RuntimeError, TF_Message(s));
  }
  TF_DeleteStatus(s);
  TF_DeleteBuffer(buf);
  return r;
}

PyObject* OpIsBorrowed(OpObject* op, void*) { return PyBool_FromLong(op->borrowed != nullptr); }

PyGetSetDef kOpGetSet[] = {
    {"type", reinterpret_cast<getter>(OpGetType), nullptr, "The op type, e.g. 'AddV2'.", nullptr},
    {"requested_device", reinterpret_cast<getter>(OpGetDevice), nullptr,
     "The device TensorFlow recorded for the op ('' when none was requested).", nullptr},
    {"num_outputs", reinterpret_cast<getter>(OpGetNumOutputs), nullptr,
     "Number of flat outputs the op must produce.", nullptr},
    {"output_dtype_enums", reinterpret_cast<getter>(OpGetOutputDtypes), nullptr,
     "Expected output dtypes (TF_DataType enums) from the OpDef, or None.", nullptr},
    {"_borrowed", reinterpret_cast<getter>(OpIsBorrowed), nullptr, nullptr, nullptr},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, nullptr, nullptr},
    {nullptr}};

PyMethodDef kOpMethods[] = {
    {"_attrs_proto", reinterpret_cast<PyCFunction>(OpAttrsProto), METH_NOARGS,
     "Serialized NameAttrList of the op's attributes, top-level fields sorted (one byte "
     "string per content; see SortTopLevelFields)."},
    {nullptr}};

}  // namespace

void PoolOp(TFE_Op* op) {
  if (g_pooled < kPoolMax) {
    g_pool[g_pooled++] = op;
  } else {
    TFE_DeleteOp(op);
  }
}

TFE_Op* TakePooledOp() { return g_pooled > 0 ? g_pool[--g_pooled] : nullptr; }

TFE_Op* ResetOrNewOp(TFE_Op* reuse, const char* type, const char* device, TF_Status* status) {
  // (TFE_OpGetContext reads the op's context pointer without using the context.)
  if (reuse != nullptr && TFE_OpGetContext(reuse, status) == g_ctx) {
    TFE_OpReset(reuse, type, device, status);
    if (TF_GetCode(status) == TF_OK) return reuse;
    TFE_DeleteOp(reuse);
  }
  TF_SetStatus(status, TF_OK, "");
  TFE_Op* op = TFE_NewOp(g_ctx, type, status);
  if (TF_GetCode(status) == TF_OK) TFE_OpSetDevice(op, device, status);
  if (TF_GetCode(status) != TF_OK && op != nullptr) {
    TFE_DeleteOp(op);
    op = nullptr;
  }
  return op;
}

void ForgetPooledOps(TFE_Context* old_ctx) {
  TF_Status* s = ThreadStatus();
  while (g_pooled > 0) {
    TFE_Op* op = g_pool[--g_pooled];
    if (TFE_OpGetContext(op, s) == old_ctx) TFE_DeleteOp(op);
  }
}

PyTypeObject OpBaseType = {
    PyVarObject_HEAD_INIT(nullptr, 0) "tf_ophandlers._C.OpBase", /* tp_name */
    sizeof(OpObject),                                              /* tp_basicsize */
};

bool ReadyOpBaseType() {
  OpBaseType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC;
  OpBaseType.tp_doc = "Base of tf_ophandlers.Op (see cc/boundary/op.h).";
  OpBaseType.tp_dealloc = reinterpret_cast<destructor>(OpDealloc);
  OpBaseType.tp_traverse = reinterpret_cast<traverseproc>(OpTraverse);
  OpBaseType.tp_clear = reinterpret_cast<inquiry>(OpClear);
  OpBaseType.tp_getset = kOpGetSet;
  OpBaseType.tp_methods = kOpMethods;
  OpBaseType.tp_dictoffset = offsetof(OpObject, dict);
  return PyType_Ready(&OpBaseType) >= 0;
}

OpObject* NewOpObject(const char* type, const char* device, int num_outputs) {
  auto* op = reinterpret_cast<OpObject*>(g_op_type->tp_alloc(g_op_type, 0));
  if (op == nullptr) return nullptr;
  op->borrowed = nullptr;
  op->owned = nullptr;
  op->type = InternedString(type);
  op->device = InternedString(device ? device : "");
  op->num_outputs = num_outputs;
  op->output_dtypes = nullptr;
  op->dict = nullptr;
  if (op->type == nullptr || op->device == nullptr) {
    Py_DECREF(op);
    return nullptr;
  }
  return op;
}

// Ends the borrow of `op`: an Op still referenced from Python copies the attributes it
// borrowed. GIL: held.
void EndBorrow(OpObject* op, TFE_Context* ctx) {
  if (op->borrowed == nullptr) return;
  if (Py_REFCNT(op) > 1 && op->owned == nullptr) {
    TF_Status* s = TF_NewStatus();
    TFE_Op* copy = TFE_NewOp(ctx, PyUnicode_AsUTF8(op->type), s);
    if (TF_GetCode(s) == TF_OK) {
      TFE_OpAddAttrs(copy, TFE_OpGetAttrs(op->borrowed));
      op->owned = copy;
    } else if (copy != nullptr) {
      TFE_DeleteOp(copy);
    }
    TF_DeleteStatus(s);
  }
  op->borrowed = nullptr;
}

// Checks what a Python handler returned for `op` and moves it into `outputs`.
// Returns false with `status` set on any mismatch. GIL: held.

const TFE_Op* OpAttrSource(OpObject* op) {
  if (op->borrowed) return op->borrowed;
  if (op->owned) return op->owned;
  PyErr_SetString(PyExc_RuntimeError, "tf_ophandlers: Op has no attributes");
  return nullptr;
}


PyObject* ExecuteOp(OpObject* op, PyObject* inputs, const char* device) {
  const TFE_Op* src = OpAttrSource(op);
  if (src == nullptr) return nullptr;
  if (!RequireInit()) return nullptr;
  PyRef seq(PySequence_Tuple(inputs));  // a copy: copy-off hooks cannot resize it
  if (!seq) return nullptr;
  Py_ssize_t n_in = PyTuple_GET_SIZE(seq.get());
  PyObject** items = n_in ? &PyTuple_GET_ITEM(seq.get(), 0) : nullptr;
  StatusPtr status(TF_NewStatus());
  TF_Status* s = status.get();
  const char* type = PyUnicode_AsUTF8(op->type);
  // Reuse this thread's TFE_Op (as TensorFlow's own Python fast path does): TFE_OpReset
  // keeps the allocation and skips re-parsing an unchanged device name. A nested
  // ExecuteOp on the same thread (a copy-off hook) takes the op out of the cache first.
  thread_local TFE_Op* cached_op = nullptr;
  // On every exit the op goes back to the cache when TensorFlow reported no error
  // (inputs and attrs are cleared by the next TFE_OpReset), else it is deleted.
  struct CachedOp {
    TFE_Op* tfe;
    TF_Status* s;
    ~CachedOp() {
      if (tfe == nullptr) return;
      if (cached_op == nullptr && TF_GetCode(s) == TF_OK) {
        cached_op = tfe;
      } else {
        TFE_DeleteOp(tfe);
      }
    }
  } owner{ResetOrNewOp(cached_op, type, device, s), s};
  TFE_Op* tfe = owner.tfe;
  cached_op = nullptr;
  int num = op->num_outputs;
  absl::InlinedVector<TFE_TensorHandle*, 4> rets;
  absl::InlinedVector<PyRef, 2> keep;  // copied-off inputs
  auto fail = [s]() -> PyObject* {
    RaiseFromStatus(s);
    return nullptr;
  };
  if (TF_GetCode(s) != TF_OK) return fail();
  TFE_OpAddAttrs(tfe, TFE_OpGetAttrs(src));
  for (Py_ssize_t i = 0; i < n_in; ++i) {
    if (!EagerTensor_CheckExact(items[i])) {
      PyErr_Format(PyExc_TypeError, "tf_ophandlers: input %zd of %s is not an eager tensor", i,
                   type);
      return nullptr;
    }
    TFE_TensorHandle* h = EagerTensor_Handle(items[i]);
    if (PayloadOf(h) != nullptr) {
      // A handler tensor reaching a physical device: copy it off its stack (RFC: CopyOn
      // on a physical device is the CopyOff of the tensor's own stack).
      PyRef off(PyObject_CallFunction(g_copy_from, "Os", items[i], device));
      if (!off) return nullptr;
      if (!EagerTensor_CheckExact(off.get()) ||
          PayloadOf(EagerTensor_Handle(off.get())) != nullptr) {
        PyErr_Format(PyExc_TypeError, "tf_ophandlers: copy-off for input %zd of %s did not "
                     "return a physical tensor", i, type);
        return nullptr;
      }
      h = EagerTensor_Handle(off.get());
      keep.push_back(std::move(off));
    }
    TFE_OpAddInput(tfe, h, s);
    if (TF_GetCode(s) != TF_OK) return fail();
  }
  if (num < 0) {
    PyErr_Format(PyExc_ValueError, "tf_ophandlers: unknown output count for %s", type);
    return nullptr;
  }
  rets.resize(num > 0 ? num : 1);
  Py_BEGIN_ALLOW_THREADS;
  TFE_Execute(tfe, rets.data(), &num, s);
  Py_END_ALLOW_THREADS;
  if (TF_GetCode(s) != TF_OK) return fail();
  PyRef result(PyList_New(num));
  for (int i = 0; i < num; ++i) {
    PyObject* t = result ? EagerTensorFromHandle(rets[i], false) : nullptr;
    if (t == nullptr) {
      for (int j = i; j < num; ++j) TFE_DeleteTensorHandle(rets[j]);
      result.reset();
      break;
    }
    PyList_SET_ITEM(result.get(), i, t);
  }
  return result.release();
}

}  // namespace tf_ophandlers
