/* tf-ophandlers: using op handlers from TensorFlow's C API (TFE_*), with no Python.

   A program that runs ops with TFE_Execute (directly, or through a binding built on the
   C API: Go, Rust, Java, C++) opens handler scopes with the functions below. The
   handlers are *native*: handler libraries written against tf_ophandlers/handler.h
   (TFOH_C_LoadHandlerLibrary) and the package's own C++ handlers, PassThrough and
   OpCounter (TFOH_C_NativeHandlers). Handlers written in Python (subclasses of
   tf_ophandlers.OpHandler) need the Python package and are out of reach here.

   The functions live in libtf_ophandlers_c.so (`make c-api` builds it into
   tf_ophandlers/), which links TensorFlow's libtensorflow_cc.so.2 and
   libtensorflow_framework.so.2 and nothing of Python: a process using it never loads an
   interpreter. Compile with the include directories of oh.sysconfig (this header,
   TensorFlow's headers) and link with -ltf_ophandlers_c plus TensorFlow's libraries
   (see examples/c_api/ and docs/using-handlers-from-c.md).

   Usage, in the style of a Python `with` scope:

     TFOH_C_Dispatcher* d = TFOH_C_RegisterDispatcher(ctx, NULL, status);
     const TFOH_C_Library* native = TFOH_C_NativeHandlers(status);
     TFOH_C_Handler* counter = TFOH_C_NewHandler(d, native, "OpCounter", "", status);
     TFOH_C_PushHandler(counter, status);
     ... TFE_OpSetDevice(op, TFOH_C_DispatcherDeviceName(d), status); TFE_Execute(...) ...
     TFOH_C_PopHandler(counter, status);
     TFOH_C_HandlerQuery(counter, "counts", buffer, status);
     TFOH_C_DeleteHandler(counter);
     TFOH_C_DeleteDispatcher(d);

   Which ops reach the handlers. TensorFlow's C API has no device scope: an op reaches
   the dispatcher device when it is placed there (TFE_OpSetDevice with
   TFOH_C_DispatcherDeviceName) or when one of its inputs is a handler tensor (an output
   of an op that ran under a handler; TensorFlow's type-based dispatch). Such an op runs
   on the innermost scope of the calling thread (the handler pushed last sees it first,
   and executes on the handlers pushed before it, then on the physical device); with no
   scope open on the thread, on the stack of its first handler-tensor input; with
   neither, on the physical device. Physical inputs are copied on through every level's
   copy_on hook; a handler tensor of a stack that is not below the op's stack is an error
   (copy it off first). A stack is its handlers in push order: the same handlers pushed
   again after a pop, or pushed on another thread, make the same stack, which takes the
   tensors made under the earlier scopes. Outputs of ops run under at least one handler are handler
   tensors: read a value by copying it to a physical device,
   TFE_TensorHandleCopyToDevice(t, ctx, "/job:localhost/replica:0/task:0/device:CPU:0",
   status), which runs every level's copy_off hook, then TFE_TensorHandleResolve.

   Handler hooks run as handler.h describes, with one difference: there is no GIL, so
   every hook may run without one (which handler.h already requires them to tolerate).
   Function replay (tf.function) is a Python feature: a function call op under a C scope
   is executed by the handlers like any op.

   Versioning: TFOH_C_API_VERSION is the version of this header. TFOH_C_ApiVersion()
   returns the library's; TFOH_C_DispatcherOptions carries the caller's, and the library
   refuses a version it does not know. Functions are only ever added; a struct's fields
   are only ever appended (struct_size tells which the caller has).
   - Version 1: the functions below.

   Contracts common to every function (stated per function where they differ):
   - Status: a function that takes a TF_Status reports every failure there, with a
     message naming what failed; it never aborts or throws. `status` must not be NULL.
     Functions without one cannot fail. On failure, pointer results are NULL and
     nothing is owned by the caller.
   - Threading: every function may be called from any thread, concurrently. Scopes are
     per thread (as Python's `with` scopes): a scope pushed on one thread does not
     affect ops another thread runs. Handler hooks may run on several threads at once.
   - Ownership: objects returned by a `New`/`Register` function are the caller's and
     are released with the matching `Delete`; libraries are never unloaded and are
     owned by the runtime; strings returned are borrowed (valid as long as the object
     they came from). Arguments are borrowed for the call.
   - Context lifetime: a dispatcher and every handler of it belong to one TFE_Context.
     After TFE_DeleteContext the objects stay valid to delete and to query, and every
     function that would use the context fails with TF_FAILED_PRECONDITION.
*/
#ifndef TF_OPHANDLERS_C_API_H_
#define TF_OPHANDLERS_C_API_H_

