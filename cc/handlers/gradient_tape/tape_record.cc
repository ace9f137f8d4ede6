// tf-ophandlers: oh.GradientTape's per-op recording in C. Contracts: tape_record.h.
#define PY_SSIZE_T_CLEAN
#include "handlers/gradient_tape/tape_record.h"

#include <structmember.h>

#include <cstdint>
#include <cstring>

#include "absl/container/inlined_vector.h"
#include "fast/fast_internal.h"
#include "boundary/handler_tensor.h"
#include "native/native_internal.h"
#include "boundary/op.h"
#include "boundary/owners.h"
#include "boundary/runtime.h"

// TensorFlow's tape-set queries (pywrap_tfe.h; lib_pywrap_tensorflow_common.so, which
// the extension links): called directly, not through their pybind11 wrappers.
PyObject* TFE_Py_TapeSetIsStopped();
PyObject* TFE_Py_TapeSetIsEmpty();

namespace tf_ophandlers {
namespace {

// ---- _C.TapeRecord: one recorded operation (read-only attributes) ------------------------

struct RecordObject {
  PyObject_HEAD
  PyObject* fields[9];
};

PyMemberDef kRecordMembers[] = {
    {"seq", T_OBJECT, offsetof(RecordObject, fields) + 0 * sizeof(PyObject*), READONLY,
     "order of recording"},
    {"op_type", T_OBJECT, offsetof(RecordObject, fields) + 1 * sizeof(PyObject*), READONLY,
     "the op type (a gradient registry key)"},
    {"op", T_OBJECT, offsetof(RecordObject, fields) + 2 * sizeof(PyObject*), READONLY,
     "the oh.Op (None for Python-recorded gradients)"},
    {"backward", T_OBJECT, offsetof(RecordObject, fields) + 3 * sizeof(PyObject*), READONLY,
     "a Python backward function, or None"},
    {"inputs", T_OBJECT, offsetof(RecordObject, fields) + 4 * sizeof(PyObject*), READONLY,
     "the inputs, as the tape saw them first"},
    {"outputs", T_OBJECT, offsetof(RecordObject, fields) + 5 * sizeof(PyObject*), READONLY,
     "the outputs"},
    {"stack", T_OBJECT, offsetof(RecordObject, fields) + 6 * sizeof(PyObject*), READONLY,
     "the stack the forward op ran on (its gradient runs there)"},
    {"skip", T_OBJECT, offsetof(RecordObject, fields) + 7 * sizeof(PyObject*), READONLY,
     "indices of inputs that need no gradient"},
    {"ids", T_OBJECT, offsetof(RecordObject, fields) + 8 * sizeof(PyObject*), READONLY,
     "(input ids, output ids, output specs): the graph's links (tape_record.h)"},
    {nullptr}};

int RecordTraverse(PyObject* self, visitproc visit, void* arg) {
  for (PyObject* f : reinterpret_cast<RecordObject*>(self)->fields) Py_VISIT(f);
  return 0;
}

int RecordClear(PyObject* self) {
  for (PyObject*& f : reinterpret_cast<RecordObject*>(self)->fields) Py_CLEAR(f);
  return 0;
}

void RecordDealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  RecordClear(self);
  Py_TYPE(self)->tp_free(self);
}

PyTypeObject RecordType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// A new record owning new references to `fields`; null with an exception set.
PyObject* NewRecord(PyObject* const* fields) {
  RecordObject* r = PyObject_GC_New(RecordObject, &RecordType);
  if (r == nullptr) return nullptr;
  for (int i = 0; i < 9; ++i) {
    Py_INCREF(fields[i]);
    r->fields[i] = fields[i];
  }
  PyObject_GC_Track(reinterpret_cast<PyObject*>(r));
  return reinterpret_cast<PyObject*>(r);
}

// TapeRecord(seq, op_type, op, backward, inputs, outputs, stack, skip, ids)
PyObject* RecordNew(PyTypeObject*, PyObject* args, PyObject* kwargs) {
  if ((kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0) || !PyTuple_Check(args) ||
      PyTuple_GET_SIZE(args) != 9) {
    PyErr_SetString(PyExc_TypeError,
                    "TapeRecord(seq, op_type, op, backward, inputs, outputs, stack, skip, ids)");
    return nullptr;
  }
  return NewRecord(&PyTuple_GET_ITEM(args, 0));
}

bool ReadyRecordType() {
  if (RecordType.tp_flags & Py_TPFLAGS_READY) return true;
  RecordType.tp_name = "tf_ophandlers._C.TapeRecord";
  RecordType.tp_basicsize = sizeof(RecordObject);
  RecordType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  RecordType.tp_doc = "One operation recorded by oh.GradientTape (read-only).";
  RecordType.tp_traverse = RecordTraverse;
  RecordType.tp_clear = RecordClear;
  RecordType.tp_dealloc = RecordDealloc;
  RecordType.tp_members = kRecordMembers;
  RecordType.tp_new = RecordNew;
  return PyType_Ready(&RecordType) == 0;
}

// ---- after_execute ------------------------------------------------------------------------

PyObject* g_after_fn = nullptr;  // the after_execute function (bound methods wrap it)
uint64_t g_trainable = 0;          // bit per differentiable TF_DataType (IsTrainable)
PyObject* s_live = nullptr;
PyObject* s_tracked = nullptr;
PyObject* s_producer = nullptr;
PyObject* s_seq = nullptr;
PyObject* s_python = nullptr;  // GradientTape._after_execute_python
PyObject* s_bridge = nullptr;  // GradientTape._bridge_to_tf_tapes
PyObject* s_sweep_at = nullptr;  // GradientTape._sweep_at
PyObject* s_sweep = nullptr;     // GradientTape._sweep_tracked
constexpr Py_ssize_t kSweepMin = 1024;  // `_tracked` sizes below never ask for a sweep
PyObject* g_used_fn = nullptr;   // used_indices(op_type) -> (inputs, outputs), None = all
PyObject* g_used = nullptr;      // dict op_type -> used_indices(op_type), filled lazily
constexpr int kUidShift = 20;    // an output's id: (seq << kUidShift) | index

// used_indices(type) (cached per op type), a new reference; null with an exception set.
// New, not borrowed: the caller runs Python code before it reads the pair, during which
// another thread may fill or clear the cache (a borrowed pair replaced there was freed
// under the first thread, which then read garbage).
PyObject* UsedIndices(PyObject* type) {
  PyObject* r = PyDict_GetItemWithError(g_used, type);
  if (r != nullptr) return Py_NewRef(r);
  if (PyErr_Occurred()) return nullptr;
  r = PyObject_CallOneArg(g_used_fn, type);
  if (r == nullptr) return nullptr;
  if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2) {
    Py_DECREF(r);
    PyErr_SetString(PyExc_TypeError, "used_indices must return a pair");
    return nullptr;
  }
  if (PyDict_GET_SIZE(g_used) >= 4096) PyDict_Clear(g_used);  // bounded (op types)
  if (PyDict_SetItem(g_used, type, r) < 0) Py_CLEAR(r);
  return r;
}

