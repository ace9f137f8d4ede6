/* tf-ophandlers C++ boundary: process-wide state shared by the translation units of
   tf_ophandlers._C (internal header, not installed).

   Everything here is set once by `_C.init` (module.cc) and read by the device callbacks,
   the payload methods and the module functions. The PyObject* globals are strong
   references that live until the process exits; they are written once, with the GIL
   held, before the dispatcher device is registered, and only read afterwards.
*/
#ifndef TF_OPHANDLERS_RUNTIME_H_
#define TF_OPHANDLERS_RUNTIME_H_

#include <Python.h>

#include <atomic>
#include <string>

#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/tf_status.h"

// Private symbols of lib_pywrap_tensorflow_common.so (TF 2.21; the Python package checks
// the version before loading this module). Declared here because no public header
// declares them.
//
// EagerTensorFromHandle takes ownership of `handle` on success (returns a new reference);
// on failure (null, Python exception set) the caller still owns `handle`. GIL: held.
PyObject* EagerTensorFromHandle(TFE_TensorHandle* handle, const bool is_packed);
// Borrowed: valid while `o` is alive. `o` must be an EagerTensor. GIL: held.
TFE_TensorHandle* EagerTensor_Handle(const PyObject* o);
bool EagerTensor_CheckExact(const PyObject* o);

namespace tf_ophandlers {

// ---- state set by _C.init (module.cc); all guarded by the GIL ---------------------------
extern TFE_Context* g_ctx;          // Not owned (the Python eager context owns it).
extern std::string g_device_name;   // The dispatcher device's full name.
extern PyTypeObject* g_op_type;     // tf_ophandlers.core.op.Op (a subclass of _C.OpBase).
extern PyObject* g_execute;         // dispatch.execute(op, inputs) -> list
extern PyObject* g_copy_to;         // dispatch.copy_to_device(tensor) -> tensor
extern PyObject* g_copy_from;       // dispatch.copy_from_device(tensor, dev) -> tensor
extern PyObject* g_stash_error;     // errors.stash_error(exc, accessor) -> (code, msg)
extern PyObject* g_num_dims;        // dispatch.num_dims(stack, value, op_type) -> int, or
                                    // the whole shape as a tuple (handler_tensor.cc)
extern PyObject* g_dim;             // dispatch.dim(stack, value, i, op_type) -> int
extern PyObject* g_summarize;       // dispatch.summarize(stack, value) -> str
extern PyObject* g_error_text;      // dispatch.output_error(op, kind, detail, outs) -> str

// Set by `_C.shutdown` (an atexit hook in tf_ophandlers/__init__.py): from then on
// callbacks do not enter Python. Atomic: read without the GIL.
extern std::atomic<bool> g_shutdown;

// Whether a callback may enter Python: not shut down, interpreter initialized and not
// finalizing. GIL: not needed. Never fails.
bool PythonAlive();

// Returns true if `_C.init` has registered the dispatcher; otherwise sets a
// RuntimeError and returns false. GIL: must be held.
bool RequireInit();

// One reusable TF_Status per thread, reset to TF_OK on each call, for hot paths that
// must not allocate. Owned by the thread (never freed); do not keep it across calls
// that may use it again. GIL: not needed.
TF_Status* ThreadStatus();

// Returns a new reference to an interned str for `text` (op types and device names are
// few and repeat on every op; at most 100000 are kept), or null with a Python exception
// set. GIL: must be held.
PyObject* InternedString(const char* text);

// The interned str for `text` if InternedString keeps it for the process (made and kept
// now if there is room), borrowed: valid for the process; null when it is not kept (no
// Python exception left set). GIL: must be held.
PyObject* InternedStringKept(const char* text);

// Whether `dtype` is a TensorFlow dtype a tensor can have (a valid, non-reference
// DataType other than DT_INVALID). GIL: not needed.
bool ValidDataType(long dtype);

}  // namespace tf_ophandlers

#endif  // TF_OPHANDLERS_RUNTIME_H_
