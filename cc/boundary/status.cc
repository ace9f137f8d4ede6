// tf-ophandlers: Python exceptions <-> TF_Status. Contracts: status.h.
#define PY_SSIZE_T_CLEAN
#include "boundary/status.h"

#include <cstring>
#include <exception>

#include "boundary/runtime.h"

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
    // A message that is not UTF-8 (a handler library's own text) must not turn into a
    // UnicodeDecodeError that hides the error it carries.
    const char* m = TF_Message(status);
    PyObject* text = PyUnicode_DecodeUTF8(m, static_cast<Py_ssize_t>(std::strlen(m)), "replace");
    PyObject* r = text ? PyObject_CallMethod(core, "raise_from_code", "iO",
                                             static_cast<int>(TF_GetCode(status)), text)
                       : nullptr;
    Py_XDECREF(text);
    Py_XDECREF(r);  // always null: it raises
    Py_DECREF(core);
    if (PyErr_Occurred()) return;
  }
  PyErr_Format(PyExc_RuntimeError, "%s", ValidUtf8(TF_Message(status)).c_str());
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

std::string ValidUtf8(const char* text) {
  return text == nullptr ? std::string() : ValidUtf8(text, std::strlen(text));
}

std::string ValidUtf8(const char* text, size_t length) {
  static const char kReplacement[] = "\xEF\xBF\xBD";
  const auto* s = reinterpret_cast<const unsigned char*>(text);
  std::string out;
  out.reserve(length);
  size_t i = 0;
  while (i < length) {
    unsigned char c = s[i];
    // The length of a well-formed sequence starting at i (RFC 3629: no overlong forms,
    // no surrogates, nothing above U+10FFFF), 0 when it is not one.
    size_t n = 0;
    if (c < 0x80) {
      n = 1;
    } else if (c >= 0xC2 && c <= 0xDF) {
      n = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      n = 3;
    } else if (c >= 0xF0 && c <= 0xF4) {
      n = 4;
    }
    bool ok = n > 0 && i + n <= length;
    for (size_t k = 1; ok && k < n; ++k) ok = (s[i + k] & 0xC0) == 0x80;
    if (ok && n >= 3) {
      unsigned char d = s[i + 1];
      ok = !(c == 0xE0 && d < 0xA0) && !(c == 0xED && d > 0x9F) &&
           !(c == 0xF0 && d < 0x90) && !(c == 0xF4 && d > 0x8F);
    }
    if (ok) {
      out.append(text + i, n);
      i += n;
    } else {
      out += kReplacement;
      ++i;
    }
  }
  return out;
}

std::string ThrownText() noexcept {
  try {
    throw;
  } catch (const std::exception& e) {
    return ValidUtf8(e.what());
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

std::string HookThrewMessage(const std::string& handler, const char* hook, const char* op_type,
                             const std::string& text) noexcept {
  std::string m = "tf_ophandlers: " + handler + "." + hook + " threw a C++ exception";
  if (op_type != nullptr) m += std::string(" for op ") + op_type;
  return m + ": " + text +
         " (hooks report failures through their TF_Status; tf_ophandlers/handler.h)";
}

void RaiseHandlerError(const std::string& message) {
  PyObject* errors = PyImport_ImportModule("tf_ophandlers.core.errors");
  PyObject* cls = errors ? PyObject_GetAttrString(errors, "HandlerError") : nullptr;
  Py_XDECREF(errors);
  PyObject* text = PyUnicode_DecodeUTF8(message.data(), static_cast<Py_ssize_t>(message.size()),
                                        "replace");
  if (cls == nullptr || text == nullptr) {
    PyErr_Clear();
    PyErr_SetString(PyExc_RuntimeError, ValidUtf8(message.c_str()).c_str());
  } else {
    PyErr_SetObject(cls, text);
  }
  Py_XDECREF(cls);
  Py_XDECREF(text);
}

void SetHandlerError(TF_Status* status, const std::string& message) noexcept {
  PyGILState_STATE g = PyGILState_Ensure();
  // Keep an exception already being raised on this thread (this one replaces it in the
  // status, but Python code that runs next must not see a stale one).
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);
  RaiseHandlerError(message);
  StatusFromPyErr(status);
  PyErr_Restore(et, ev, tb);
  PyGILState_Release(g);
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