// Whether index `i` is in `used` (None: every index); -1 with an exception set.
int IsUsed(PyObject* used, Py_ssize_t i) {
  if (used == Py_None) return 1;
  PyObject* idx = PyLong_FromSsize_t(i);
  if (idx == nullptr) return -1;
  int r = PySet_Contains(used, idx);
  Py_DECREF(idx);
  return r;
}

// Whether the tape may track output `o` of an op run on `next` by weak reference: when
// the caller gets a tensor whose payload holds `o` itself (fast_record.cc wraps it), so
// `o` lives as long as the caller's tensor. Not for the outputs the caller gets as they
// are (the fast path's "leaves": a transient resource handle, a tensor that is not of
// the next stack), whose handle outlives this wrapper: those are held.
bool MayTrackWeakly(PyObject* o, PyObject* next) {
  TFE_TensorHandle* h = EagerTensor_Handle(o);
  if (TFE_TensorHandleDataType(h) == TF_RESOURCE) return false;
  if (next == native_internal::g_physical) return true;
  TFOH_Payload* p = PayloadOf(h);
  return p != nullptr && reinterpret_cast<PyObject*>(p->stack) == next;
}

// (dtype enum, dims) of an eager tensor, new reference or null.
PyObject* Spec(PyObject* t) {
  TFE_TensorHandle* h = EagerTensor_Handle(t);
  TF_Status* status = TF_NewStatus();
  int n = TFE_TensorHandleNumDims(h, status);
  PyObject* dims = nullptr;
  if (TF_GetCode(status) == TF_OK && n >= 0) dims = PyTuple_New(n);
  for (int d = 0; dims != nullptr && d < n; ++d) {
    int64_t v = TFE_TensorHandleDim(h, d, status);
    PyObject* x = TF_GetCode(status) == TF_OK ? PyLong_FromLongLong(v) : nullptr;
    if (x == nullptr) Py_CLEAR(dims);
    else PyTuple_SET_ITEM(dims, d, x);
  }
  TF_DeleteStatus(status);
  if (dims == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "tape record: no shape");
    return nullptr;
  }
  return Py_BuildValue("(iN)", static_cast<int>(TFE_TensorHandleDataType(h)), dims);
}

