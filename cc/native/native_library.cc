// tf-ophandlers: loading handler libraries, registering their types, the runtime API
// they call, and the module functions. Contracts: native.h, native_internal.h and
// include/tf_ophandlers/handler.h.
#define PY_SSIZE_T_CLEAN
#include "native/native_internal.h"

#include <dlfcn.h>

#include <cstring>
#include <string>
#include <vector>

#include "native/native_hooks.h"
#include "boundary/status.h"

namespace tf_ophandlers {
namespace native_internal {

// Shared with the fast path (fast_internal.h); set by SetSharedState (native_internal.h).
// Strong references.
PyObject* g_state = nullptr;     // tf_ophandlers.core.state.state (thread-local object)
PyObject* g_physical = nullptr;  // tf_ophandlers.core.stack.PHYSICAL
PyObject* s_mode = nullptr;      // interned attribute names
PyObject* s_current = nullptr;
PyObject* s_handler = nullptr;
PyObject* s_next = nullptr;
PyObject* s_device = nullptr;
PyObject* s_execute = nullptr;
PyObject* s_frames = nullptr;

bool InternOnce(PyObject** slot, const char* text) {
  if (*slot == nullptr) *slot = PyUnicode_InternFromString(text);
  return *slot != nullptr;
}

bool SetSharedState(PyObject* state, PyObject* physical) {
  Py_INCREF(state);
  Py_INCREF(physical);
  Py_XSETREF(g_state, state);
  Py_XSETREF(g_physical, physical);
  // Interned once per process: a second setup (native_setup and fast_setup both call
  // this) keeps the names it has instead of taking another reference each time.
  return InternOnce(&s_mode, "mode") && InternOnce(&s_current, "current") &&
         InternOnce(&s_handler, "handler") && InternOnce(&s_next, "next") &&
         InternOnce(&s_device, "device") && InternOnce(&s_execute, "execute") &&
         InternOnce(&s_frames, "frames");
}

// The thread's dict of the threading.local `state`, and which `state` it belongs to
// (SetSharedState may be given another object).
thread_local PyObject* t_state_dict = nullptr;
thread_local PyObject* t_state_owner = nullptr;

PyObject* StateGetNoGil(PyObject* name) {
  PyObject* dict = t_state_dict;
  if (dict == nullptr || t_state_owner != g_state || g_state == nullptr) return nullptr;
  // Only this thread ever changes its own dict of a threading.local, and it is here: the
  // lookup of an interned str key neither allocates nor touches the thread state.
  return PyDict_GetItemWithError(dict, name);
}

PyObject* StateGet(PyObject* name) {
  PyObject*& dict = t_state_dict;
  PyObject*& owner = t_state_owner;
  if (g_state == nullptr) return nullptr;
  if (owner != g_state || dict == nullptr) {
    static PyObject* s_dict = PyUnicode_InternFromString("__dict__");
    PyObject* d = s_dict != nullptr ? PyObject_GetAttr(g_state, s_dict) : nullptr;
    if (d == nullptr || !PyDict_Check(d)) {
      Py_XDECREF(d);
      PyErr_Clear();
      return nullptr;
    }
    dict = d;  // kept: see native_internal.h
    owner = g_state;
  }
  PyObject* v = PyDict_GetItemWithError(dict, name);
  if (v == nullptr) PyErr_Clear();
  return v;
}

// ---- the runtime API ----------------------------------------------------------------------

const char* ApiOpType(const TFOH_Op* op) { return op->type; }
const char* ApiOpDevice(const TFOH_Op* op) { return op->device; }
int ApiOpNumOutputs(const TFOH_Op* op) { return op->num_outputs; }
const TFE_OpAttrs* ApiOpAttrs(const TFOH_Op* op) { return TFE_OpGetAttrs(op->tfe); }

TF_DataType ApiTensorDtype(const TFOH_Tensor* t) {
  if (t->h != nullptr) return TFE_TensorHandleDataType(t->h);
  PyObject* d = PyObject_GetAttrString(t->py, "dtype");
  PyObject* e = d ? PyObject_GetAttrString(d, "as_datatype_enum") : nullptr;
  long v = e ? PyLong_AsLong(e) : 0;
  Py_XDECREF(d);
  Py_XDECREF(e);
  PyErr_Clear();
  return static_cast<TF_DataType>(v);
}

int ApiTensorNumDims(const TFOH_Tensor* t, TF_Status* status) {
  if (t->h != nullptr) return TFE_TensorHandleNumDims(t->h, status);
  PyObject* shape = PyObject_GetAttrString(t->py, "shape");
  PyObject* rank = shape ? PyObject_GetAttrString(shape, "rank") : nullptr;
  int r = (rank && rank != Py_None) ? static_cast<int>(PyLong_AsLong(rank)) : -1;
  Py_XDECREF(shape);
  Py_XDECREF(rank);
  if (PyErr_Occurred()) {
    StatusFromPyErr(status);
    return -1;
  }
  return r;
}

int64_t ApiTensorDim(const TFOH_Tensor* t, int index, TF_Status* status) {
  if (t->h != nullptr) return TFE_TensorHandleDim(t->h, index, status);
  PyObject* shape = PyObject_GetAttrString(t->py, "shape");
  PyObject* list = shape ? PyObject_CallMethod(shape, "as_list", nullptr) : nullptr;
  int64_t r = -1;
  if (list != nullptr) {
    if (index < 0 || index >= PyList_GET_SIZE(list)) {
      TF_SetStatus(status, TF_INVALID_ARGUMENT, "tf_ophandlers: dim index out of range");
    } else {
      PyObject* v = PyList_GET_ITEM(list, index);
      r = v == Py_None ? -1 : PyLong_AsLongLong(v);
    }
  }
  Py_XDECREF(shape);
  Py_XDECREF(list);
  if (PyErr_Occurred()) {
    StatusFromPyErr(status);
    return -1;
  }
  return r;
}

TFE_TensorHandle* ApiTensorHandle(const TFOH_Tensor* t) { return t->h; }
void ApiTensorRef(TFOH_Tensor* t) { t->refs.fetch_add(1, std::memory_order_relaxed); }
void ApiTensorUnref(TFOH_Tensor* t) { Unref(t); }

namespace {

void ApiRegisterType(TFOH_Library* library, const TFOH_HandlerType* type, TF_Status* status) {
  if (type == nullptr || !KnownAbiVersion(type->abi_version)) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 UnknownAbiVersionMessage(type ? type->abi_version : 0).c_str());
    return;
  }
  // Nothing past struct_size is read: a type too small for the fields every version has
  // would otherwise be registered with a NULL create, called when an instance is made.
  if (type->struct_size < TFOH_HANDLER_TYPE_MIN_SIZE) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 ("tf_ophandlers: register_type: type " +
                  std::to_string(library->types->size() + 1) + " of the library has struct_size " +
                  std::to_string(type->struct_size) + ", smaller than the " +
                  std::to_string(TFOH_HANDLER_TYPE_MIN_SIZE) +
                  " bytes of the fields every ABI version requires (abi_version .. execute, "
                  "TFOH_HANDLER_TYPE_MIN_SIZE); set it to sizeof(TFOH_HandlerType)")
                     .c_str());
    return;
  }
  TFOH_HandlerType hooks;
  std::memset(&hooks, 0, sizeof(hooks));
  std::memcpy(&hooks, type, HandlerTypeBytes(type));  // later versions' fields: NULL
  if (hooks.name == nullptr || hooks.name[0] == '\0' || hooks.create == nullptr ||
      hooks.delete_state == nullptr || (hooks.execute == nullptr && hooks.abi_version < 4)) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 "tf_ophandlers: register_type: name, create, delete_state and (before ABI "
                 "version 4) execute are required");
    return;
  }
  // Python class names and error messages are str: a name in another encoding is shown
  // with U+FFFD for its invalid bytes rather than failing every later message.
  std::string name = ValidUtf8(hooks.name);
  for (void* r : *library->types) {
    if (static_cast<TypeRecord*>(r)->name == name) {
      TF_SetStatus(status, TF_ALREADY_EXISTS,
                   ("tf_ophandlers: handler type " + name + " registered twice").c_str());
      return;
    }
  }
  auto* rec = new TypeRecord();
  rec->hooks = hooks;
  rec->name = name;
  rec->doc = ValidUtf8(hooks.doc);
  rec->hooks.name = rec->name.c_str();
  rec->hooks.doc = rec->doc.c_str();
  library->types->push_back(rec);
}

}  // namespace