#include <stddef.h>

#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/tf_buffer.h"
#include "tensorflow/c/tf_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TFOH_C_API_VERSION 1

#if defined(_WIN32)
#define TFOH_C_EXPORT __declspec(dllexport)
#else
#define TFOH_C_EXPORT __attribute__((visibility("default")))
#endif

// The handler runtime registered on one TFE_Context as a custom device.
typedef struct TFOH_C_Dispatcher TFOH_C_Dispatcher;
// A loaded handler library: its registered handler types.
typedef struct TFOH_C_Library TFOH_C_Library;
// A handler instance (its state, created by its type's `create` hook).
typedef struct TFOH_C_Handler TFOH_C_Handler;

// Options of TFOH_C_RegisterDispatcher. Zero-fill, then set api_version and struct_size.
typedef struct TFOH_C_DispatcherOptions {
  int api_version;     // TFOH_C_API_VERSION of the caller.
  size_t struct_size;  // sizeof(TFOH_C_DispatcherOptions) of the caller.
  // The custom device's full name (NULL: TFOH_C_DEFAULT_DEVICE). Must name no device of
  // the context yet, and be a full name (/job:.../replica:.../task:.../device:TYPE:N).
  const char* device_name;
  // Where ops run below the last handler (NULL: TFOH_C_DEFAULT_PHYSICAL_DEVICE), unless
  // the op itself requested another (physical) device.
  const char* physical_device;
} TFOH_C_DispatcherOptions;

#define TFOH_C_DEFAULT_DEVICE "/job:localhost/replica:0/task:0/device:OPHANDLER:0"
#define TFOH_C_DEFAULT_PHYSICAL_DEVICE "/job:localhost/replica:0/task:0/device:CPU:0"

// The TFOH_C_API_VERSION the library was built with. Never fails.
TFOH_C_EXPORT extern int TFOH_C_ApiVersion(void);

// Registers the dispatcher device on `ctx` (borrowed; must outlive every use of the
// dispatcher other than Delete and Query, see "Context lifetime" above). `options` may
// be NULL (defaults); else its api_version must be one this library knows (1 ..
// TFOH_C_ApiVersion(); otherwise TF_FAILED_PRECONDITION) and its struct_size at least
// that of version 1 (otherwise TF_INVALID_ARGUMENT). Fails as TFE_RegisterCustomDevice
// does (e.g. the name is taken). Returns a new dispatcher the caller owns (deleting it
// does not unregister the device: TensorFlow cannot; handlers and handler tensors keep
// working), or NULL with `status` set. A context gets one dispatcher per device name.
TFOH_C_EXPORT extern TFOH_C_Dispatcher* TFOH_C_RegisterDispatcher(
    TFE_Context* ctx, const TFOH_C_DispatcherOptions* options, TF_Status* status);

// Releases the caller's dispatcher object. Handlers made from it keep what they need.
// NULL is allowed. Never fails.
TFOH_C_EXPORT extern void TFOH_C_DeleteDispatcher(TFOH_C_Dispatcher* dispatcher);

// The dispatcher device's full name: pass it to TFE_OpSetDevice to run an op under the
// calling thread's scopes. Borrowed, valid while `dispatcher` is. Never fails.
TFOH_C_EXPORT extern const char* TFOH_C_DispatcherDeviceName(const TFOH_C_Dispatcher* dispatcher);

// Loads the handler library at `path` (dlopen) and runs its TFOH_InitHandlerLibrary.
// Fails with TF_NOT_FOUND when the file cannot be loaded (dlerror's text), with
// TF_INVALID_ARGUMENT when it does not export TFOH_InitHandlerLibrary, and with the init
// function's status otherwise (e.g. a type of an unknown handler ABI version:
// TF_INVALID_ARGUMENT naming the version). Returns the library, owned by the runtime
// and valid for the process (libraries are never unloaded; loading one path twice
// returns the same library), or NULL with `status` set.
TFOH_C_EXPORT extern const TFOH_C_Library* TFOH_C_LoadHandlerLibrary(const char* path,
                                                                     TF_Status* status);