// tensor_key(t) (module.cc PyTensorKey): the TensorFlow handle of an EagerTensor.
PyObject* Key(PyObject* t) {
  return PyLong_FromVoidPtr(EagerTensor_CheckExact(t) ? static_cast<void*>(EagerTensor_Handle(t))
                                                      : static_cast<void*>(t));
}

bool Trainable(PyObject* t) {
  int dt = static_cast<int>(TFE_TensorHandleDataType(EagerTensor_Handle(t)));
  return dt >= 0 && dt < 64 && ((g_trainable >> dt) & 1) != 0;
}

// Whether `type` is one of the ops whose untracked read may watch a variable first.
bool VariableRead(const char* type) {
  return !std::strcmp(type, "ReadVariableOp") || !std::strcmp(type, "ResourceGather") ||
         !std::strcmp(type, "ResourceGatherNd");
}

bool CopyOp(const char* type) {
  return !std::strcmp(type, "CopyOn") || !std::strcmp(type, "CopyOff") ||
         !std::strcmp(type, "CopyOnGrad") || !std::strcmp(type, "CopyOffGrad");
}

// The truth value of `r` (a new reference, or null with an exception set), released:
// 1, 0, or -1 with an exception set.
int Truth(PyObject* r) {
  if (r == nullptr) return -1;
  int t = PyObject_IsTrue(r);
  Py_DECREF(r);
  return t;
}

// The stack of the running hook's frame (`next_stack()`), new reference or null.
PyObject* RunningNext() {
  if (native_internal::g_state == nullptr) return nullptr;
  PyObject* frames = PyObject_GetAttr(native_internal::g_state, native_internal::s_frames);
  if (frames == nullptr) return nullptr;
  PyObject* next = nullptr;
  if (PyList_Check(frames) && PyList_GET_SIZE(frames) > 0) {
    next = PyObject_GetAttr(PyList_GET_ITEM(frames, PyList_GET_SIZE(frames) - 1),
                            native_internal::s_next);
  } else {
    PyErr_SetString(PyExc_RuntimeError,
                    "oh.GradientTape.after_execute runs only inside the tape's hook");
  }
  Py_DECREF(frames);
  return next;
}

// Where a recording runs: in the tape's hook frame (called as a Python method), or from
// the fast path with no frame pushed (`stack` the tape's stack, `next` below it), where
// the Python methods it calls get the frame they would have had (fast::CallHook).
struct Frame {
  PyObject* stack = nullptr;  // null: in the hook's frame already
  PyObject* next = nullptr;
};

// tape.<name>(op, inputs, outputs), in the hook's frame.
PyObject* CallInFrame(const Frame& f, PyObject* tape, PyObject* name, PyObject* op,
                      PyObject* inputs, PyObject* outputs) {
  if (f.stack == nullptr) return PyObject_CallMethodObjArgs(tape, name, op, inputs, outputs, nullptr);
  PyObject* fn = PyObject_GetAttr(tape, name);
  if (fn == nullptr) return nullptr;
  PyObject* r = fast::CallHook(f.stack, f.next, fn, op, inputs, outputs);
  Py_DECREF(fn);
  return r;
}

