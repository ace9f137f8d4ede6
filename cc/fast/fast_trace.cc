// tf-ophandlers: TensorFlow's eager fast path without its per-op stack capture, for ops
// placed on the dispatcher while a handler scope is open (core/skip_trace.py).
//
// Every generated op wrapper (gen_*_ops) calls `pywrap_tfe.TFE_Py_FastPathExecute`, which
// captures the Python stack of the op (StackTrace::Capture, for kernel error messages):
// about a third of what TensorFlow's Python API costs per small op over a do-nothing
// custom device (docs/benchmarks.md, TensorFlow's stack capture). An op placed on the
// dispatcher never runs as that op: a handler records it or the dispatcher builds its
// own op from it, and the trace is dropped unread. While a scope places ops on the dispatcher (the scoped patch "fast path
// without stack capture", core/skip_trace.py, registered in core/tf_patches.py),
// `skip_trace_execute` stands in for TensorFlow's function. It takes the common op
// itself, as TensorFlow's fast path does but without the capture: placed on the
// dispatcher (the thread's device scope is the dispatcher's), no tape or forward
// accumulator recording, no op callback, every input of a single-tensor argument an
// EagerTensor, a Python int or float (converted with the dtype the tensors give, as the
// fast path does) or a list or tuple of them (Keras's `perm`/`shape` tuples, which the
// fast path refuses: converted as its generated Python fallback does, a type attribute
// no tensor gives inferred from the value and required to be an allowed one; likewise
// an object converting itself, such as a Keras variable; fast_convert.cc), every
// type attribute given by those inputs or passed as a tf.DType (or its enum), every other
// attribute a bool, int, float, string or list of ints passed as a plain Python value,
// single-tensor outputs (a list of them when there are several). Anything else
// calls TensorFlow's function unchanged (its results, errors and recording). The op,
// placed on the dispatcher by name, is handed to the dispatcher's execute callback
// directly, with the GIL kept, where TFE_Execute would only route it there
// (boundary/device.h ExecuteOnDispatcherHeld; else TFE_Execute, the GIL released).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "fast/fast_internal.h"
#include "fast/fast_path.h"
#include "boundary/device.h"
#include "boundary/op.h"
#include "boundary/runtime.h"
#include "tensorflow/c/eager/c_api_experimental.h"
#include "tensorflow/c/eager/immediate_execution_operation.h"
#include "tensorflow/c/eager/tfe_op_internal.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_def.pb.h"
#include "tensorflow/python/eager/pywrap_tfe.h"

// lib_pywrap_tensorflow_common.so (TF 2.21), which _C links: TFE_Py_TapeSetIsEmpty (a new
// reference to True/False: tapes and accumulators) and GetEagerContextThreadLocalData
// (GIL held; the data of the calling thread, owned by TensorFlow) from pywrap_tfe.h.
namespace tensorflow {
int MaybeRaiseExceptionFromTFStatus(TF_Status* status, PyObject* exception);
}  // namespace tensorflow