// The package's own handlers, built into this library: "PassThrough" (forwards every op;
// no configuration) and "OpCounter" (counts executed ops by type; query "counts": lines
// "Type\tN\n", query "total": the number). Owned by the runtime, valid for the process;
// NULL with `status` set on failure.
TFOH_C_EXPORT extern const TFOH_C_Library* TFOH_C_NativeHandlers(TF_Status* status);

// The number of handler types `library` registered, and the name of type `index`
// (borrowed, valid for the process; NULL for an index out of range). Never fail.
TFOH_C_EXPORT extern int TFOH_C_LibraryNumTypes(const TFOH_C_Library* library);
TFOH_C_EXPORT extern const char* TFOH_C_LibraryTypeName(const TFOH_C_Library* library,
                                                        int index);

// Creates a handler of type `type_name` of `library` for `dispatcher`, calling the
// type's `create` hook with `config` (NULL means ""). Fails with TF_NOT_FOUND for a type
// the library does not have, TF_FAILED_PRECONDITION when the dispatcher's context is
// gone, and with the hook's status (prefixed with the type name) when `create` fails.
// Returns a new handler the caller owns (TFOH_C_DeleteHandler), or NULL.
TFOH_C_EXPORT extern TFOH_C_Handler* TFOH_C_NewHandler(TFOH_C_Dispatcher* dispatcher,
                                                       const TFOH_C_Library* library,
                                                       const char* type_name,
                                                       const char* config,
                                                       TF_Status* status);

// Releases the caller's handler. Its state lives on (and its `delete_state` hook runs
// later, on any thread) while a scope or a handler tensor still holds it: pop it first.
// NULL is allowed. Never fails.
TFOH_C_EXPORT extern void TFOH_C_DeleteHandler(TFOH_C_Handler* handler);

// Opens a scope of `handler` on the calling thread: it becomes the innermost handler
// for the thread's ops on its dispatcher, executing on the scope that was innermost
// before (a handler may be pushed more than once). Fails with TF_FAILED_PRECONDITION
// when the handler's context is gone. The scope holds the handler until popped.
TFOH_C_EXPORT extern void TFOH_C_PushHandler(TFOH_C_Handler* handler, TF_Status* status);

// Closes the calling thread's innermost scope, which must be `handler`'s: otherwise
// fails with TF_FAILED_PRECONDITION naming both (no scope of `handler` open on the
// thread, or another handler's scope is innermost) and changes nothing. Handler tensors
// made inside the scope stay valid after it (later ops on them run on their stack, see
// above). Fails with TF_FAILED_PRECONDITION when the handler's context is gone.
TFOH_C_EXPORT extern void TFOH_C_PopHandler(TFOH_C_Handler* handler, TF_Status* status);

// Reads the handler's state through its type's `query` hook (e.g. OpCounter's
// "counts"): the answer is written into `out` (allocated by the caller with
// TF_NewBuffer; its previous content is released first). Fails with TF_UNIMPLEMENTED
// when the type has no query hook and with the hook's status (e.g. TF_INVALID_ARGUMENT
// for an unknown key). Works after the context is gone (the state is the handler's).
TFOH_C_EXPORT extern void TFOH_C_HandlerQuery(const TFOH_C_Handler* handler, const char* key,
                                              TF_Buffer* out, TF_Status* status);

// The handler's debug string (its `debug_string` hook, or "<TypeName>()") written into
// `out` (as TFOH_C_HandlerQuery). Never fails.
TFOH_C_EXPORT extern void TFOH_C_HandlerDebugString(const TFOH_C_Handler* handler,
                                                    TF_Buffer* out);

// Whether `tensor` is a handler tensor of `dispatcher` (an output of an op run under a
// handler; read its value by copying it to a physical device). Never fails.
TFOH_C_EXPORT extern int TFOH_C_IsHandlerTensor(const TFOH_C_Dispatcher* dispatcher,
                                                TFE_TensorHandle* tensor);

#ifdef __cplusplus
}
#endif

#endif  // TF_OPHANDLERS_C_API_H_
