// tf-ophandlers: oh.Lazy's value request in C (handlers/lazy/handler.py `Lazy._run`): the pending
// nodes a request needs, the compiled-function cache key, the outputs to keep and the
// external inputs. Contracts: fast_internal.h. Runs once per value request over every
// pending node, so the common case (a cache hit) builds no per-node Python object: the
// key is one bytes object (hashed once, compared with memcmp), the plan is built only
// when a function is compiled or the ops run one by one.
#define PY_SSIZE_T_CLEAN
#include "handlers/lazy/lazy.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "boundary/owners.h"
#include "boundary/runtime.h"

namespace tf_ophandlers {
namespace fast {
namespace {

// (dtype enum, shape tuple) of an EagerTensor, as a key part; null with an error set.
PyObject* EagerSpec(PyObject* t) {
  TFE_TensorHandle* h = EagerTensor_Handle(t);
  TF_Status* s = ThreadStatus();
  int rank = TFE_TensorHandleNumDims(h, s);
  PyObject* shape = TF_GetCode(s) == TF_OK && rank >= 0 ? PyTuple_New(rank) : nullptr;
  for (int d = 0; shape != nullptr && d < rank; ++d) {
    int64_t n = TFE_TensorHandleDim(h, d, s);
    PyObject* o = TF_GetCode(s) == TF_OK ? PyLong_FromLongLong(n) : nullptr;
    if (o == nullptr) Py_CLEAR(shape);
    else PyTuple_SET_ITEM(shape, d, o);
  }
  if (TF_GetCode(s) != TF_OK) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, TF_Message(s));
    TF_SetStatus(s, TF_OK, "");
    Py_XDECREF(shape);
    return nullptr;
  }
  if (shape == nullptr) return nullptr;
  PyObject* r = Py_BuildValue("(iN)", static_cast<int>(TFE_TensorHandleDataType(h)), shape);
  return r;
}

bool Pending(PyObject* node) {
  PyObject* in = Slot(node, g_lazy.n_inputs);
  return in != nullptr && in != Py_None;
}

bool IsNode(PyObject* o) { return Py_TYPE(o) == g_lazy.node; }

// The key's encoding: fixed-width integers and length-prefixed strings, so that equal
// bytes mean equal structures.
void PutInt(std::string* key, int32_t v) {
  key->append(reinterpret_cast<const char*>(&v), sizeof(v));
}

bool PutStr(std::string* key, PyObject* s) {
  const char* data;
  Py_ssize_t n;
  if (PyUnicode_Check(s)) {
    data = PyUnicode_AsUTF8AndSize(s, &n);
    if (data == nullptr) return false;
  } else if (PyBytes_Check(s)) {
    data = PyBytes_AS_STRING(s);
    n = PyBytes_GET_SIZE(s);
  } else {
    PyErr_SetString(PyExc_TypeError, "lazy_plan: a signature or device that is not a string");
    return false;
  }
  PutInt(key, static_cast<int32_t>(n));
  key->append(data, n);
  return true;
}

}  // namespace

PyObject* PyLazyUpstream(PyObject*, PyObject* args) {
  PyObject* roots;
  if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &roots)) return nullptr;
  if (!g_lazy_ready) {
    PyErr_SetString(PyExc_RuntimeError, "lazy_upstream: lazy_setup was not called");
    return nullptr;
  }
  // A loop, not recursion: a chain of pending ops can be thousands long.
  std::unordered_set<PyObject*> seen;
  std::vector<std::pair<long long, PyObject*>> found;  // (seq, node)
  std::vector<PyObject*> todo;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(roots); ++i) todo.push_back(PyList_GET_ITEM(roots, i));
  while (!todo.empty()) {
    PyObject* node = todo.back();
    todo.pop_back();
    if (!IsNode(node) || !Pending(node) || !PyList_Check(Slot(node, g_lazy.n_inputs))) {
      PyErr_SetString(PyExc_TypeError, "lazy_upstream: not a pending node");
      return nullptr;
    }
    if (!seen.insert(node).second) continue;
    PyObject* seq = Slot(node, g_lazy.n_seq);
    long long s = seq != nullptr ? PyLong_AsLongLong(seq) : -1;
    if (s == -1 && (seq == nullptr || PyErr_Occurred())) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "lazy_upstream: no seq");
      return nullptr;
    }
    found.emplace_back(s, node);
    PyObject* inputs = Slot(node, g_lazy.n_inputs);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(inputs); ++i) {
      PyObject* t = PyList_GET_ITEM(inputs, i);
      if (PyTuple_CheckExact(t) && PyTuple_GET_SIZE(t) == 2) {
        PyObject* producer = PyTuple_GET_ITEM(t, 0);
        if (IsNode(producer) && Pending(producer)) todo.push_back(producer);
      }
    }
  }
  // Recording order: an op is recorded after the ops producing its inputs.
  std::sort(found.begin(), found.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(found.size()));
  if (out == nullptr) return nullptr;
  for (size_t j = 0; j < found.size(); ++j) {
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(j), Py_NewRef(found[j].second));
  }
  return out;
}

