// tf-ophandlers: oh.Lazy's record path in C (kLazy). Contracts: fast_internal.h.
//
// `Lazy.execute` (handlers/lazy.py) for its common op: a stateless op over PHYSICAL
// whose inputs are pending or computed values of the stack or physical tensors (none a
// resource), whose output dtypes are known and whose signature is cached
// (lazy_compile.sigs). It builds the same Python objects the hook builds (a `_Node`
// and one `LazyValue` per output, allocated with their types' own allocator and their
// slots set by offset, as their `__init__` sets them) and appends the node to the
// handler's `_pending`: recording costs no Python frame, no Op object and no wrap of a
// Python list. Anything else (a chunk to launch, an op or input the hook treats specially, a cache
// miss) runs the hook (RunHook), which fills the caches for the next op.
#define PY_SSIZE_T_CLEAN
#include "fast_internal.h"

#include <structmember.h>

#include <cstring>
#include <string>
#include <unordered_map>

#include "absl/container/inlined_vector.h"
#include "handler_tensor.h"
#include "op.h"
#include "runtime.h"
#include "status.h"

namespace tf_ophandlers {
namespace fast {
namespace {

// What lazy_setup registered (strong references, for the process), null before it.
struct LazyTypes {
  PyTypeObject* value = nullptr;  // LazyValue
  PyTypeObject* node = nullptr;   // _Node
  PyObject* sequence = nullptr;   // lazy._sequence (an itertools.count)
  PyObject* sigs = nullptr;       // lazy_compile.sigs: (op type, enums) -> signature
  PyObject* dtypes = nullptr;     // lazy._dtypes: enum -> tf.DType
  PyObject* stateful = nullptr;   // lazy._stateful: op type -> whether it runs eagerly
  PyObject* s_pending = nullptr;  // "_pending"
  PyObject* s_chunk_ops = nullptr;
  PyObject* s_recorded = nullptr;
  PyObject* s_live_nodes = nullptr;
  PyObject* s_prune = nullptr;
  // Slot offsets (LazyValue: node, index, dtype, value; _Node: the rest).
  Py_ssize_t v_node = 0, v_index = 0, v_dtype = 0, v_value = 0;
  Py_ssize_t n_seq = 0, n_sig = 0, n_op = 0, n_device = 0, n_inputs = 0, n_outputs = 0,
             n_values = 0, n_specs = 0, n_next = 0, n_failed = 0;
};
LazyTypes g_lazy;
bool g_lazy_ready = false;

// (op type, output dtypes) -> signature, for types the Python caches call stateless
// with attributes that follow the outputs. Strong references; bounded (cleared when full).
std::unordered_map<std::string, PyObject*>* g_sig_cache = nullptr;
constexpr size_t kMaxSigs = 4096;
// enum -> tf.DType (strong references).
constexpr int kMaxEnum = 256;
PyObject* g_dtype_objs[kMaxEnum] = {nullptr};

PyObject*& Slot(PyObject* o, Py_ssize_t offset) {
  return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + offset);
}

// Sets slot `offset` of `o` (a fresh object: the slot is empty) to a new reference.
void Set(PyObject* o, Py_ssize_t offset, PyObject* value) {
  Py_INCREF(value);
  Slot(o, offset) = value;
}

bool SlotOffset(PyTypeObject* type, const char* name, Py_ssize_t* offset) {
  PyObject* d = PyDict_GetItemString(type->tp_dict, name);  // borrowed
  if (d == nullptr || Py_TYPE(d) != &PyMemberDescr_Type) {
    PyErr_Format(PyExc_TypeError, "lazy_setup: %s.%s is not a __slots__ member", type->tp_name,
                 name);
    return false;
  }
  PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
  if (m->type != T_OBJECT_EX) {
    PyErr_Format(PyExc_TypeError, "lazy_setup: %s.%s is not an object slot", type->tp_name, name);
    return false;
  }
  *offset = m->offset;
  return true;
}

// The signature for (type, dtypes), from the C cache or the Python caches (which the
// hook fills); null (no error set) when the hook must run.
PyObject* SignatureFor(const char* type, const absl::InlinedVector<TF_DataType, 4>& dtypes) {
  std::string key(type);
  key.push_back('\0');
  for (TF_DataType t : dtypes) key.push_back(static_cast<char>(t));
  auto it = g_sig_cache->find(key);
  if (it != g_sig_cache->end()) return it->second;
  PyObject* name = InternedString(type);
  PyObject* enums = name != nullptr ? PyTuple_New(dtypes.size()) : nullptr;
  PyObject* sig = nullptr;
  if (enums != nullptr) {
    bool ok = true;
    for (size_t i = 0; i < dtypes.size() && ok; ++i) {
      PyObject* e = PyLong_FromLong(dtypes[i]);
      ok = e != nullptr;
      if (ok) PyTuple_SET_ITEM(enums, i, e);
    }
    // Recorded only for a type the Python path found stateless (False, not missing).
    PyObject* stateful = ok ? PyDict_GetItemWithError(g_lazy.stateful, name) : nullptr;
    if (stateful == Py_False) {
      PyObject* k = PyTuple_Pack(2, name, enums);
      sig = k != nullptr ? PyDict_GetItemWithError(g_lazy.sigs, k) : nullptr;  // borrowed
      Py_XDECREF(k);
    }
  }
  Py_XDECREF(enums);
  Py_XDECREF(name);
  PyErr_Clear();
  if (sig == nullptr) return nullptr;
  if (g_sig_cache->size() >= kMaxSigs) {
    for (auto& e : *g_sig_cache) Py_DECREF(e.second);
    g_sig_cache->clear();
  }
  Py_INCREF(sig);
  g_sig_cache->emplace(std::move(key), sig);
  return sig;
}

PyObject* DtypeFor(TF_DataType t) {
  if (t < 0 || t >= kMaxEnum) return nullptr;
  PyObject* d = g_dtype_objs[t];
  if (d != nullptr) return d;
  PyObject* e = PyLong_FromLong(t);
  d = e != nullptr ? PyDict_GetItemWithError(g_lazy.dtypes, e) : nullptr;
  Py_XDECREF(e);
  PyErr_Clear();
  if (d == nullptr) return nullptr;
  Py_INCREF(d);
  g_dtype_objs[t] = d;
  return d;
}

}  // namespace

bool RunLazy(PyObject* stack, const Decision& d, const TFE_Op* src, const char* type,
             const char* device, int n_in, TFE_TensorHandle** in, int* num_outputs,
             TFE_TensorHandle** outputs, TF_Status* status) {
  auto hook = [&]() {
    return RunHook(stack, d, src, type, device, n_in, in, num_outputs, outputs, status);
  };
  if (!g_lazy_ready || d.next != g_physical) return hook();  // over a handler: keeps its Op
  absl::InlinedVector<TF_DataType, 4> dtypes;
  if (!ExpectedOutputs(src, &dtypes) || dtypes.empty() ||
      static_cast<int>(dtypes.size()) > *num_outputs) {
    return hook();
  }
  PyObject* sig = SignatureFor(type, dtypes);  // borrowed (the cache holds it)
  if (sig == nullptr) return hook();
  absl::InlinedVector<PyObject*, 4> dtype_objs(dtypes.size());
  for (size_t k = 0; k < dtypes.size(); ++k) {
    dtype_objs[k] = DtypeFor(dtypes[k]);
    if (dtype_objs[k] == nullptr) return hook();
  }
  // Inputs as the node keeps them: (node, index) of a pending value, a computed value's
  // tensor, or the physical tensor itself. Resources run eagerly (the hook).
  for (int i = 0; i < n_in; ++i) {
    if (TFE_TensorHandleDataType(in[i]) == TF_RESOURCE) return hook();
    TFOH_Payload* p = PayloadOf(in[i]);
    if (p != nullptr &&
        (p->kind != TFOH_PAYLOAD_PYTHON || reinterpret_cast<PyObject*>(p->stack) != stack ||
         p->value == nullptr ||
         Py_TYPE(reinterpret_cast<PyObject*>(p->value)) != g_lazy.value)) {
      return hook();  // another stack's tensor, or not a LazyValue: the hook's rules
    }
  }
  PyObject* handler = PyObject_GetAttr(stack, s_handler);
  PyObject* chunk = handler != nullptr ? PyObject_GetAttr(handler, g_lazy.s_chunk_ops) : nullptr;
  if (chunk == nullptr) {
    PyErr_Clear();
    Py_XDECREF(handler);
    return hook();
  }
  // With chunk_ops: the ops recorded since the last chunk (-1 without). When a chunk is
  // due the hook launches it first. An execute set on the instance is its hook.
  long recorded = -1;
  if (chunk != Py_None) {
    long limit = PyLong_CheckExact(chunk) ? PyLong_AsLong(chunk) : -1;
    PyObject* r = PyObject_GetAttr(handler, g_lazy.s_recorded);
    recorded = r != nullptr && PyLong_CheckExact(r) ? PyLong_AsLong(r) : -1;
    Py_XDECREF(r);
    if (recorded < 0 || limit < 1 || (recorded > 0 && recorded >= limit)) recorded = -2;
  }
  Py_DECREF(chunk);
  PyObject** dict = _PyObject_GetDictPtr(handler);
  if (recorded == -2 ||
      (dict != nullptr && *dict != nullptr && PyDict_GetItem(*dict, s_execute) != nullptr)) {
    PyErr_Clear();
    Py_DECREF(handler);
    return hook();
  }
  PyObject* dev = StateGet(s_device);  // borrowed; state.device, as the hook's _Node reads
  if (dev == nullptr) {
    PyErr_Clear();
    Py_DECREF(handler);
    return hook();
  }
  const int n_out = static_cast<int>(dtypes.size());
  PyObject* node_inputs = PyList_New(n_in);
  PyObject* refs = PyList_New(n_out);
  PyObject* node = nullptr;
  PyObject* seq = nullptr;
  PyObject* pending = nullptr;
  PyObject* node_ref = nullptr;
  PyObject* producer = nullptr;
  absl::InlinedVector<PyObject*, 4> values(n_out, nullptr);
  int made = 0;
  if (node_inputs == nullptr || refs == nullptr) goto fail;
  for (int i = 0; i < n_in; ++i) {
    TFOH_Payload* p = PayloadOf(in[i]);
    PyObject* item;
    if (p != nullptr) {
      PyObject* v = reinterpret_cast<PyObject*>(p->value);
      PyObject* computed = Slot(v, g_lazy.v_value);
      if (computed != nullptr && computed != Py_None) {
        Py_INCREF(computed);
        item = computed;
      } else {
        PyObject* producer_node = Slot(v, g_lazy.v_node);
        PyObject* index = Slot(v, g_lazy.v_index);
        if (producer_node == nullptr || index == nullptr) {
          PyErr_SetString(PyExc_RuntimeError, "oh.Lazy: a pending value without its node");
          goto fail;
        }
        item = PyTuple_Pack(2, producer_node, index);
      }
    } else {
      item = native_internal::EagerTensorSharing(in[i]);
    }
    if (item == nullptr) goto fail;
    PyList_SET_ITEM(node_inputs, i, item);
  }
  node = g_lazy.node->tp_alloc(g_lazy.node, 0);
  seq = node != nullptr ? PyIter_Next(g_lazy.sequence) : nullptr;
  if (seq == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "oh.Lazy: no sequence number");
    goto fail;
  }
  // As _Node.__init__ sets them (op None: the next stack is PHYSICAL).
  Slot(node, g_lazy.n_seq) = seq;  // (takes the reference)
  seq = nullptr;
  Set(node, g_lazy.n_sig, sig);
  Set(node, g_lazy.n_op, Py_None);
  Set(node, g_lazy.n_device, dev);
  Set(node, g_lazy.n_inputs, node_inputs);
  Set(node, g_lazy.n_outputs, refs);
  Set(node, g_lazy.n_values, Py_None);
  Set(node, g_lazy.n_specs, Py_None);
  Set(node, g_lazy.n_next, d.next);
  Set(node, g_lazy.n_failed, Py_False);
  for (int k = 0; k < n_out; ++k) {
    PyObject* v = g_lazy.value->tp_alloc(g_lazy.value, 0);
    if (v == nullptr) goto fail;
    values[k] = v;
    Set(v, g_lazy.v_node, node);
    PyObject* index = PyLong_FromLong(k);
    if (index == nullptr) goto fail;
    Slot(v, g_lazy.v_index) = index;
    Set(v, g_lazy.v_dtype, dtype_objs[k]);
    Set(v, g_lazy.v_value, Py_None);
    PyObject* r = PyWeakref_NewRef(v, nullptr);
    if (r == nullptr) goto fail;
    PyList_SET_ITEM(refs, k, r);
  }
  pending = PyObject_GetAttr(handler, g_lazy.s_pending);
  node_ref = pending != nullptr ? PyWeakref_NewRef(node, nullptr) : nullptr;
  producer = node_ref != nullptr ? InternedString(type) : nullptr;
  if (producer == nullptr) goto fail;
  if (!PyList_Check(pending)) {
    PyErr_SetString(PyExc_TypeError, "oh.Lazy: _pending is not a list");
    goto fail;
  }
  for (; made < n_out; ++made) {
    outputs[made] = NewHandlerTensorHandle(stack, values[made], dtypes[made], producer,
                                           /*shape_from_value=*/false);
    if (outputs[made] == nullptr) goto fail;
  }
  if (PyList_Append(pending, node_ref) < 0) goto fail;
  if (recorded >= 0) {  // (chunks: counted, not pruned; as the hook)
    PyObject* r = PyLong_FromLong(recorded + 1);
    int failed = r == nullptr || PyObject_SetAttr(handler, g_lazy.s_recorded, r) < 0;
    Py_XDECREF(r);
    if (failed) goto failed_after;
  } else {
    // As the hook: prune `_pending` when it grew past twice the live nodes.
    PyObject* live = PyObject_GetAttr(handler, g_lazy.s_live_nodes);
    long n_live = live != nullptr ? PyLong_AsLong(live) : -1;
    Py_XDECREF(live);
    if (n_live < 0 && PyErr_Occurred()) goto failed_after;
    if (PyList_GET_SIZE(pending) > 2 * n_live) {
      PyObject* r = PyObject_CallMethodNoArgs(handler, g_lazy.s_prune);
      if (r == nullptr) goto failed_after;
      Py_DECREF(r);
    }
  }
  *num_outputs = n_out;
  goto done;
failed_after:
  made = n_out;
fail:
  for (int k = 0; k < made; ++k) TFE_DeleteTensorHandle(outputs[k]);
  StatusFromPyErr(status);
done:
  for (PyObject* v : values) Py_XDECREF(v);
  Py_XDECREF(seq);
  Py_XDECREF(node);
  Py_XDECREF(node_ref);
  Py_XDECREF(pending);
  Py_XDECREF(producer);
  Py_XDECREF(refs);
  Py_XDECREF(node_inputs);
  Py_DECREF(handler);
  return true;
}