PyObject* Slow(const Frame& f, PyObject* tape, PyObject* op, PyObject* inputs,
               PyObject* outputs) {
  return CallInFrame(f, tape, s_python, op, inputs, outputs);
}

// The tape's attribute `name` from its instance dict `state` (PyObject_GetAttr searches
// the classes first, slow when the type cache misses); new reference or null.
PyObject* StateItem(PyObject* state, PyObject* name) {
  PyObject* v = PyDict_GetItemWithError(state, name);
  if (v != nullptr) return Py_NewRef(v);
  if (!PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, name);
  return nullptr;
}

// A long-lived tape's `_tracked` drops the entries of outputs that are gone, when it has
// doubled since the last sweep (`_sweep_at`; amortized O(1) per record): 0, or -1 with
// an exception set.
int MaybeSweep(PyObject* tape, PyObject* state, PyObject* tracked) {
  if (PyDict_GET_SIZE(tracked) < kSweepMin) return 0;
  PyObject* at = StateItem(state, s_sweep_at);
  if (at == nullptr) return -1;
  Py_ssize_t v = PyLong_AsSsize_t(at);
  Py_DECREF(at);
  if (v == -1 && PyErr_Occurred()) return -1;
  if (PyDict_GET_SIZE(tracked) < v) return 0;
  PyObject* r = PyObject_CallMethodNoArgs(tape, s_sweep);
  Py_XDECREF(r);
  return r == nullptr ? -1 : 0;
}