PyObject* PyLazyComputed(PyObject*, PyObject* args) {
  PyObject* order;
  if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &order)) return nullptr;
  for (Py_ssize_t j = 0; j < PyList_GET_SIZE(order); ++j) {
    PyObject* node = PyList_GET_ITEM(order, j);
    if (!IsNode(node)) {
      PyErr_SetString(PyExc_TypeError, "lazy_computed: not a node");
      return nullptr;
    }
    PyObject*& inputs = Slot(node, g_lazy.n_inputs);
    PyObject* old = inputs;
    inputs = Py_NewRef(Py_None);
    Py_XDECREF(old);  // (may free producers: `order` holds them)
  }
  Py_RETURN_NONE;
}

PyObject* PyLazyPlan(PyObject*, PyObject* args) {
  PyObject *order, *needed;
  int specs, want_plan;
  if (!PyArg_ParseTuple(args, "O!Opp", &PyList_Type, &order, &needed, &specs, &want_plan)) {
    return nullptr;
  }
  if (!g_lazy_ready) {
    PyErr_SetString(PyExc_RuntimeError, "lazy_plan: lazy_setup was not called");
    return nullptr;
  }
  const bool any_needed = PyObject_IsTrue(needed) == 1;
  std::unordered_map<PyObject*, Py_ssize_t> position;
  std::unordered_map<void*, Py_ssize_t> ext_index;
  std::string key;
  std::vector<int32_t> refs;  // (p, i) pairs of the current node
  // Released in the reverse order of these declarations (the plan first).
  PyRef ext_specs_ref(specs ? PyList_New(0) : Py_NewRef(Py_None));
  PyRef external_ref(PyList_New(0));
  PyRef kept_ref(PyList_New(0));
  PyRef plan_ref(want_plan ? PyList_New(0) : Py_NewRef(Py_None));
  PyObject* plan = plan_ref.get();
  PyObject* kept = kept_ref.get();
  PyObject* external = external_ref.get();
  PyObject* ext_specs = ext_specs_ref.get();
  Py_ssize_t n = PyList_GET_SIZE(order);
  key.reserve(static_cast<size_t>(n) * 64);
  if (!plan || !kept || !external || !ext_specs) return nullptr;
  for (Py_ssize_t j = 0; j < n; ++j) {
    PyObject* node = PyList_GET_ITEM(order, j);
    if (!IsNode(node) || !Pending(node)) {
      PyErr_SetString(PyExc_TypeError, "lazy_plan: not a pending node");
      return nullptr;
    }
    position[node] = j;
    PyObject* outs = Slot(node, g_lazy.n_outputs);
    PyObject* inputs = Slot(node, g_lazy.n_inputs);
    PyObject* seq = Slot(node, g_lazy.n_seq);
    PyObject* sig = Slot(node, g_lazy.n_sig);
    PyObject* device = Slot(node, g_lazy.n_device);
    if (!outs || !PyList_Check(outs) || !PyList_Check(inputs) || !seq || !sig ||
        !PyTuple_Check(sig) || PyTuple_GET_SIZE(sig) != 2 || !device) {
      PyErr_SetString(PyExc_TypeError, "lazy_plan: a malformed node");
      return nullptr;
    }
    // graph_builder.node_part's (op type, attributes key, refs, device), then the live
    // outputs (what the function returns).
    if (!PutStr(&key, PyTuple_GET_ITEM(sig, 0)) || !PutStr(&key, PyTuple_GET_ITEM(sig, 1)) ||
        !PutStr(&key, device)) {
      return nullptr;
    }
    // The live outputs: referenced by the program, or needed by a pending node outside.
    PyRef live(want_plan ? PyList_New(0) : nullptr);
    if (want_plan && !live) return nullptr;
    const size_t n_live_at = key.size();
    PutInt(&key, 0);
    int32_t n_live = 0;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(outs); ++k) {
      PyObject* o = PyWeakref_GetObject(PyList_GET_ITEM(outs, k));  // borrowed
      int need = 0;
      if (o != nullptr && any_needed) {
        PyRef nk(Py_BuildValue("(On)", seq, k));
        need = nk ? PySet_Contains(needed, nk.get()) : -1;
      }
      if (o == nullptr || need < 0) return nullptr;
      if (o == Py_None && !need) continue;
      PyRef kk(PyLong_FromSsize_t(k));
      PyRef entry(kk ? PyTuple_Pack(3, node, kk.get(), o) : nullptr);
      bool ok = entry && PyList_Append(kept, entry.get()) == 0 &&
                (!live || PyList_Append(live.get(), kk.get()) == 0);
      if (!ok) return nullptr;
      PutInt(&key, static_cast<int32_t>(k));
      ++n_live;
    }
    std::memcpy(&key[n_live_at], &n_live, sizeof(n_live));
    Py_ssize_t n_in = PyList_GET_SIZE(inputs);
    PutInt(&key, static_cast<int32_t>(n_in));
    refs.clear();
    bool ok = true;
    for (Py_ssize_t i = 0; ok && i < n_in; ++i) {
      PyObject* t = PyList_GET_ITEM(inputs, i);
      if (PyTuple_CheckExact(t)) {
        PyObject* producer = PyTuple_GET_ITEM(t, 0);
        PyObject* k = PyTuple_GET_ITEM(t, 1);
        if (Pending(producer)) {
          auto it = position.find(producer);
          long idx = PyLong_AsLong(k);
          if (it == position.end() || (idx == -1 && PyErr_Occurred())) {
            if (!PyErr_Occurred()) {
              PyErr_SetString(PyExc_RuntimeError, "lazy_plan: a producer after its consumer");
            }
            ok = false;
            break;
          }
          refs.push_back(static_cast<int32_t>(it->second));
          refs.push_back(static_cast<int32_t>(idx));
          continue;
        }
        PyObject* values = Slot(producer, g_lazy.n_values);  // computed: its kept value
        t = values != nullptr && values != Py_None ? PyObject_GetItem(values, k) : nullptr;
        if (t == nullptr) {
          if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "lazy_plan: a lost value");
          ok = false;
          break;
        }
        Py_DECREF(t);  // (values keeps it)
      }
      void* ek = EagerTensor_CheckExact(t) ? static_cast<void*>(EagerTensor_Handle(t))
                                           : static_cast<void*>(t);
      auto it = ext_index.find(ek);
      Py_ssize_t e;
      if (it == ext_index.end()) {
        e = PyList_GET_SIZE(external);
        ext_index.emplace(ek, e);
        if (PyList_Append(external, t) < 0) {
          ok = false;
          break;
        }
        if (specs) {
          PyRef sp(EagerTensor_CheckExact(t) ? EagerSpec(t) : nullptr);
          if (!sp && !PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "lazy_plan: an external input is not a tensor");
          }
          ok = sp && PyList_Append(ext_specs, sp.get()) == 0;
          if (!ok) break;
        }
      } else {
        e = it->second;
      }
      refs.push_back(-1);
      refs.push_back(static_cast<int32_t>(e));
    }
    if (!ok) return nullptr;
    key.append(reinterpret_cast<const char*>(refs.data()), refs.size() * sizeof(int32_t));
    if (!want_plan) continue;
    // plan: (node, refs, live, device), refs ((p, i), ...) as lazy_compile reads them.
    PyRef refs_t(PyTuple_New(n_in));
    for (Py_ssize_t i = 0; refs_t && i < n_in; ++i) {
      PyObject* r = Py_BuildValue("(ii)", refs[2 * i], refs[2 * i + 1]);
      if (r == nullptr) refs_t.reset();
      else PyTuple_SET_ITEM(refs_t.get(), i, r);
    }
    PyRef live_t(refs_t ? PyList_AsTuple(live.get()) : nullptr);
    live.reset();
    PyRef step(live_t ? PyTuple_Pack(4, node, refs_t.get(), live_t.get(), device) : nullptr);
    ok = step && PyList_Append(plan, step.get()) == 0;
    step.reset();
    live_t.reset();
    refs_t.reset();
    if (!ok) return nullptr;
  }
  PyRef key_b(PyBytes_FromStringAndSize(key.data(), static_cast<Py_ssize_t>(key.size())));
  PyObject* specs_t =
      key_b ? (specs ? PyList_AsTuple(ext_specs) : Py_NewRef(Py_None)) : nullptr;
  if (specs_t == nullptr) return nullptr;
  // (N: the tuple takes key_b's and specs_t's references.)
  return Py_BuildValue("(ONOON)", plan, key_b.release(), kept, external, specs_t);
}

}  // namespace fast
}  // namespace tf_ophandlers