namespace tf_ophandlers {
namespace {

PyObject* g_original = nullptr;  // TensorFlow's TFE_Py_FastPathExecute (strong)
PyObject* g_tld_attr = nullptr;  // "_thread_local_data"
PyObject* g_type_enum_attr = nullptr;  // "_type_enum"
PyTypeObject* g_dtype_class = nullptr;  // tf.DType (strong), for explicit type attributes
long long g_taken = 0;  // ops run here, failed or not (skip_trace_stats; GIL held)
long long g_held = 0;   // of those, run on the dispatcher without TFE_Execute (GIL held)

// The kinds of non-type attribute this path sets itself (others: TensorFlow's function).
enum class AttrKind { kBool, kInt, kFloat, kString, kIntList, kType };

// What an op type needs for this path, from its OpDef. `ok` false: TensorFlow's function.
struct OpInfo {
  bool ok = false;
  std::vector<int> input_attr;            // per input: its type attribute, or -1 (fixed)
  std::vector<TF_DataType> input_fixed;   // per input: its fixed dtype (input_attr -1)
  std::vector<std::string> attr_names;    // the type attributes
  std::vector<std::vector<TF_DataType>> allowed;  // per attribute; empty: any dtype
  std::vector<bool> has_default;          // per attribute
  // The other attributes the wrapper passes as (name, value) pairs after the inputs.
  std::unordered_map<std::string, AttrKind> other;
  // Their defaults (serialized AttrValues), set for a None value as the fast path does.
  std::unordered_map<std::string, std::string> defaults;
  int n_out = 1;  // single-tensor outputs (more than one: returned as a list, as TF does)
};

OpInfo MakeInfo(const char* type) {
  OpInfo info;
  const tensorflow::OpDef* def = nullptr;
  if (!tensorflow::OpRegistry::Global()->LookUpOpDef(type, &def).ok()) return info;
  if (def->output_arg_size() < 1) return info;
  for (const auto& out : def->output_arg()) {
    if (!out.number_attr().empty() || !out.type_list_attr().empty() || out.is_ref()) return info;
  }
  info.n_out = def->output_arg_size();
  for (const auto& a : def->attr()) {
    if (a.type() != "type") {  // an attribute the call passes by name
      static const auto* kinds = new std::unordered_map<std::string, AttrKind>{
          {"bool", AttrKind::kBool}, {"int", AttrKind::kInt}, {"float", AttrKind::kFloat},
          {"string", AttrKind::kString}, {"list(int)", AttrKind::kIntList}};
      auto k = kinds->find(a.type());
      if (k == kinds->end()) return info;
      info.other.emplace(a.name(), k->second);
      if (a.has_default_value()) {
        info.defaults.emplace(a.name(), a.default_value().SerializeAsString());
      }
      continue;
    }
    info.attr_names.push_back(a.name());
    std::vector<TF_DataType> allowed;
    for (int t : a.allowed_values().list().type()) allowed.push_back(static_cast<TF_DataType>(t));
    info.allowed.push_back(std::move(allowed));
    info.has_default.push_back(a.has_default_value());
  }
  std::vector<bool> given(info.attr_names.size(), false);
  for (const auto& arg : def->input_arg()) {
    if (!arg.number_attr().empty() || !arg.type_list_attr().empty() || arg.is_ref()) return info;
    int attr = -1;
    if (!arg.type_attr().empty()) {
      for (size_t k = 0; k < info.attr_names.size(); ++k) {
        if (info.attr_names[k] == arg.type_attr()) attr = static_cast<int>(k);
      }
      if (attr < 0) return info;
      given[attr] = true;
    }
    info.input_attr.push_back(attr);
    info.input_fixed.push_back(static_cast<TF_DataType>(arg.type()));
  }
  // A type attribute no input gives (Cast's DstT, ReadVariableOp's dtype) is passed by
  // name, as a DType or its enum: one of the other attributes.
  std::vector<std::string> names;
  std::vector<std::vector<TF_DataType>> allowed;
  std::vector<bool> has_default;
  std::vector<int> index(given.size(), -1);
  for (size_t k = 0; k < given.size(); ++k) {
    if (!given[k]) {
      info.other.emplace(info.attr_names[k], AttrKind::kType);
      for (const auto& a : def->attr()) {
        if (a.name() == info.attr_names[k] && a.has_default_value()) {
          info.defaults.emplace(a.name(), a.default_value().SerializeAsString());
        }
      }
      continue;
    }
    index[k] = static_cast<int>(names.size());
    names.push_back(info.attr_names[k]);
    allowed.push_back(info.allowed[k]);
    has_default.push_back(info.has_default[k]);
  }
  for (int& a : info.input_attr) {
    if (a >= 0) a = index[a];
  }
  info.attr_names = std::move(names);
  info.allowed = std::move(allowed);
  info.has_default = std::move(has_default);
  info.ok = true;
  return info;
}

// SkipTraceExecute calls running: an outer one holds its OpInfo while conversions run
// Python (a Keras variable's read, a handler's hook), which may run ops of other types.
int g_running = 0;

// Op type str -> info. Keyed by the str object (the wrappers pass the same constant each
// call), which the map keeps alive so its address is not reused. Bounded (emptied only
// when no call holds an entry); GIL held.
const OpInfo& InfoFor(PyObject* type, const char* utf8) {
  constexpr size_t kMaxTypes = 4096;
  static auto* infos = new std::unordered_map<PyObject*, OpInfo>();
  auto it = infos->find(type);
  if (it != infos->end()) return it->second;
  if (infos->size() >= kMaxTypes && g_running == 0) {
    for (auto& e : *infos) Py_DECREF(e.first);
    infos->clear();
  }
  Py_INCREF(type);
  return infos->emplace(type, MakeInfo(utf8)).first->second;
}

PyObject* Original(PyObject* const* args, Py_ssize_t nargs) {
  return PyObject_Vectorcall(g_original, args, nargs, nullptr);
}

// The thread's device scope name if it is the dispatcher and no op callback is set;
// null otherwise (also on an error, cleared: TensorFlow's function then reports it).
// Returns a new reference (conversions may run Python that changes the scope).
PyObject* DispatcherPlacement(PyObject* ctx) {
  // Read from the context's thread-local data itself, as TensorFlow's fast path reads
  // them (TFE_Py_FastPathExecute_C), not through `ctx._thread_local_data`'s properties
  // (two pybind calls per op, whose getters read the same struct). A context is asked
  // only once it has `_thread_local_data`, which its __init__ sets after registering
  // the defaults a thread's data starts from; the last one seen is kept (a strong
  // reference: its address is not reused while cached).
  static PyObject* last_ctx = nullptr;
  if (ctx != last_ctx) {
    PyObject* tld = PyObject_GetAttr(ctx, g_tld_attr);
    if (tld == nullptr) {
      PyErr_Clear();
      return nullptr;
    }
    Py_DECREF(tld);
    Py_INCREF(ctx);
    Py_XSETREF(last_ctx, ctx);
  }
  tensorflow::EagerContextThreadLocalData* data =
      tensorflow::GetEagerContextThreadLocalData(ctx);
  if (data == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  PyObject* device = data->device_name.get();  // borrowed
  PyObject* callbacks = data->op_callbacks.get();
  if (device == nullptr || callbacks == nullptr || !PyUnicode_Check(device)) return nullptr;
  // (a list; anything else is asked as the Python property's `not` would ask it)
  int empty = PyList_CheckExact(callbacks) ? PyList_GET_SIZE(callbacks) == 0
                                           : PyObject_Not(callbacks);
  if (empty != 1) {
    PyErr_Clear();
    return nullptr;
  }
  Py_INCREF(device);
  const char* name = PyUnicode_AsUTF8(device);
  if (name == nullptr || g_device_name != name) {
    PyErr_Clear();
    Py_DECREF(device);
    return nullptr;
  }
  return device;
}

// Whether `value` is a Python value of exactly the kind TensorFlow's fast path would
// convert for an attribute of `kind` without surprises (others: TensorFlow's function,
// which converts or rejects them). Never sets an exception.
bool PlainAttr(AttrKind kind, PyObject* value) {
  switch (kind) {
    case AttrKind::kBool:
      return PyBool_Check(value);
    case AttrKind::kInt:
      return PyLong_CheckExact(value);
    case AttrKind::kFloat:
      return PyFloat_CheckExact(value) || PyLong_CheckExact(value);
    case AttrKind::kString:
      return PyUnicode_CheckExact(value) || PyBytes_CheckExact(value);
    case AttrKind::kType:  // a tf.DType (its `_type_enum`) or the enum itself
      return PyLong_CheckExact(value) ||
             (g_dtype_class != nullptr && Py_TYPE(value) == g_dtype_class);
    case AttrKind::kIntList: {
      if (!PyList_CheckExact(value) && !PyTuple_CheckExact(value)) return false;
      Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
      PyObject** items = PySequence_Fast_ITEMS(value);
      for (Py_ssize_t i = 0; i < n; ++i) {
        if (!PyLong_CheckExact(items[i])) return false;
      }
      return true;
    }
  }
  return false;
}

// Sets attribute `name` of `kind` to `value` (PlainAttr) on `op`. False with no exception
// set when the value does not convert (overflow, bad UTF-8): the caller then leaves the
// call to TensorFlow's function.
bool SetOther(TFE_Op* op, const char* name, AttrKind kind, PyObject* value) {
  switch (kind) {
    case AttrKind::kBool:
      TFE_OpSetAttrBool(op, name, value == Py_True);
      return true;
    case AttrKind::kInt: {
      long long v = PyLong_AsLongLong(value);
      if (v == -1 && PyErr_Occurred()) break;
      TFE_OpSetAttrInt(op, name, v);
      return true;
    }
    case AttrKind::kFloat: {
      double v = PyFloat_AsDouble(value);
      if (v == -1.0 && PyErr_Occurred()) break;
      TFE_OpSetAttrFloat(op, name, static_cast<float>(v));
      return true;
    }
    case AttrKind::kString: {
      Py_ssize_t n = 0;
      const char* data = nullptr;
      if (PyBytes_CheckExact(value)) {
        data = PyBytes_AS_STRING(value);
        n = PyBytes_GET_SIZE(value);
      } else {
        data = PyUnicode_AsUTF8AndSize(value, &n);
        if (data == nullptr) break;
      }
      TFE_OpSetAttrString(op, name, data, static_cast<size_t>(n));
      return true;
    }
    case AttrKind::kType: {
      PyObject* e = PyLong_CheckExact(value) ? Py_NewRef(value)
                                             : PyObject_GetAttr(value, g_type_enum_attr);
      long v = e != nullptr && PyLong_Check(e) ? PyLong_AsLong(e) : -1;
      Py_XDECREF(e);
      if (v <= 0 || v > 1000) break;  // not a DataType enum: TensorFlow's function
      TFE_OpSetAttrType(op, name, static_cast<TF_DataType>(v));
      return true;
    }
    case AttrKind::kIntList: {
      Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
      PyObject** items = PySequence_Fast_ITEMS(value);
      absl::InlinedVector<int64_t, 8> v(n);
      for (Py_ssize_t i = 0; i < n; ++i) {
        v[i] = PyLong_AsLongLong(items[i]);
        if (v[i] == -1 && PyErr_Occurred()) {
          PyErr_Clear();
          return false;
        }
      }
      TFE_OpSetAttrIntList(op, name, v.data(), static_cast<int>(n));
      return true;
    }
  }
  PyErr_Clear();
  return false;
}

PyObject* SkipTraceExecute(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (g_original == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "skip_trace_execute: skip_trace_setup was not called");
    return nullptr;
  }
  if (nargs < 3 || !PyUnicode_CheckExact(args[1])) return Original(args, nargs);
  const char* type = PyUnicode_AsUTF8(args[1]);
  if (type == nullptr) return nullptr;
  const OpInfo& info = InfoFor(args[1], type);
  struct Running {  // (every return below)
    Running() { ++g_running; }
    ~Running() { --g_running; }
  } running;
  const Py_ssize_t n_in = static_cast<Py_ssize_t>(info.input_attr.size());
  const int n_out = info.n_out;
  const Py_ssize_t n_pairs = (nargs - 3 - n_in) / 2;
  if (!info.ok || nargs - 3 - n_in < 0 || (nargs - 3 - n_in) % 2 != 0 ||
      n_pairs != static_cast<Py_ssize_t>(info.other.size())) {
    return Original(args, nargs);  // (too few inputs, or not every attribute given)
  }
  // The (name, value) pairs: every non-type attribute once, each a plain value or None
  // for an attribute with a default (`proto`: that default).
  struct Pair {
    const char* name;
    AttrKind kind;
    const std::string* proto;
  };
  absl::InlinedVector<Pair, 8> pairs;
  for (Py_ssize_t p = 0; p < n_pairs; ++p) {
    PyObject* name = args[3 + n_in + 2 * p];
    if (!PyUnicode_CheckExact(name)) return Original(args, nargs);
    const char* attr = PyUnicode_AsUTF8(name);
    if (attr == nullptr) {
      PyErr_Clear();
      return Original(args, nargs);
    }
    auto it = info.other.find(attr);
    if (it == info.other.end()) return Original(args, nargs);
    const std::string* proto = nullptr;
    if (args[4 + n_in + 2 * p] == Py_None) {
      auto d = info.defaults.find(attr);
      if (d == info.defaults.end()) return Original(args, nargs);
      proto = &d->second;
    } else if (!PlainAttr(it->second, args[4 + n_in + 2 * p])) {
      return Original(args, nargs);
    }
    for (const auto& q : pairs) {
      if (std::strcmp(q.name, attr) == 0) return Original(args, nargs);  // given twice
    }
    pairs.push_back({attr, it->second, proto});
  }
  absl::InlinedVector<TFE_TensorHandle*, 4> in(n_in, nullptr);
  absl::InlinedVector<TF_DataType, 4> attrs(info.attr_names.size(), TF_DataType(0));
  absl::InlinedVector<fast::InputKind, 4> kinds(n_in, fast::InputKind::kTensor);
  bool numbers = false;  // a Python int or float input (`x * 1.01`): converted below
  bool refused = false;  // an input TensorFlow's fast path refuses: a list or tuple of
                         // them (`perm=(0, 2, 3, 1)`), a Keras variable
  for (Py_ssize_t i = 0; i < n_in; ++i) {
    PyObject* t = args[3 + i];
    if (!EagerTensor_CheckExact(t)) {
      kinds[i] = fast::ClassifyInput(t);
      if (kinds[i] == fast::InputKind::kOther) return Original(args, nargs);  // converted there
      numbers = numbers || kinds[i] == fast::InputKind::kNumber;
      refused = refused || kinds[i] != fast::InputKind::kNumber;
      continue;
    }
    in[i] = EagerTensor_Handle(t);
    TF_DataType dt = TFE_TensorHandleDataType(in[i]);
    int a = info.input_attr[i];
    if (a < 0) {
      if (dt != info.input_fixed[i]) return Original(args, nargs);  // its error
    } else if (attrs[a] == 0) {
      const auto& allowed = info.allowed[a];
      bool ok = allowed.empty();
      for (TF_DataType x : allowed) ok = ok || x == dt;
      if (!ok) return Original(args, nargs);
      attrs[a] = dt;
    } else if (attrs[a] != dt) {
      return Original(args, nargs);  // its "expected to be a ... tensor" error
    }
  }
  // TensorFlow's fast path takes numbers but no lists or Keras variables: with one, its
  // generated fallback converts every input (fast_convert.cc), which infers an attribute
  // no tensor gives from its first converted input. Numbers alone: their dtype must come
  // from a tensor here (the fast path would try the attribute's default).
  for (size_t a = 0; numbers && !refused && a < attrs.size(); ++a) {
    if (attrs[a] == 0) return Original(args, nargs);
  }
  PyObject* no_tape = TFE_Py_TapeSetIsEmpty();
  if (no_tape == nullptr) return nullptr;
  Py_DECREF(no_tape);
  if (no_tape != Py_True) return Original(args, nargs);  // it records the op
  PyObject* device = DispatcherPlacement(args[0]);
  if (device == nullptr) return Original(args, nargs);
  const char* device_name = PyUnicode_AsUTF8(device);  // (device is a new str)
  // Python numbers as TensorFlow's fast path converts them, lists and Keras variables as
  // its fallback does: with the dtype the tensors bound to the same attribute give, on
  // the device scope's device (numbers through its scalar cache). `converted` owns the
  // new handles.
  absl::InlinedVector<TFE_TensorHandle*, 2> converted;
  for (Py_ssize_t i = 0; (numbers || refused) && i < n_in; ++i) {
    if (in[i] != nullptr) continue;
    const int a = info.input_attr[i];
    // The dtype: fixed, given by the attribute's tensors, or inferred (0: DT_INVALID)
    // as `tf.constant(value)` does, then required to be one of the allowed ones (else
    // the fallback would retry with the attribute's default: TensorFlow's function).
    const TF_DataType want = a < 0 ? info.input_fixed[i] : attrs[a];
    TFE_TensorHandle* h = fast::ConvertInput(args[3 + i], kinds[i], want, device_name);
    bool ok = h != nullptr;
    if (ok && want == 0) {
      // (Any dtype allowed: the fallback converts a value with the attribute's default,
      // if any, first; an object's `__tf_tensor__` ignores that.)
      const TF_DataType dt = TFE_TensorHandleDataType(h);
      ok = info.allowed[a].empty() &&
           (kinds[i] == fast::InputKind::kObject || !info.has_default[a]);
      for (TF_DataType x : info.allowed[a]) ok = ok || x == dt;
      if (ok) attrs[a] = dt;
    } else if (ok) {
      ok = TFE_TensorHandleDataType(h) == want;
    }
    if (!ok) {
      if (h != nullptr) TFE_DeleteTensorHandle(h);
      for (TFE_TensorHandle* c : converted) TFE_DeleteTensorHandle(c);
      Py_DECREF(device);
      return Original(args, nargs);  // its conversion error
    }
    converted.push_back(h);
    in[i] = h;
  }
  // This thread's TFE_Op (as TensorFlow's fast path keeps one); a nested use (a hook
  // running ops) takes it out first.
  thread_local TFE_Op* cached_op = nullptr;
  TF_Status* status = ThreadStatus();  // (after the conversions, which may use it)
  TFE_Op* op = ResetOrNewOp(cached_op, type, device_name, status);
  cached_op = nullptr;
  Py_DECREF(device);
  for (size_t a = 0; a < attrs.size() && TF_GetCode(status) == TF_OK; ++a) {
    TFE_OpSetAttrType(op, info.attr_names[a].c_str(), attrs[a]);
  }
  bool plain = true;  // every (name, value) pair set (PlainAttr values nearly always are)
  for (Py_ssize_t p = 0; p < n_pairs && plain && TF_GetCode(status) == TF_OK; ++p) {
    if (pairs[p].proto != nullptr) {
      TFE_OpSetAttrValueProto(op, pairs[p].name, pairs[p].proto->data(), pairs[p].proto->size(),
                              status);
      plain = TF_GetCode(status) == TF_OK;
      if (!plain) TF_SetStatus(status, TF_OK, "");
      continue;
    }
    plain = SetOther(op, pairs[p].name, pairs[p].kind, args[4 + n_in + 2 * p]);
  }
  if (!plain) {
    TFE_DeleteOp(op);
    for (TFE_TensorHandle* c : converted) TFE_DeleteTensorHandle(c);
    return Original(args, nargs);
  }
  for (Py_ssize_t i = 0; i < n_in && TF_GetCode(status) == TF_OK; ++i) {
    TFE_OpAddInput(op, in[i], status);
  }
  absl::InlinedVector<TFE_TensorHandle*, 2> out(n_out, nullptr);
  int num_out = n_out;
  // Placed on the dispatcher: its callback runs here, with the GIL kept (device.h
  // ExecuteOnDispatcherHeld), unless TensorFlow's TFE_Execute must route the op.
  if (TF_GetCode(status) == TF_OK) {
    if (ExecuteOnDispatcherHeld(op, &num_out, out.data(), status)) {
      ++g_held;
    } else {
      Py_BEGIN_ALLOW_THREADS;
      TFE_Execute(op, out.data(), &num_out, status);
      Py_END_ALLOW_THREADS;
    }
  }
  if (op != nullptr) {
    if (TF_GetCode(status) == TF_OK && cached_op == nullptr) {
      tensorflow::unwrap(op)->Clear();  // releases the inputs now, as TensorFlow does
      cached_op = op;
    } else {
      TFE_DeleteOp(op);
    }
  }
  for (TFE_TensorHandle* c : converted) TFE_DeleteTensorHandle(c);  // (the op is done)
  ++g_taken;
  if (TF_GetCode(status) != TF_OK) {
    // As TensorFlow's fast path reports it (the wrapper converts the exception).
    std::string message = std::string(TF_Message(status)) + " [Op:" + type + "]";
    TF_SetStatus(status, TF_GetCode(status), message.c_str());
    tensorflow::MaybeRaiseExceptionFromTFStatus(status, nullptr);
    TF_SetStatus(status, TF_OK, "");
    return nullptr;
  }
  if (num_out != n_out) {
    for (int j = 0; j < num_out && j < n_out; ++j) TFE_DeleteTensorHandle(out[j]);
    PyErr_Format(PyExc_RuntimeError, "skip_trace_execute: %s gave %d outputs, expected %d",
                 type, num_out, n_out);
    return nullptr;
  }
  // One output: the tensor; more: a list of them (TensorFlow's fast path returns the
  // same, which the wrapper makes its named tuple).
  PyObject* list = n_out > 1 ? PyList_New(n_out) : nullptr;
  PyObject* result = nullptr;
  for (int j = 0; j < n_out; ++j) {
    PyObject* t = (n_out == 1 || list != nullptr) ? EagerTensorFromHandle(out[j], false)
                                                  : nullptr;  // owns out[j] on success
    if (t == nullptr) {
      for (int k = j; k < n_out; ++k) TFE_DeleteTensorHandle(out[k]);
      Py_XDECREF(list);
      return nullptr;
    }
    if (list == nullptr) {
      result = t;
    } else {
      PyList_SET_ITEM(list, j, t);
    }
  }
  return list != nullptr ? list : result;
}

PyObject* PySkipTraceStats(PyObject*, PyObject*) {
  return Py_BuildValue("{s:L,s:L}", "taken", g_taken, "held", g_held);
}

PyObject* PySkipTraceSetup(PyObject*, PyObject* original) {
  if (!PyCallable_Check(original)) {
    PyErr_SetString(PyExc_TypeError, "skip_trace_setup: expected TensorFlow's function");
    return nullptr;
  }
  if (!RequireInit() || !fast::SetupConvert()) return nullptr;
  g_tld_attr = g_tld_attr ? g_tld_attr : PyUnicode_InternFromString("_thread_local_data");
  g_type_enum_attr = g_type_enum_attr ? g_type_enum_attr : PyUnicode_InternFromString("_type_enum");
  if (g_tld_attr == nullptr || g_type_enum_attr == nullptr) {
    return nullptr;
  }
  if (g_dtype_class == nullptr) {
    PyObject* module = PyImport_ImportModule("tensorflow.python.framework.dtypes");
    PyObject* cls = module != nullptr ? PyObject_GetAttrString(module, "DType") : nullptr;
    Py_XDECREF(module);
    if (cls == nullptr || !PyType_Check(cls)) {
      Py_XDECREF(cls);
      return nullptr;
    }
    g_dtype_class = reinterpret_cast<PyTypeObject*>(cls);  // kept
  }
  Py_INCREF(original);
  Py_XSETREF(g_original, original);
  Py_RETURN_NONE;
}

}  // namespace

PyMethodDef kTraceModuleMethods[] = {
    {"skip_trace_setup", PySkipTraceSetup, METH_O,
     "skip_trace_setup(TFE_Py_FastPathExecute): TensorFlow's function, for the ops "
     "skip_trace_execute does not take."},
    {"skip_trace_execute", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(
                               SkipTraceExecute)),
     METH_FASTCALL,
     "skip_trace_execute(ctx, op_type, name, *inputs_and_attrs): TFE_Py_FastPathExecute "
     "without the stack capture for the common op placed on the dispatcher "
     "(cc/fast/fast_trace.cc)."},
    {"skip_trace_stats", PySkipTraceStats, METH_NOARGS,
     "skip_trace_stats() -> {taken, held}: ops skip_trace_execute ran itself, and of those "
     "the ones whose dispatcher callback it called without TFE_Execute."},
    {nullptr}};

}  // namespace tf_ophandlers