// Records `op` (see tape_record.h) in frame `f`; `state` is the tape's instance dict.
PyObject* RecordWith(const Frame& f, PyObject* tape, PyObject* state, PyObject* op,
                     PyObject* inputs, PyObject* outputs) {
  if (s_python == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "tf_ophandlers: tape_setup was not called");
    return nullptr;
  }
  PyObject* live = StateItem(state, s_live);
  if (live == nullptr) return nullptr;
  int is_live = PyObject_IsTrue(live);
  Py_DECREF(live);
  if (is_live <= 0) {
    if (is_live < 0) return nullptr;
    Py_RETURN_NONE;
  }
  if (!PyList_CheckExact(inputs) || !PyList_CheckExact(outputs) ||
      !PyObject_TypeCheck(op, &OpBaseType)) {
    return Slow(f, tape, op, inputs, outputs);
  }
  const char* type = PyUnicode_AsUTF8(reinterpret_cast<OpObject*>(op)->type);
  if (type == nullptr) return nullptr;
  if (CopyOp(type)) return Slow(f, tape, op, inputs, outputs);
  Py_ssize_t n_out = PyList_GET_SIZE(outputs);
  for (Py_ssize_t j = 0; j < n_out; ++j) {
    if (!EagerTensor_CheckExact(PyList_GET_ITEM(outputs, j))) return Slow(f, tape, op, inputs, outputs);
  }
  // Released in the reverse order of these declarations (`tracked` last).
  PyRef tracked_ref(StateItem(state, s_tracked));
  PyObject* tracked = tracked_ref.get();
  if (tracked == nullptr) return nullptr;
  if (!PyDict_CheckExact(tracked)) {
    tracked_ref.reset();
    return Slow(f, tape, op, inputs, outputs);
  }
  // Which inputs are tracked (the tape's first objects for them, alive), nothing changed
  // yet. `_tracked` maps a key to (tensor or weakref to it, id) (gradient_tape/handler.py).
  Py_ssize_t n_in = PyList_GET_SIZE(inputs);
  if (n_out >= (Py_ssize_t{1} << kUidShift)) {
    tracked_ref.reset();
    return Slow(f, tape, op, inputs, outputs);
  }
  PyRef skip;
  PyRef seq;
  PyRef next_seq;
  PyRef stack;
  PyRef record;
  PyRef producer;
  PyRef rec_in;
  PyRef in_ids;
  PyRef rec_out;
  PyRef out_ids;
  PyRef specs;
  PyRef used;
  PyRef all_ids;
  absl::InlinedVector<PyRef, 4> ids(n_in);
  absl::InlinedVector<PyRef, 4> known(n_in);
  bool found = false;
  bool malformed = false;
  for (Py_ssize_t i = 0; i < n_in; ++i) {
    PyRef key(Key(PyList_GET_ITEM(inputs, i)));
    if (!key) return nullptr;
    PyObject* entry = PyDict_GetItemWithError(tracked, key.get());
    key.reset();
    if (entry == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      continue;
    }
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2) {
      malformed = true;
      break;
    }
    PyObject* value = PyTuple_GET_ITEM(entry, 0);
    if (PyWeakref_CheckRef(value)) {
      value = PyWeakref_GET_OBJECT(value);
      if (value == Py_None) continue;  // gone: the key may be a new tensor's
    }
    known[i] = PyRef::Borrow(value);
    ids[i] = PyRef::Borrow(PyTuple_GET_ITEM(entry, 1));
    found = true;
  }
  if (malformed) return Slow(f, tape, op, inputs, outputs);
  if (!found) {
    if (VariableRead(type)) return Slow(f, tape, op, inputs, outputs);  // may watch one now
    return Py_NewRef(Py_None);
  }
  const int stopped = Truth(TFE_Py_TapeSetIsStopped());
  if (stopped != 0) return stopped > 0 ? Py_NewRef(Py_None) : nullptr;
  bool any_trainable = false;
  for (Py_ssize_t j = 0; j < n_out; ++j) {
    if (Trainable(PyList_GET_ITEM(outputs, j))) any_trainable = true;
  }
  if (!any_trainable) return Py_NewRef(Py_None);
  Py_ssize_t n_skip = 0;
  for (Py_ssize_t i = 0; i < n_in; ++i) n_skip += !known[i];
  skip.reset(PyTuple_New(n_skip));
  if (!skip) return nullptr;
  for (Py_ssize_t i = 0, k = 0; i < n_in; ++i) {
    if (!known[i]) {
      PyObject* idx = PyLong_FromSsize_t(i);
      if (idx == nullptr) return nullptr;
      PyTuple_SET_ITEM(skip.get(), k++, idx);
    }
  }
  // As TensorFlow's tape: keep only what the gradient function reads, unless a
  // TensorFlow tape or accumulator records too (it may differentiate more).
  const int empty = Truth(TFE_Py_TapeSetIsEmpty());
  if (empty < 0) return nullptr;
  if (empty > 0) {
    used.reset(UsedIndices(reinterpret_cast<OpObject*>(op)->type));
    if (!used) return nullptr;
  }
  seq.reset(StateItem(state, s_seq));
  if (!seq) return nullptr;
  long long base = 0;
  {
    Py_ssize_t v = PyLong_AsSsize_t(seq.get());
    if (v == -1 && PyErr_Occurred()) return nullptr;
    next_seq.reset(PyLong_FromSsize_t(v + 1));
    base = static_cast<long long>(v + 1) << kUidShift;
  }
  if (!next_seq) return nullptr;
  stack.reset(f.stack != nullptr ? Py_NewRef(f.next) : RunningNext());
  if (!stack) return nullptr;
  producer.reset(StateItem(state, s_producer));
  if (!producer) return nullptr;
  rec_in.reset(PyList_New(n_in));
  in_ids.reset(PyTuple_New(n_in));
  rec_out.reset(PyList_New(n_out));
  out_ids.reset(PyTuple_New(n_out));
  if (!rec_in || !in_ids || !rec_out || !out_ids) return nullptr;
  for (Py_ssize_t i = 0; i < n_in; ++i) {
    if (known[i]) {
      PyList_SetItem(inputs, i, Py_NewRef(known[i].get()));  // releases the wrapper seen now
    }
    PyObject* x = PyList_GET_ITEM(inputs, i);
    int keep = !used ? 1 : IsUsed(PyTuple_GET_ITEM(used.get(), 0), i);
    if (keep < 0) return nullptr;
    PyList_SET_ITEM(rec_in.get(), i, Py_NewRef(keep ? x : Py_None));
    PyTuple_SET_ITEM(in_ids.get(), i, Py_NewRef(ids[i] ? ids[i].get() : Py_None));
  }
  for (Py_ssize_t j = 0; j < n_out; ++j) {
    PyObject* o = PyList_GET_ITEM(outputs, j);
    PyObject* uid = PyLong_FromLongLong(base | j);
    if (uid == nullptr) return nullptr;
    PyTuple_SET_ITEM(out_ids.get(), j, uid);
    int keep = !used ? 1 : IsUsed(PyTuple_GET_ITEM(used.get(), 1), j);
    if (keep < 0) return nullptr;
    TF_DataType dt = TFE_TensorHandleDataType(EagerTensor_Handle(o));
    if (dt == TF_RESOURCE || dt == TF_VARIANT) keep = 1;
    PyList_SET_ITEM(rec_out.get(), j, Py_NewRef(keep ? o : Py_None));
    if (!keep && n_out > 1) {  // zeros of it, when only another output gets a gradient
      if (!specs) {
        specs.reset(PyTuple_New(n_out));
        if (!specs) return nullptr;
        for (Py_ssize_t k = 0; k < n_out; ++k) {
          PyTuple_SET_ITEM(specs.get(), k, Py_NewRef(Py_None));
        }
      }
      PyObject* spec = Spec(o);
      if (spec == nullptr) return nullptr;
      Py_SETREF(PyTuple_GET_ITEM(specs.get(), j), spec);
    }
  }
  all_ids.reset(PyTuple_Pack(3, in_ids.get(), out_ids.get(), specs ? specs.get() : Py_None));
  if (!all_ids) return nullptr;
  if (PyDict_SetItem(state, s_seq, next_seq.get()) < 0) return nullptr;
  {
    PyObject* op_type = reinterpret_cast<OpObject*>(op)->type;
    PyObject* fields[9] = {next_seq.get(), op_type,    op,         Py_None,     rec_in.get(),
                           rec_out.get(),  stack.get(), skip.get(), all_ids.get()};
    record.reset(NewRecord(fields));
  }
  if (!record) return nullptr;
  for (Py_ssize_t j = 0; j < n_out; ++j) {
    PyObject* o = PyList_GET_ITEM(outputs, j);
    if (!Trainable(o)) continue;
    PyObject* uid = PyTuple_GET_ITEM(out_ids.get(), j);
    PyRef ref(MayTrackWeakly(o, stack.get()) ? PyWeakref_NewRef(o, nullptr) : Py_NewRef(o));
    PyRef entry(ref ? PyTuple_Pack(2, ref.get(), uid) : nullptr);
    ref.reset();
    PyRef key(entry ? Key(o) : nullptr);
    if (!key || PyDict_SetItem(tracked, key.get(), entry.get()) < 0 ||
        PyDict_SetItem(producer.get(), uid, record.get()) < 0) {
      return nullptr;
    }
  }
  if (MaybeSweep(tape, state, tracked) < 0) return nullptr;
  if (empty == 0) {
    // A tf.GradientTape (or ForwardAccumulator) is active: it sees the op too.
    return CallInFrame(f, tape, s_bridge, op, inputs, outputs);
  }
  return Py_NewRef(Py_None);
}

