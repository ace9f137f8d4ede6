// tf-ophandlers: oh.Lazy's record path in C (kPlugin). Contracts: lazy.h.
//
// `Lazy.execute` (handlers/lazy/handler.py) for its common op: a stateless op over PHYSICAL
// whose inputs are pending or computed values of the stack or physical tensors (none a
// resource), whose output dtypes are known and whose signature is cached
// (lazy_compile.sigs). It builds the same Python objects the hook builds (a `_Node`
// and one `LazyValue` per output, allocated with their types' own allocator and their
// slots set by offset, as their `__init__` sets them) and appends the node to the
// handler's `_pending`: recording costs no Python frame, no Op object and no wrap of a
// Python list. Anything else (a chunk to launch, an op or input the hook treats specially, a cache
// miss) runs the hook (RunHook), which fills the caches for the next op.
#define PY_SSIZE_T_CLEAN
#include "handlers/lazy/lazy.h"

#include <structmember.h>

#include <cstring>
#include <string>
#include <unordered_map>

#include "absl/container/inlined_vector.h"
#include "boundary/handler_tensor.h"
#include "boundary/op.h"
#include "boundary/owners.h"
#include "boundary/runtime.h"
#include "boundary/status.h"

namespace tf_ophandlers {
namespace fast {

LazyTypes g_lazy;
bool g_lazy_ready = false;

namespace {

// (op type, output dtypes) -> signature, for types the Python caches call stateless
// with attributes that follow the outputs. Strong references; bounded (cleared when full).
std::unordered_map<std::string, PyObject*>* g_sig_cache = nullptr;
constexpr size_t kMaxSigs = 4096;
// enum -> tf.DType (strong references).
constexpr int kMaxEnum = 256;
PyObject* g_dtype_objs[kMaxEnum] = {nullptr};

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

// `o.name` (a new reference, or null with an exception set), as PyObject_GetAttr gives
// it. The handler's own attributes (set in Lazy.__init__) are read from its instance
// dict when the generic lookup would find them there: its type uses the generic
// getattr and defines nothing of that name (so no descriptor comes first); otherwise,
// or when the dict lacks the name, PyObject_GetAttr. Spares the generic lookup's
// work on each recorded op. GIL: held.
PyObject* InstanceAttr(PyObject* o, PyObject* name) {
  PyTypeObject* type = Py_TYPE(o);
  if (type->tp_getattro == PyObject_GenericGetAttr && _PyType_Lookup(type, name) == nullptr) {
    PyObject** dict = _PyObject_GetDictPtr(o);
    PyObject* v = dict != nullptr && *dict != nullptr ? PyDict_GetItemWithError(*dict, name)
                                                      : nullptr;
    if (v != nullptr) return Py_NewRef(v);
    if (PyErr_Occurred()) return nullptr;
  }
  return PyObject_GetAttr(o, name);
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
  // tensor, or the physical tensor itself. Resources run eagerly (the hook). Each
  // input's payload is looked up once (`payloads`, null: a physical tensor).
  absl::InlinedVector<TFOH_Payload*, 4> payloads(n_in, nullptr);
  for (int i = 0; i < n_in; ++i) {
    if (TFE_TensorHandleDataType(in[i]) == TF_RESOURCE) return hook();
    TFOH_Payload* p = payloads[i] = PayloadOf(in[i]);
    if (p != nullptr &&
        (p->kind != TFOH_PAYLOAD_PYTHON || reinterpret_cast<PyObject*>(p->stack) != stack ||
         p->value == nullptr ||
         Py_TYPE(reinterpret_cast<PyObject*>(p->value)) != g_lazy.value)) {
      return hook();  // another stack's tensor, or not a LazyValue: the hook's rules
    }
  }
  // Released in the reverse order of these declarations (the handler last).
  PyRef handler(PyObject_GetAttr(stack, s_handler));
  // Not taken here: the hook runs it, with no reference of this path held meanwhile.
  auto decline = [&]() {
    PyErr_Clear();
    handler.reset();
    return hook();
  };
  PyRef chunk(handler ? InstanceAttr(handler.get(), g_lazy.s_chunk_ops) : nullptr);
  if (!chunk) return decline();
  // With chunk_ops: the ops recorded since the last chunk (-1 without). When a chunk is
  // due the hook launches it first. An execute set on the instance is its hook.
  long recorded = -1;
  if (chunk.get() != Py_None) {
    long limit = PyLong_CheckExact(chunk.get()) ? PyLong_AsLong(chunk.get()) : -1;
    PyRef r(InstanceAttr(handler.get(), g_lazy.s_recorded));
    recorded = r && PyLong_CheckExact(r.get()) ? PyLong_AsLong(r.get()) : -1;
    r.reset();
    if (recorded < 0 || limit < 1 || (recorded > 0 && recorded >= limit)) recorded = -2;
  }
  chunk.reset();
  PyObject** dict = _PyObject_GetDictPtr(handler.get());
  if (recorded == -2 ||
      (dict != nullptr && *dict != nullptr && PyDict_GetItem(*dict, s_execute) != nullptr)) {
    return decline();
  }
  PyObject* dev = StateGet(s_device);  // borrowed; state.device, as the hook's _Node reads
  if (dev == nullptr) return decline();
  const int n_out = static_cast<int>(dtypes.size());
  PyRef node_inputs(PyList_New(n_in));
  PyRef refs(PyList_New(n_out));
  PyRef producer;
  PyRef pending;
  PyRef node_ref;
  PyRef node;
  PyRef seq;
  absl::InlinedVector<PyRef, 4> values(n_out);
  // A failure: the first `made` outputs were handed out and are taken back.
  auto fail = [&](int made) {
    for (int k = 0; k < made; ++k) TFE_DeleteTensorHandle(outputs[k]);
    StatusFromPyErr(status);
    return true;
  };
  if (!node_inputs || !refs) return fail(0);
  for (int i = 0; i < n_in; ++i) {
    TFOH_Payload* p = payloads[i];
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
          return fail(0);
        }
        item = PyTuple_Pack(2, producer_node, index);
        if (item != nullptr) PyObject_GC_UnTrack(item);
      }
    } else {
      item = native_internal::EagerTensorSharing(in[i]);
    }
    if (item == nullptr) return fail(0);
    PyList_SET_ITEM(node_inputs.get(), i, item);
  }
  // The cyclic collector is kept off the recorded objects (the node, its lists and
  // tuples, the values and weak references): a recorded program is thousands of them,
  // alive while recording goes on, so each collection would walk them and promote them
  // to the oldest generation, whose full collections walk the whole heap. They form no
  // cycle the collector could see: nodes refer only to older nodes and tensors, values
  // to their node, and a value's holder (a handler tensor) is not traversed anyway.
  PyObject_GC_UnTrack(node_inputs.get());
  PyObject_GC_UnTrack(refs.get());
  node.reset(g_lazy.node->tp_alloc(g_lazy.node, 0));
  if (node) PyObject_GC_UnTrack(node.get());
  seq.reset(node ? PyIter_Next(g_lazy.sequence) : nullptr);
  if (!seq) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "oh.Lazy: no sequence number");
    return fail(0);
  }
  // As _Node.__init__ sets them (op None: the next stack is PHYSICAL).
  PyObject* n = node.get();
  Slot(n, g_lazy.n_seq) = seq.release();  // (takes the reference)
  Set(n, g_lazy.n_sig, sig);
  Set(n, g_lazy.n_op, Py_None);
  Set(n, g_lazy.n_device, dev);
  Set(n, g_lazy.n_inputs, node_inputs.get());
  Set(n, g_lazy.n_outputs, refs.get());
  Set(n, g_lazy.n_values, Py_None);
  Set(n, g_lazy.n_specs, Py_None);
  Set(n, g_lazy.n_next, d.next);
  Set(n, g_lazy.n_failed, Py_False);
  for (int k = 0; k < n_out; ++k) {
    values[k].reset(g_lazy.value->tp_alloc(g_lazy.value, 0));
    PyObject* v = values[k].get();
    if (v == nullptr) return fail(0);
    PyObject_GC_UnTrack(v);
    Set(v, g_lazy.v_node, n);
    PyObject* index = PyLong_FromLong(k);
    if (index == nullptr) return fail(0);
    Slot(v, g_lazy.v_index) = index;
    Set(v, g_lazy.v_dtype, dtype_objs[k]);
    Set(v, g_lazy.v_value, Py_None);
    PyObject* r = PyWeakref_NewRef(v, nullptr);
    if (r == nullptr) return fail(0);
    PyObject_GC_UnTrack(r);  // (no callback: nothing to traverse)
    PyList_SET_ITEM(refs.get(), k, r);
  }
  pending.reset(InstanceAttr(handler.get(), g_lazy.s_pending));
  node_ref.reset(pending ? PyWeakref_NewRef(n, nullptr) : nullptr);
  if (node_ref) PyObject_GC_UnTrack(node_ref.get());
  producer.reset(node_ref ? InternedString(type) : nullptr);
  if (!producer) return fail(0);
  if (!PyList_Check(pending.get())) {
    PyErr_SetString(PyExc_TypeError, "oh.Lazy: _pending is not a list");
    return fail(0);
  }
  for (int made = 0; made < n_out; ++made) {
    outputs[made] = NewHandlerTensorHandle(stack, values[made].get(), dtypes[made],
                                           producer.get(), /*shape_from_value=*/false);
    if (outputs[made] == nullptr) return fail(made);
  }
  if (PyList_Append(pending.get(), node_ref.get()) < 0) return fail(n_out);
  if (recorded >= 0) {  // (chunks: counted, not pruned; as the hook)
    PyRef r(PyLong_FromLong(recorded + 1));
    int failed = !r || PyObject_SetAttr(handler.get(), g_lazy.s_recorded, r.get()) < 0;
    r.reset();
    if (failed) return fail(n_out);
  } else {
    // As the hook: prune `_pending` when it grew past twice the live nodes.
    PyRef live(InstanceAttr(handler.get(), g_lazy.s_live_nodes));
    long n_live = live ? PyLong_AsLong(live.get()) : -1;
    live.reset();
    if (n_live < 0 && PyErr_Occurred()) return fail(n_out);
    if (PyList_GET_SIZE(pending.get()) > 2 * n_live) {
      PyRef r(PyObject_CallMethodNoArgs(handler.get(), g_lazy.s_prune));
      if (!r) return fail(n_out);
    }
  }
  *num_outputs = n_out;
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

PyMethodDef kLazyModuleMethods[] = {
    {"lazy_setup", PyLazySetup, METH_VARARGS,
     "lazy_setup(LazyValue, _Node, sequence, sigs, dtypes, stateful): oh.Lazy's C record."},
    {"lazy_plan", PyLazyPlan, METH_VARARGS,
     "lazy_plan(order, needed, specs, want_plan): oh.Lazy's key, kept outputs, external "
     "inputs and (want_plan) plan."},
    {"lazy_upstream", PyLazyUpstream, METH_VARARGS,
     "lazy_upstream(roots): the pending nodes roots depend on, in recording order."},
    {"lazy_computed", PyLazyComputed, METH_VARARGS,
     "lazy_computed(order): marks the nodes computed (releases their inputs)."},
    {nullptr}};

}  // namespace fast
}  // namespace tf_ophandlers