// lazy_setup(LazyValue, _Node, sequence, sigs, dtypes, stateful)
PyObject* PyLazySetup(PyObject*, PyObject* args) {
  PyObject *value, *node, *sequence, *sigs, *dtypes, *stateful;
  if (!PyArg_ParseTuple(args, "O!O!OO!O!O!", &PyType_Type, &value, &PyType_Type, &node,
                        &sequence, &PyDict_Type, &sigs, &PyDict_Type, &dtypes, &PyDict_Type,
                        &stateful)) {
    return nullptr;
  }
  LazyTypes t;
  t.value = reinterpret_cast<PyTypeObject*>(value);
  t.node = reinterpret_cast<PyTypeObject*>(node);
  for (PyTypeObject* type : {t.value, t.node}) {
    if (type->tp_dictoffset != 0 || type->tp_weaklistoffset == 0) {
      PyErr_Format(PyExc_TypeError, "lazy_setup: %s needs __slots__ with __weakref__",
                   type->tp_name);
      return nullptr;
    }
  }
  if (!SlotOffset(t.value, "node", &t.v_node) || !SlotOffset(t.value, "index", &t.v_index) ||
      !SlotOffset(t.value, "dtype", &t.v_dtype) || !SlotOffset(t.value, "value", &t.v_value) ||
      !SlotOffset(t.node, "seq", &t.n_seq) || !SlotOffset(t.node, "sig", &t.n_sig) ||
      !SlotOffset(t.node, "op", &t.n_op) || !SlotOffset(t.node, "device", &t.n_device) ||
      !SlotOffset(t.node, "inputs", &t.n_inputs) ||
      !SlotOffset(t.node, "outputs", &t.n_outputs) ||
      !SlotOffset(t.node, "values", &t.n_values) || !SlotOffset(t.node, "specs", &t.n_specs) ||
      !SlotOffset(t.node, "next", &t.n_next) || !SlotOffset(t.node, "failed", &t.n_failed)) {
    return nullptr;
  }
  using native_internal::InternOnce;
  if (!InternOnce(&t.s_pending, "_pending") || !InternOnce(&t.s_chunk_ops, "chunk_ops") ||
      !InternOnce(&t.s_recorded, "_recorded") ||
      !InternOnce(&t.s_live_nodes, "_live_nodes") || !InternOnce(&t.s_prune, "_prune")) {
    return nullptr;
  }
  t.sequence = sequence;
  t.sigs = sigs;
  t.dtypes = dtypes;
  t.stateful = stateful;
  for (PyObject* o : {value, node, sequence, sigs, dtypes, stateful}) Py_INCREF(o);
  if (g_lazy_ready) {  // a reloaded module: its classes and caches from now on
    for (PyObject* o : {reinterpret_cast<PyObject*>(g_lazy.value),
                        reinterpret_cast<PyObject*>(g_lazy.node), g_lazy.sequence, g_lazy.sigs,
                        g_lazy.dtypes, g_lazy.stateful}) {
      Py_DECREF(o);
    }
  }
  if (g_sig_cache == nullptr) g_sig_cache = new std::unordered_map<std::string, PyObject*>();
  g_lazy = t;
  g_lazy_ready = true;
  Py_RETURN_NONE;
}

}  // namespace fast
}  // namespace tf_ophandlers

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

}  // namespace