PyObject* Record(const Frame& f, PyObject* tape, PyObject* op, PyObject* inputs,
                 PyObject* outputs) {
  PyObject* state = PyObject_GenericGetDict(tape, nullptr);
  if (state == nullptr) return nullptr;
  PyObject* r = PyDict_CheckExact(state) ? RecordWith(f, tape, state, op, inputs, outputs)
                                         : Slow(f, tape, op, inputs, outputs);
  Py_DECREF(state);
  return r;
}

// after_execute(tape, op, inputs, outputs): see tape_record.h.
PyObject* AfterExecute(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "after_execute(op, inputs, outputs)");
    return nullptr;
  }
  return Record(Frame(), args[0], args[1], args[2], args[3]);
}

PyMethodDef kAfterExecuteDef = {
    "after_execute", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(AfterExecute)),
    METH_FASTCALL,
    "after_execute(op, inputs, outputs): records op when an input is tracked (C; "
    "cc/handlers/gradient_tape/tape_record.h)."};

// tape_setup(trainable_enums, used_indices) -> (TapeRecord, after_execute)
PyObject* PyTapeSetup(PyObject*, PyObject* args) {
  PyObject *trainable, *used_fn;
  if (!PyArg_ParseTuple(args, "OO", &trainable, &used_fn)) return nullptr;
  if (!ReadyRecordType()) return nullptr;
  uint64_t mask = 0;
  PyObject* it = PyObject_GetIter(trainable);
  if (it == nullptr) return nullptr;
  for (PyObject* x; (x = PyIter_Next(it)) != nullptr;) {
    long v = PyLong_AsLong(x);
    Py_DECREF(x);
    if (v == -1 && PyErr_Occurred()) break;
    if (v < 0 || v >= 64) {
      PyErr_Format(PyExc_ValueError, "tape_setup: dtype enum %ld out of range", v);
      break;
    }
    mask |= uint64_t{1} << v;
  }
  Py_DECREF(it);
  if (PyErr_Occurred()) return nullptr;
  g_trainable = mask;
  Py_XSETREF(g_used_fn, Py_NewRef(used_fn));
  Py_XSETREF(g_used, PyDict_New());
  if (g_used == nullptr) return nullptr;
  // Each name interned once per process (a failed interning leaves its slot null, and
  // the next setup retries it); "frames" is shared (native_internal::s_frames, set by
  // SetSharedState at the core's import, which precedes this setup).
  using native_internal::InternOnce;
  if (!InternOnce(&s_live, "_live") || !InternOnce(&s_tracked, "_tracked") ||
      !InternOnce(&s_producer, "_producer") || !InternOnce(&s_seq, "_seq") ||
      !InternOnce(&s_python, "_after_execute_python") ||
      !InternOnce(&s_bridge, "_bridge_to_tf_tapes") ||
      !InternOnce(&s_sweep_at, "_sweep_at") || !InternOnce(&s_sweep, "_sweep_tracked") ||
      !InternOnce(&native_internal::s_frames, "frames")) {
    return nullptr;
  }
  PyObject* fn = PyCFunction_New(&kAfterExecuteDef, nullptr);
  if (fn == nullptr) return nullptr;
  Py_XSETREF(g_after_fn, Py_NewRef(fn));
  PyObject* method = PyInstanceMethod_New(fn);  // binds like a Python function
  Py_DECREF(fn);
  if (method == nullptr) return nullptr;
  return Py_BuildValue("(ON)", reinterpret_cast<PyObject*>(&RecordType), method);
}

}  // namespace

