// tf-ophandlers: Python exceptions <-> TF_Status. Contracts: status.h.
#define PY_SSIZE_T_CLEAN
#include "status.h"

#include "runtime.h"

namespace tf_ophandlers {
namespace {

// Sets `status` to (code, UTF-8 of `text`), escaping lone surrogates. Clears any Python
// error. GIL: held.
void SetStatusFromStr(TF_Status* status, TF_Code code, PyObject* text, const char* fallback) {
  PyObject* bytes =
      text != nullptr ? PyUnicode_AsEncodedString(text, "utf-8", "backslashreplace") : nullptr;
  if (bytes == nullptr) {
    PyErr_Clear();
    TF_SetStatus(status, code, fallback);
    return;
  }
  TF_SetStatus(status, code, PyBytes_AS_STRING(bytes));
  Py_DECREF(bytes);
}

}  // namespace

void StatusFromPyErr(TF_Status* status, bool accessor) {
  PyObject *etype, *exc, *etb;
  PyErr_Fetch(&etype, &exc, &etb);
  PyErr_NormalizeException(&etype, &exc, &etb);
  if (exc != nullptr && etb != nullptr) PyException_SetTraceback(exc, etb);
  Py_XDECREF(etype);
  Py_XDECREF(etb);
  if (exc == nullptr) {
    TF_SetStatus(status, TF_UNKNOWN, "tf_ophandlers: handler failed without an exception");
    return;
  }
  PyObject* r = g_stash_error ? PyObject_CallFunctionObjArgs(g_stash_error, exc,
                                                              accessor ? Py_True : Py_False,
                                                              nullptr)
                              : nullptr;
  if (r != nullptr && PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 2 &&
      PyUnicode_Check(PyTuple_GET_ITEM(r, 1))) {
    int code = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(r, 0)));
    if (PyErr_Occurred() || code <= TF_OK || code > TF_UNAUTHENTICATED) {
      PyErr_Clear();
      code = TF_UNKNOWN;  // a failure must never be reported as OK
    }
    SetStatusFromStr(status, static_cast<TF_Code>(code), PyTuple_GET_ITEM(r, 1),
                     "tf_ophandlers: handler error");
  } else {
    // The stash failed (out of memory): the exception cannot be recovered; keep its text.
    PyErr_Clear();
    PyObject* s = PyObject_Str(exc);
    if (s == nullptr) PyErr_Clear();
    SetStatusFromStr(status, TF_UNKNOWN, s, "tf_ophandlers: handler error");
    Py_XDECREF(s);
  }
  Py_XDECREF(r);
  Py_DECREF(exc);
}

void RaiseFromStatus(TF_Status* status) {
  PyObject* core = PyImport_ImportModule("tf_ophandlers.core.errors");
  if (core != nullptr) {
    PyObject* r = PyObject_CallMethod(core, "raise_from_code", "is",
                                      static_cast<int>(TF_GetCode(status)),
                                      TF_Message(status));
    Py_XDECREF(r);  // always null: it raises
    Py_DECREF(core);
    if (PyErr_Occurred()) return;
  }
  PyErr_Format(PyExc_RuntimeError, "%s", TF_Message(status));
}

void SetHookOutputError(PyObject* stack, const char* hook, PyObject* op_type,
                        const std::string& detail) {
  PyObject* errors = PyImport_ImportModule("tf_ophandlers.core.errors");
  PyObject* exc = errors ? PyObject_CallMethod(errors, "hook_output_error", "OsOs", stack, hook,
                                               op_type ? op_type : Py_None, detail.c_str())
                         : nullptr;
  Py_XDECREF(errors);
  if (exc == nullptr || !PyExceptionInstance_Check(exc)) {
    Py_XDECREF(exc);
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "tf_ophandlers: %s returned %s", hook, detail.c_str());
    return;
  }
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
  Py_DECREF(exc);
}

std::string SafeRepr(PyObject* o) {
  PyObject* r = PyObject_Repr(o);
  PyObject* b = r ? PyUnicode_AsEncodedString(r, "utf-8", "backslashreplace") : nullptr;
  Py_XDECREF(r);
  if (b == nullptr) {
    PyErr_Clear();
    return "<unprintable>";
  }
  std::string s(PyBytes_AS_STRING(b), static_cast<size_t>(PyBytes_GET_SIZE(b)));
  Py_DECREF(b);
  if (s.size() > 200) s = s.substr(0, 200) + "...";
  return s;
}

}  // namespace tf_ophandlers