const TFOH_RuntimeApi kApi = {
    TFOH_ABI_VERSION,  sizeof(TFOH_RuntimeApi), ApiOpType,       ApiOpDevice,
    ApiOpNumOutputs,   ApiOpAttrs,              ApiTensorDtype,  ApiTensorNumDims,
    ApiTensorDim,      ApiTensorHandle,         ApiTensorRef,    ApiTensorUnref,
    ApiExecuteNext,    ApiRegisterType,         ApiOpNew,        ApiOpDelete,
    ApiOpSetAttrType,  ApiOpSetAttrInt,         ApiOpSetAttrFloat, ApiOpSetAttrBool,
    ApiOpSetAttrTensor, ApiTensorSetData,       ApiTensorData,
};

namespace {

// ---- module functions ---------------------------------------------------------------------

PyObject* PyNativeSetup(PyObject*, PyObject* args) {
  PyObject *state, *physical;
  if (!PyArg_ParseTuple(args, "OO", &state, &physical)) return nullptr;
  if (!SetSharedState(state, physical)) return nullptr;
  Py_RETURN_NONE;
}

// load_handler_library(path) -> [(name, doc, type_capsule, {hook: present}), ...]
PyObject* PyLoadHandlerLibrary(PyObject*, PyObject* args) {
  const char* path;
  if (!PyArg_ParseTuple(args, "s", &path)) return nullptr;
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* e = dlerror();
    PyErr_Format(PyExc_OSError, "tf_ophandlers: cannot load handler library %s: %s", path,
                 e ? e : "unknown error");
    return nullptr;
  }
  auto init = reinterpret_cast<TFOH_InitHandlerLibraryFn>(
      dlsym(lib, TFOH_INIT_HANDLER_LIBRARY_SYMBOL));
  if (init == nullptr) {
    PyErr_Format(PyExc_OSError,
                 "tf_ophandlers: %s is not a handler library (it does not export %s)", path,
                 TFOH_INIT_HANDLER_LIBRARY_SYMBOL);
    return nullptr;  // the library stays loaded (like tf.load_op_library)
  }
  std::vector<void*> types;
  TFOH_Library library{&types};
  TF_Status* s = TF_NewStatus();
  init(&kApi, &library, s);
  if (TF_GetCode(s) != TF_OK) {
    PyErr_Format(PyExc_RuntimeError, "tf_ophandlers: handler library %s failed to load: %s",
                 path, TF_Message(s));
    TF_DeleteStatus(s);
    return nullptr;  // records already registered leak with the library (never unloaded)
  }
  TF_DeleteStatus(s);
  PyObject* out = PyList_New(0);
  for (void* f : types) {
    auto* rec = static_cast<TypeRecord*>(f);
    PyObject* cap = PyCapsule_New(rec, "tf_ophandlers.type", nullptr);
    const TFOH_HandlerType& k = rec->hooks;
    PyObject* hooks = Py_BuildValue(
        "{sOsOsOsOsOsOsOsOsOsOsOsOsO}", "execute", k.execute ? Py_True : Py_False,
        "executes_op", k.executes_op ? Py_True : Py_False, "copy_on", k.copy_on ? Py_True : Py_False, "copy_off",
        k.copy_off ? Py_True : Py_False, "num_dims", k.num_dims ? Py_True : Py_False, "dim",
        k.dim ? Py_True : Py_False, "debug_string", k.debug_string ? Py_True : Py_False,
        "tensor_debug_string", k.tensor_debug_string ? Py_True : Py_False, "query",
        k.query ? Py_True : Py_False, "function_input_summary",
        k.function_input_summary ? Py_True : Py_False, "static_value",
        k.static_value ? Py_True : Py_False, "function_cache_key",
        k.function_cache_key ? Py_True : Py_False, "function_output",
        k.function_output ? Py_True : Py_False);
    PyObject* item = cap && hooks ? Py_BuildValue("(ssNN)", rec->name.c_str(), rec->doc.c_str(),
                                                  cap, hooks)
                                  : nullptr;
    if (item == nullptr || PyList_Append(out, item) < 0) {
      Py_XDECREF(item);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(item);
  }
  return out;
}

}  // namespace

}  // namespace native_internal

using native_internal::PyLoadHandlerLibrary;
using native_internal::PyNativeSetup;

PyMethodDef kNativeModuleMethods[] = {
    {"native_setup", PyNativeSetup, METH_VARARGS,
     "native_setup(state, PHYSICAL): what the native execute path reads."},
    {"load_handler_library", PyLoadHandlerLibrary, METH_VARARGS,
     "load_handler_library(path) -> [(name, doc, type_capsule, {optional hook: present})]."},
    {nullptr}};

}  // namespace tf_ophandlers