bool IsTapeAfterExecute(PyObject* fn) { return g_after_fn != nullptr && fn == g_after_fn; }

PyObject* TapeAfterExecuteDirect(PyObject* tape, PyObject* stack, PyObject* next, PyObject* op,
                                 PyObject* inputs, PyObject* outputs) {
  Frame f;
  f.stack = stack;
  f.next = next;
  return Record(f, tape, op, inputs, outputs);
}

// ---- the tape's copy-on over a Python execute hook (TapeCopiesThrough) -------------

namespace {

PyObject* g_copy_on_fn = nullptr;  // GradientTape.copy_on (tape_copy_setup), strong
PyObject* s_copy_on = nullptr;     // "copy_on"
PyObject* s_needs_copy = nullptr;  // "needs_copy"
PyObject* s_copies_through = nullptr;  // "tape_copies_through" (the handler below's)

// tape_copy_setup(GradientTape.copy_on): the copy_on TapeCopiesThrough knows.
PyObject* PyTapeCopySetup(PyObject*, PyObject* fn) {
  using native_internal::InternOnce;
  if (!PyFunction_Check(fn)) {
    PyErr_SetString(PyExc_TypeError, "tape_copy_setup: expected GradientTape.copy_on");
    return nullptr;
  }
  if (!InternOnce(&s_copy_on, "copy_on") || !InternOnce(&s_needs_copy, "needs_copy") ||
      !InternOnce(&s_copies_through, "tape_copies_through") ||
      !InternOnce(&s_tracked, "_tracked")) {
    return nullptr;
  }
  Py_XSETREF(g_copy_on_fn, Py_NewRef(fn));
  Py_RETURN_NONE;
}

// A physical input `h` that `tape` (its instance dict `state`) does not track, while TensorFlow's tape set is empty
// (a tf.GradientTape would see the copy's record), under a handler that declares
// `tape_copies_through`: 1, else 0, or -1 with an exception set.
int PhysicalCopiesThrough(PyObject* state, PyObject* next, TFE_TensorHandle* h) {
  if (Truth(TFE_Py_TapeSetIsEmpty()) != 1) return 0;
  PyObject* below = PyObject_GetAttr(next, native_internal::s_handler);
  PyObject* flag = below != nullptr ? PyObject_GetAttr(below, s_copies_through) : nullptr;
  Py_XDECREF(below);
  if (flag == nullptr) {
    PyErr_Clear();
    return 0;
  }
  int yes = flag == Py_True;
  Py_DECREF(flag);
  if (!yes) return 0;
  PyObject* tracked = PyDict_GetItemWithError(state, s_tracked);  // borrowed
  if (tracked == nullptr || !PyDict_CheckExact(tracked)) return PyErr_Occurred() ? -1 : 0;
  PyObject* key = PyLong_FromVoidPtr(h);  // as Key(): tensors are keyed by handle
  if (key == nullptr) return -1;
  int known = PyDict_Contains(tracked, key);
  Py_DECREF(key);
  return known < 0 ? -1 : !known;
}

}  // namespace

