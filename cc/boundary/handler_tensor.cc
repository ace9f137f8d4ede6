// tf-ophandlers: handler tensors, their payload methods and deallocation. Contracts:
// handler_tensor.h; payload layout: include/tf_ophandlers/payload.h.
#define PY_SSIZE_T_CLEAN
#include "boundary/handler_tensor.h"

#include <atomic>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "boundary/runtime.h"
#include "boundary/status.h"

namespace tf_ophandlers {
namespace {

// Payloads released on a thread that does not hold the GIL are queued here and their
// Python references dropped by the next thread that holds it. Taking the GIL inside a
// deallocator could deadlock against a thread that holds the GIL while waiting for the
// executor that runs the deallocator.
std::mutex g_pending_mu;
std::vector<TFOH_Payload*> g_pending;  // guarded by g_pending_mu
// Whether g_pending may be non-empty: set under the mutex when a payload is queued,
// cleared by the drain that empties it, read without the mutex so that the common case
// (nothing queued) costs no lock on every op.
std::atomic<bool> g_maybe_pending{false};

}  // namespace

struct StackAnchor {
  std::atomic<intptr_t> count;
  PyObject* stack;  // one strong reference while count > 0
};

StackAnchor* NewStackAnchor(PyObject* stack) {
  Py_INCREF(stack);
  return new StackAnchor{{1}, stack};
}

void ReleaseStackAnchor(StackAnchor* a) {
  if (a->count.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  Py_DECREF(a->stack);
  delete a;
}

namespace {

// Drops one count of `a` unless it is the last one (which needs the GIL): returns whether
// it did. GIL: not needed.
bool ReleaseStackAnchorNoGil(StackAnchor* a) {
  intptr_t n = a->count.load(std::memory_order_relaxed);
  while (n > 1) {
    if (a->count.compare_exchange_weak(n, n - 1, std::memory_order_acq_rel)) return true;
  }
  return false;
}

// The last shape a handler answered whole (dispatch.num_dims returned its `value_shape`
// as a tuple) and its payload: TensorFlow asks the rank and then each axis, and those
// axes are answered from here instead of one `dim` hook call each. One entry; read and
// written with the GIL held; cleared when its payload is freed (under the GIL too), so
// an address reused by a new payload never finds it.
// (Atomic: PayloadDim peeks at it before taking the GIL.)
std::atomic<const TFOH_Payload*> g_shape_payload{nullptr};
std::vector<int64_t> g_shape_dims;

// Drops the payload's Python references (an anchored payload: its count of the anchor,
// and only `value`, which PayloadValue may have set since) and frees it. GIL: held.
void FreePayloadWithGil(TFOH_Payload* p) {
  if (g_shape_payload.load(std::memory_order_relaxed) == p) g_shape_payload.store(nullptr);
  if (p->anchor != nullptr) {
    ReleaseStackAnchor(static_cast<StackAnchor*>(p->anchor));
  } else {
    Py_XDECREF(reinterpret_cast<PyObject*>(p->stack));
    Py_XDECREF(reinterpret_cast<PyObject*>(p->producer));
    Py_XDECREF(reinterpret_cast<PyObject*>(p->lazy));
  }
  Py_XDECREF(reinterpret_cast<PyObject*>(p->value));
  delete p;
}

PyObject* ProducerOf(const TFOH_Payload* p) {
  return p->producer != nullptr ? reinterpret_cast<PyObject*>(p->producer) : Py_None;
}

// ---- TFE_CustomDeviceTensorHandle methods ---------------------------------------------
// Called by TensorFlow on any thread, with or without the GIL. Each reports failure only
// through `status` and leaves no Python exception set.

// The one body behind num_dims and dim: asks Python's hook (`call`, run with the GIL
// held) for the answer and accepts an int in [min_value, max_value]; anything else is
// reported as the hook's error naming `hook` and what was expected (`expected`).
template <typename Call>
int64_t AskShapeHook(TFOH_Payload* p, const char* hook, Call call, long long min_value,
                     long long max_value, const std::string& expected, TF_Status* status) {
  if (!PythonAlive()) {
    TF_SetStatus(status, TF_FAILED_PRECONDITION, "tf_ophandlers: interpreter is exiting");
    return -1;
  }
  PyGILState_STATE g = PyGILState_Ensure();
  int64_t result = -1;
  PyObject* stack = reinterpret_cast<PyObject*>(p->stack);
  PyObject* r = call(stack);
  if (r != nullptr && PyTuple_Check(r) && std::strcmp(hook, "num_dims") == 0) {
    // The whole shape (dispatch.num_dims validated it: ints >= -1, rank <= kMaxRank;
    // checked again here, the last line of defence as for an int answer).
    std::vector<int64_t> dims(static_cast<size_t>(PyTuple_GET_SIZE(r)));
    bool valid = dims.size() <= static_cast<size_t>(kMaxRank);
    for (size_t i = 0; valid && i < dims.size(); ++i) {
      dims[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(r, static_cast<Py_ssize_t>(i)));
      valid = dims[i] >= -1;
    }
    if (PyErr_Occurred()) PyErr_Clear();  // (reported below as a bad answer)
    if (valid) {
      g_shape_payload.store(p);
      g_shape_dims = std::move(dims);
      Py_DECREF(r);
      PyGILState_Release(g);
      return static_cast<int64_t>(g_shape_dims.size());
    }
  }
  if (r != nullptr) {
    // dispatch validates; this is the last line of defence before an int.
    int overflow = 0;
    long long v = PyLong_Check(r) ? PyLong_AsLongLongAndOverflow(r, &overflow) : min_value - 1;
    if (!PyErr_Occurred()) {
      if (overflow != 0 || v < min_value || v > max_value) {
        SetHookOutputError(stack, hook, ProducerOf(p), SafeRepr(r) + expected);
      } else {
        result = v;
      }
    }
    Py_DECREF(r);
  }
  if (PyErr_Occurred()) {
    StatusFromPyErr(status, /*accessor=*/true);
    result = -1;
  }
  PyGILState_Release(g);
  return result;
}

int PayloadNumDims(void* data, TF_Status* status) {
  auto* p = static_cast<TFOH_Payload*>(data);
  if (p->shape_source != nullptr) return TFE_TensorHandleNumDims(p->shape_source, status);
  return static_cast<int>(AskShapeHook(
      p, "num_dims",
      [p](PyObject* stack) {
        return PyObject_CallFunctionObjArgs(g_num_dims, stack,
                                            reinterpret_cast<PyObject*>(p->value),
                                            ProducerOf(p), nullptr);
      },
      0, kMaxRank, " (a rank is an int from 0 to " + std::to_string(kMaxRank) + ")", status));
}

int64_t PayloadDim(void* data, int dim_index, TF_Status* status) {
  auto* p = static_cast<TFOH_Payload*>(data);
  if (p->shape_source != nullptr) return TFE_TensorHandleDim(p->shape_source, dim_index, status);
  if (g_shape_payload.load(std::memory_order_relaxed) == p && PythonAlive()) {
    PyGILState_STATE g = PyGILState_Ensure();  // (the peek above is checked again here)
    const bool hit = g_shape_payload.load(std::memory_order_relaxed) == p && dim_index >= 0 &&
                     static_cast<size_t>(dim_index) < g_shape_dims.size();
    const int64_t d = hit ? g_shape_dims[static_cast<size_t>(dim_index)] : -1;
    PyGILState_Release(g);
    if (hit) return d;
  }
  return AskShapeHook(
      p, "dim",
      [p, dim_index](PyObject* stack) {
        return PyObject_CallFunction(g_dim, "OOiO", stack, reinterpret_cast<PyObject*>(p->value),
                                     dim_index, ProducerOf(p));
      },
      -1, std::numeric_limits<long long>::max(),
      " for axis " + std::to_string(dim_index) +
          " (an axis length is an int >= 0, or -1 when unknown)",
      status);
}

void PayloadDeallocate(void* data) {
  auto* p = static_cast<TFOH_Payload*>(data);
  if (p->shape_source != nullptr) TFE_DeleteTensorHandle(p->shape_source);
  p->shape_source = nullptr;
  if (!PythonAlive()) {
    // The interpreter is gone or going: Python objects must not be touched. The
    // references are leaked deliberately; the process is exiting.
    delete p;
    return;
  }
  // A payload made without the GIL and never given a Python value: its only reference is
  // its count of the anchor, dropped without the GIL unless it is the last.
  if (p->anchor != nullptr && p->value == nullptr &&
      ReleaseStackAnchorNoGil(static_cast<StackAnchor*>(p->anchor))) {
    const TFOH_Payload* cached = p;  // (never asked by Python without a value; if so)
    g_shape_payload.compare_exchange_strong(cached, nullptr);
    delete p;
    return;
  }
  if (PyGILState_Check()) {
    FreePayloadWithGil(p);
  } else if (PyGILState_GetThisThreadState() != nullptr) {
    // A Python thread that released the GIL around TFE_DeleteTensorHandle (as
    // EagerTensor's dealloc does so that destructors may call into Python): taking it
    // back here is what TensorFlow intends, and nothing waits on this thread.
    PyGILState_STATE g = PyGILState_Ensure();
    FreePayloadWithGil(p);
    PyGILState_Release(g);
  } else {
    // A TensorFlow executor thread: a Python thread may hold the GIL while waiting for
    // this executor, so never wait for the GIL here.
    std::lock_guard<std::mutex> l(g_pending_mu);
    g_pending.push_back(p);
    g_maybe_pending.store(true, std::memory_order_release);
  }
}

TF_Buffer* PayloadSummarize(void* data, TF_Status* status) {
  auto* p = static_cast<TFOH_Payload*>(data);
  if (p->kind != TFOH_PAYLOAD_PYTHON || !PythonAlive()) {
    TF_SetStatus(status, TF_UNIMPLEMENTED, "no summary");
    return nullptr;
  }
  PyGILState_STATE g = PyGILState_Ensure();
  TF_Buffer* buf = nullptr;
  PyObject* stack = reinterpret_cast<PyObject*>(p->stack);
  PyObject* value = PayloadValue(p);  // borrowed
  PyObject* r = value != nullptr
                    ? PyObject_CallFunctionObjArgs(g_summarize, stack, value, nullptr)
                    : nullptr;
  if (r != nullptr && !PyUnicode_Check(r)) {
    SetHookOutputError(stack, "tensor_debug_string", ProducerOf(p),
                       SafeRepr(r) + " (it must return a str)");
  } else if (r != nullptr) {
    // Lone surrogates are shown escaped rather than failing the repr.
    PyObject* bytes = PyUnicode_AsEncodedString(r, "utf-8", "backslashreplace");
    if (bytes != nullptr) {
      buf = TF_NewBufferFromString(PyBytes_AS_STRING(bytes),
                                   static_cast<size_t>(PyBytes_GET_SIZE(bytes)));
      Py_DECREF(bytes);
    }
  }
  Py_XDECREF(r);
  if (PyErr_Occurred()) StatusFromPyErr(status, /*accessor=*/true);
  PyGILState_Release(g);
  return buf;
}

}  // namespace

bool PendingQueued() { return g_maybe_pending.load(std::memory_order_relaxed); }

void DrainPending() {
  if (!g_maybe_pending.load(std::memory_order_acquire)) return;
  std::vector<TFOH_Payload*> todo;
  {
    std::lock_guard<std::mutex> l(g_pending_mu);
    g_maybe_pending.store(false, std::memory_order_relaxed);
    if (g_pending.empty()) return;
    todo.swap(g_pending);
  }
  for (TFOH_Payload* p : todo) FreePayloadWithGil(p);
}

TFOH_Payload* PayloadOf(TFE_TensorHandle* handle) {
  if (g_ctx == nullptr) return nullptr;
  TF_Status* s = ThreadStatus();
  const char* d = TFE_TensorHandleDeviceName(handle, s);
  TFOH_Payload* p = nullptr;
  // A custom-device handle names its device with the device's own name string, which
  // lives as long as the device (the dispatcher: the process), so once a name at an
  // address matched, that address is ours: no other live string can have it.
  static std::atomic<const char*> ours{nullptr};
  bool match = false;
  if (TF_GetCode(s) == TF_OK && d != nullptr) {
    match = d == ours.load(std::memory_order_relaxed) || g_device_name == d;
  }
  if (match) {
    ours.store(d, std::memory_order_relaxed);
    p = static_cast<TFOH_Payload*>(TFE_TensorHandleDevicePointer(handle, s));
    if (TF_GetCode(s) != TF_OK) p = nullptr;
  }
  return p;
}

// A new Python-kind payload holding `stack` and `producer` (None/null: no producer),
// with no value or shape source yet. GIL: held.
static TFOH_Payload* NewPythonPayload(PyObject* stack, PyObject* producer) {
  auto* p = new TFOH_Payload();
  p->kind = TFOH_PAYLOAD_PYTHON;
  Py_INCREF(stack);
  p->stack = stack;
  p->value = nullptr;
  p->shape_source = nullptr;
  if (producer != nullptr && producer != Py_None) Py_INCREF(producer);
  p->producer = (producer != nullptr && producer != Py_None) ? producer : nullptr;
  return p;
}

// The dispatcher-device handle owning `p` (taken in every case: TensorFlow calls the
// deallocator on failure). Null with a Python exception set on failure. GIL: held.
static TFE_TensorHandle* HandleOfPayload(TFOH_Payload* p, TF_DataType dtype, TF_Status* s) {
  TFE_CustomDeviceTensorHandle methods;
  methods.num_dims = &PayloadNumDims;
  methods.dim = &PayloadDim;
  methods.deallocator = &PayloadDeallocate;
  methods.summarize = &PayloadSummarize;
  TFE_TensorHandle* h =
      TFE_NewCustomDeviceTensorHandle(g_ctx, g_device_name.c_str(), dtype, p, methods, s);
  if (TF_GetCode(s) != TF_OK) {
    PyErr_Format(PyExc_RuntimeError, "tf_ophandlers: cannot create handler tensor: %s",
                 TF_Message(s));
    return nullptr;
  }
  return h;
}

TFE_TensorHandle* NewAnchoredHandle(StackAnchor* anchor, TFE_TensorHandle* value,
                                    TF_DataType dtype, PyObject* producer, PyObject* lazy,
                                    TF_Status* s) {
  anchor->count.fetch_add(1, std::memory_order_relaxed);  // the caller holds one
  auto* p = new TFOH_Payload();
  p->kind = TFOH_PAYLOAD_PYTHON;
  p->stack = anchor->stack;
  p->producer = producer;
  p->shape_source = value;  // its Python value is made on first use (PayloadValue)
  p->anchor = anchor;
  p->lazy = lazy;
  TFE_CustomDeviceTensorHandle methods;
  methods.num_dims = &PayloadNumDims;
  methods.dim = &PayloadDim;
  methods.deallocator = &PayloadDeallocate;
  methods.summarize = &PayloadSummarize;
  // On failure TensorFlow has called the deallocator (the count is not the last: the
  // caller's remains, so no GIL is needed).
  return TFE_NewCustomDeviceTensorHandle(g_ctx, g_device_name.c_str(), dtype, p, methods, s);
}

TFE_TensorHandle* NewHandlerTensorHandle(PyObject* stack, PyObject* value, TF_DataType dtype,
                                         PyObject* producer, bool shape_from_value) {
  if (g_ctx == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "tf_ophandlers: dispatcher not initialized");
    return nullptr;
  }
  DrainPending();
  TFOH_Payload* p = NewPythonPayload(stack, producer);
  Py_INCREF(value);
  p->value = value;
  TF_Status* s = ThreadStatus();
  if (shape_from_value && EagerTensor_CheckExact(value)) {
    p->shape_source = TFE_TensorHandleCopySharingTensor(EagerTensor_Handle(value), s);
    if (TF_GetCode(s) != TF_OK) p->shape_source = nullptr;
    TF_SetStatus(s, TF_OK, "");
  }
  return HandleOfPayload(p, dtype, s);
}

TFE_TensorHandle* NewHandlerTensorHandleFromHandle(PyObject* stack, TFE_TensorHandle* value,
                                                   TF_DataType dtype, PyObject* producer,
                                                   PyObject* lazy) {
  if (g_ctx == nullptr) {
    TFE_DeleteTensorHandle(value);
    PyErr_SetString(PyExc_RuntimeError, "tf_ophandlers: dispatcher not initialized");
    return nullptr;
  }
  DrainPending();
  TFOH_Payload* p = NewPythonPayload(stack, producer);
  p->shape_source = value;  // its Python value is made on first use (PayloadValue)
  if (lazy != nullptr) {
    Py_INCREF(lazy);
    p->lazy = lazy;
  }
  TF_Status* s = ThreadStatus();
  return HandleOfPayload(p, dtype, s);
}

namespace {

// The value of a payload with skipped levels: shape_source's tensor wrapped by each
// skipped stack from the lowest up (as their RunForward would have), as an EagerTensor
// (new reference), or null with a Python exception set. GIL: held.
PyObject* MakeLazyValue(TFOH_Payload* p) {
  PyObject* lazy = reinterpret_cast<PyObject*>(p->lazy);
  PyObject* producer = p->producer != nullptr ? reinterpret_cast<PyObject*>(p->producer)
                                              : nullptr;
  TF_Status* s = ThreadStatus();
  TF_DataType dtype = TFE_TensorHandleDataType(p->shape_source);
  TFE_TensorHandle* h = TFE_TensorHandleCopySharingTensor(p->shape_source, s);
  if (TF_GetCode(s) != TF_OK) {
    PyErr_SetString(PyExc_RuntimeError, TF_Message(s));
    TF_SetStatus(s, TF_OK, "");
    return nullptr;
  }
  Py_ssize_t n = PyTuple_Check(lazy) ? PyTuple_GET_SIZE(lazy) : 1;
  for (Py_ssize_t i = n - 1; i >= 0 && h != nullptr; --i) {
    PyObject* stack = PyTuple_Check(lazy) ? PyTuple_GET_ITEM(lazy, i) : lazy;
    h = NewHandlerTensorHandleFromHandle(stack, h, dtype, producer);  // takes h
  }
  if (h == nullptr) return nullptr;
  PyObject* v = EagerTensorFromHandle(h, false);  // owns `h` on success
  if (v == nullptr) TFE_DeleteTensorHandle(h);
  return v;
}

}  // namespace

PyObject* PayloadValue(TFOH_Payload* p) {
  if (p->value != nullptr) return reinterpret_cast<PyObject*>(p->value);
  if (p->lazy != nullptr && p->shape_source != nullptr) {
    PyObject* v = MakeLazyValue(p);
    if (v == nullptr) return nullptr;
    p->value = v;
    PyObject* lazy = reinterpret_cast<PyObject*>(p->lazy);
    p->lazy = nullptr;
    if (p->anchor == nullptr) Py_DECREF(lazy);  // (anchored: borrowed)
    return v;
  }
  if (p->shape_source == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "tf_ophandlers: a handler tensor without a value");
    return nullptr;
  }
  // A wrapper of its own sharing the tensor (shape_source stays the payload's), kept
  // from now on: Python code (a tape keying by handle) sees one stable object.
  TF_Status* s = ThreadStatus();
  TFE_TensorHandle* copy = TFE_TensorHandleCopySharingTensor(p->shape_source, s);
  if (TF_GetCode(s) != TF_OK) {
    PyErr_SetString(PyExc_RuntimeError, TF_Message(s));
    TF_SetStatus(s, TF_OK, "");
    return nullptr;
  }
  PyObject* v = EagerTensorFromHandle(copy, false);  // owns `copy` on success
  if (v == nullptr) {
    TFE_DeleteTensorHandle(copy);
    return nullptr;
  }
  p->value = v;
  return v;
}

TFE_TensorHandle* PayloadTensorHandle(TFOH_Payload* p) {
  if (p->kind != TFOH_PAYLOAD_PYTHON) return nullptr;
  if (p->value == nullptr) return p->shape_source;
  PyObject* v = reinterpret_cast<PyObject*>(p->value);
  return EagerTensor_CheckExact(v) ? EagerTensor_Handle(v) : nullptr;
}

PyObject* WrapHandlerTensor(PyObject* stack, PyObject* value, TF_DataType dtype,
                            PyObject* producer, bool shape_from_value) {
  TFE_TensorHandle* h = NewHandlerTensorHandle(stack, value, dtype, producer, shape_from_value);
  if (h == nullptr) return nullptr;
  PyObject* t = EagerTensorFromHandle(h, false);
  if (t == nullptr) TFE_DeleteTensorHandle(h);  // frees the payload through its deallocator
  return t;
}

}  // namespace tf_ophandlers