// lazy_plan(order, needed, specs) -> (plan, parts, returned, kept, external, ext_specs):
// Lazy._run's loop over the pending nodes `order` (recording order). See lazy.py.
PyObject* PyLazyPlan(PyObject*, PyObject* args) {
  PyObject *order, *needed;
  int specs;
  if (!PyArg_ParseTuple(args, "O!Op", &PyList_Type, &order, &needed, &specs)) return nullptr;
  if (!g_lazy_ready) {
    PyErr_SetString(PyExc_RuntimeError, "lazy_plan: lazy_setup was not called");
    return nullptr;
  }
  const bool any_needed = PyObject_IsTrue(needed) == 1;
  std::unordered_map<PyObject*, Py_ssize_t> position;
  std::unordered_map<void*, Py_ssize_t> ext_index;
  PyObject* plan = PyList_New(0);
  PyObject* parts = PyList_New(0);
  PyObject* returned = PyList_New(0);
  PyObject* kept = PyList_New(0);
  PyObject* external = PyList_New(0);
  PyObject* ext_specs = specs ? PyList_New(0) : Py_NewRef(Py_None);
  PyObject* result = nullptr;
  Py_ssize_t n = PyList_GET_SIZE(order);
  if (!plan || !parts || !returned || !kept || !external || !ext_specs) goto out;
  for (Py_ssize_t j = 0; j < n; ++j) {
    PyObject* node = PyList_GET_ITEM(order, j);
    if (Py_TYPE(node) != g_lazy.node || !Pending(node)) {
      PyErr_SetString(PyExc_TypeError, "lazy_plan: not a pending node");
      goto out;
    }
    position[node] = j;
    PyObject* outs = Slot(node, g_lazy.n_outputs);
    PyObject* inputs = Slot(node, g_lazy.n_inputs);
    PyObject* seq = Slot(node, g_lazy.n_seq);
    if (!outs || !PyList_Check(outs) || !PyList_Check(inputs) || !seq) {
      PyErr_SetString(PyExc_TypeError, "lazy_plan: a malformed node");
      goto out;
    }
    // The live outputs: referenced by the program, or needed by a pending node outside.
    PyObject* live = PyList_New(0);
    if (live == nullptr) goto out;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(outs); ++k) {
      PyObject* o = PyWeakref_GetObject(PyList_GET_ITEM(outs, k));  // borrowed
      if (o == nullptr) {
        Py_DECREF(live);
        goto out;
      }
      int need = 0;
      if (any_needed) {
        PyObject* key = Py_BuildValue("(On)", seq, k);
        need = key != nullptr ? PySet_Contains(needed, key) : -1;
        Py_XDECREF(key);
        if (need < 0) {
          Py_DECREF(live);
          goto out;
        }
      }
      if (o == Py_None && !need) continue;
      PyObject* kk = PyLong_FromSsize_t(k);
      PyObject* entry = kk ? PyTuple_Pack(3, node, kk, o) : nullptr;
      PyObject* ret = entry ? Py_BuildValue("(nn)", j, k) : nullptr;
      bool ok = ret && PyList_Append(live, kk) == 0 && PyList_Append(kept, entry) == 0 &&
                PyList_Append(returned, ret) == 0;
      Py_XDECREF(kk);
      Py_XDECREF(entry);
      Py_XDECREF(ret);
      if (!ok) {
        Py_DECREF(live);
        goto out;
      }
    }
    PyObject* live_t = PyList_AsTuple(live);
    Py_DECREF(live);
    if (live_t == nullptr) goto out;
    Py_ssize_t n_in = PyList_GET_SIZE(inputs);
    PyObject* refs = PyList_New(n_in);
    bool ok = refs != nullptr;
    for (Py_ssize_t i = 0; ok && i < n_in; ++i) {
      PyObject* t = PyList_GET_ITEM(inputs, i);
      PyObject* ref = nullptr;
      if (PyTuple_CheckExact(t)) {
        PyObject* producer = PyTuple_GET_ITEM(t, 0);
        PyObject* k = PyTuple_GET_ITEM(t, 1);
        if (Pending(producer)) {
          auto it = position.find(producer);
          if (it == position.end()) {
            PyErr_SetString(PyExc_RuntimeError, "lazy_plan: a producer after its consumer");
            ok = false;
            break;
          }
          ref = Py_BuildValue("(nO)", it->second, k);
          ok = ref != nullptr;
          if (ok) PyList_SET_ITEM(refs, i, ref);
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
      void* key = EagerTensor_CheckExact(t) ? static_cast<void*>(EagerTensor_Handle(t))
                                            : static_cast<void*>(t);
      auto it = ext_index.find(key);
      Py_ssize_t e;
      if (it == ext_index.end()) {
        e = PyList_GET_SIZE(external);
        ext_index.emplace(key, e);
        if (PyList_Append(external, t) < 0) {
          ok = false;
          break;
        }
        if (specs) {
          PyObject* sp = EagerTensor_CheckExact(t) ? EagerSpec(t) : nullptr;
          if (sp == nullptr && !PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "lazy_plan: an external input is not a tensor");
          }
          ok = sp != nullptr && PyList_Append(ext_specs, sp) == 0;
          Py_XDECREF(sp);
          if (!ok) break;
        }
      } else {
        e = it->second;
      }
      ref = Py_BuildValue("(nn)", static_cast<Py_ssize_t>(-1), e);
      ok = ref != nullptr;
      if (ok) PyList_SET_ITEM(refs, i, ref);
    }
    PyObject* refs_t = ok ? PyList_AsTuple(refs) : nullptr;
    PyObject* sig = Slot(node, g_lazy.n_sig);
    PyObject* device = Slot(node, g_lazy.n_device);
    if (refs_t != nullptr && (sig == nullptr || device == nullptr)) {
      PyErr_SetString(PyExc_TypeError, "lazy_plan: a node without sig or device");
      Py_CLEAR(refs_t);
      ok = false;
    }
    PyObject* step = refs_t ? PyTuple_Pack(4, node, refs, live_t, device) : nullptr;
    // graph_builder.node_part's (op type, attributes key, refs, device).
    PyObject* part = step && PyTuple_Check(sig) && PyTuple_GET_SIZE(sig) == 2
                         ? PyTuple_Pack(4, PyTuple_GET_ITEM(sig, 0), PyTuple_GET_ITEM(sig, 1),
                                        refs_t, device)
                         : nullptr;
    ok = part && PyList_Append(plan, step) == 0 && PyList_Append(parts, part) == 0;
    if (step && !part && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "lazy_plan: sig");
    Py_XDECREF(part);
    Py_XDECREF(step);
    Py_XDECREF(refs_t);
    Py_XDECREF(refs);
    Py_DECREF(live_t);
    if (!ok) goto out;
  }
  {
    PyObject* ret_t = PyList_AsTuple(returned);
    PyObject* parts_t = ret_t ? PyList_AsTuple(parts) : nullptr;
    PyObject* specs_t = parts_t ? (specs ? PyList_AsTuple(ext_specs) : Py_NewRef(Py_None))
                                : nullptr;
    if (specs_t != nullptr) {
      result = Py_BuildValue("(ONNOON)", plan, parts_t, ret_t, kept, external, specs_t);
    } else {
      Py_XDECREF(ret_t);
      Py_XDECREF(parts_t);
    }
  }
out:
  Py_XDECREF(plan);
  Py_XDECREF(parts);
  Py_XDECREF(returned);
  Py_XDECREF(kept);
  Py_XDECREF(external);
  Py_XDECREF(ext_specs);
  return result;
}

}  // namespace fast
}  // namespace tf_ophandlers