int TapeCopiesThrough(PyObject* tape, PyObject* next, TFE_TensorHandle* h) {
  if (g_copy_on_fn == nullptr) return 0;
  PyTypeObject* type = Py_TYPE(tape);
  if (type->tp_getattro != PyObject_GenericGetAttr ||
      _PyType_Lookup(type, s_copy_on) != g_copy_on_fn ||
      _PyType_Lookup(type, s_needs_copy) != Py_None) {
    return 0;  // a subclass's own copy rules: its hooks decide
  }
  // A resource handle's copy-on may harvest the tape's variable watcher: Python.
  if (TFE_TensorHandleDataType(h) == TF_RESOURCE) return 0;
  TFOH_Payload* p = PayloadOf(h);
  if (p != nullptr && (p->kind != TFOH_PAYLOAD_PYTHON ||
                       reinterpret_cast<PyObject*>(p->stack) != next)) {
    return 0;
  }
  PyObject* state = PyObject_GenericGetDict(tape, nullptr);
  if (state == nullptr) return -1;
  int result = 0;
  if (PyDict_Check(state) && PyDict_GetItemWithError(state, s_copy_on) == nullptr &&
      PyDict_GetItemWithError(state, s_needs_copy) == nullptr && !PyErr_Occurred()) {
    // A tensor of the next stack: the tape's copy_on returns it as it is, recording
    // nothing (HandlerStack.copy_on of its own tensor).
    result = p != nullptr ? 1 : PhysicalCopiesThrough(state, next, h);
  }
  Py_DECREF(state);
  return PyErr_Occurred() ? -1 : result;
}

PyMethodDef kTapeModuleMethods[] = {
    {"tape_setup", PyTapeSetup, METH_VARARGS,
     "tape_setup(trainable_dtype_enums, used_indices) -> (TapeRecord, after_execute): "
     "oh.GradientTape's recording in C (cc/handlers/gradient_tape/tape_record.h)."},
    {"tape_copy_setup", PyTapeCopySetup, METH_O,
     "tape_copy_setup(GradientTape.copy_on): the copy_on whose inputs the record path "
     "may pass to a hook below as they are (cc/handlers/gradient_tape/tape_record.h TapeCopiesThrough)."},
    {nullptr}};

}  // namespace tf_ophandlers
