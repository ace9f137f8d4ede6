/* tf-ophandlers C++ boundary: mapping between Python exceptions and TF_Status (internal
   header). Implementation: status.cc.

   A handler's exception cannot cross TensorFlow's C API as a Python object, only as a
   status (code, message). StatusFromPyErr therefore *stashes* the exception object in
   tf_ophandlers.core.errors and the status message ends with a marker
   `[tf_ophandlers#N]`; wherever TensorFlow later turns that status into a Python
   exception (its status-to-exception conversion, or the registered exception classes
   its C++ accessors instantiate, both patched by errors.install), the user receives the
   original exception object again, with its type, message and traceback.
*/
#ifndef TF_OPHANDLERS_STATUS_H_
#define TF_OPHANDLERS_STATUS_H_

#include <Python.h>

#include <string>

#include "tensorflow/c/tf_status.h"

namespace tf_ophandlers {

// Converts the current Python exception into `status` and clears it. The exception object
// is stashed (a strong reference, kept by tf_ophandlers.core.errors until the status comes
// back to Python or 256 later exceptions push it out) and `status` gets the code mapped
// from its type and a valid UTF-8 message ending with the marker. Without a current
// exception, `status` becomes TF_UNKNOWN. Never reports TF_OK. `accessor`: the exception
// comes from a hook TensorFlow calls from an EagerTensor accessor (num_dims, dim,
// tensor_debug_string), whose status TensorFlow turns into an exception in C++ (see
// tf_ophandlers/core/errors.py).
// GIL: must be held. Status: always sets `status` to an error.
void StatusFromPyErr(TF_Status* status, bool accessor = false);

// Sets a Python exception from a failed `status` that came out of TensorFlow (TFE_Execute
// in ExecuteOp): the stashed exception when the message carries a marker, else the
// tf.errors class of its code. `status` is not modified.
// GIL: must be held. Status: `status` must not be TF_OK.
void RaiseFromStatus(TF_Status* status);

// Sets tf_ophandlers.HandlerOutputError as the current Python exception for a hook that
// returned something the boundary cannot use: "<handler of stack>.<hook> returned
// <detail>[ for op <op_type>]". `stack` and `op_type` (a str, or null/None when unknown)
// are borrowed. Falls back to a TypeError if the error module cannot be imported.
// GIL: must be held. Always leaves an exception set.
void SetHookOutputError(PyObject* stack, const char* hook, PyObject* op_type,
                        const std::string& detail);

// `text` with every byte sequence that is not valid UTF-8 replaced by U+FFFD (one per
// byte that does not start a well-formed sequence): text from a handler library (a type name, a
// debug_string, a status message) may be in another encoding, and TensorFlow's and this
// project's status-to-exception conversions decode messages as UTF-8. Null gives "".
// Never fails. GIL: not needed.
std::string ValidUtf8(const char* text);
std::string ValidUtf8(const char* text, size_t length);

// ---- C++ exceptions escaping a handler library's hook ----
// handler.h forbids them, but one must not unwind through TensorFlow's C API or Python
// (std::terminate would end the process): the boundary catches them and reports these.

// Inside a catch block: the current exception's what() (valid UTF-8), or a description
// for an exception that is not a std::exception. Never throws.
std::string ThrownText() noexcept;

// The message of the HandlerError for a hook that threw: "tf_ophandlers: <handler>.<hook>
// threw a C++ exception[ for op <op>]: <text> (...)". Never throws.
std::string HookThrewMessage(const std::string& handler, const char* hook, const char* op_type,
                             const std::string& text) noexcept;

// Sets `status` to an oh.HandlerError with `message` (stashed as above), or to
// TF_INTERNAL with the message when Python cannot make one. Takes the GIL itself (the
// no-GIL execute path calls it). Never throws.
void SetHandlerError(TF_Status* status, const std::string& message) noexcept;

// Sets oh.HandlerError(message) as the current Python exception. GIL: held.
void RaiseHandlerError(const std::string& message);

// repr(o) as UTF-8 (lone surrogates escaped), or "<unprintable>" if repr fails (the
// failure is cleared). GIL: must be held. Never leaves an exception set.
std::string SafeRepr(PyObject* o);

}  // namespace tf_ophandlers

#endif  // TF_OPHANDLERS_STATUS_H_
