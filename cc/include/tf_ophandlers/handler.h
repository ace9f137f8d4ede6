/* tf-ophandlers: the C ABI for op handlers written in C or C++ (RFC "Third-party op
   handlers and dynamic linking").

   A *handler library* is a shared library that exports one function,

     void TFOH_InitHandlerLibrary(const TFOH_RuntimeApi* api, TFOH_Library* library,
                                  TF_Status* status);

   which registers one or more handler *types* with `api->register_type`. Python loads
   it with `tf_ophandlers.load_handler_library(path)`; each registered type becomes a
   Python class (a subclass of tf_ophandlers.OpHandler) whose instances are handlers
   like any other: `with` scopes, nesting with Python handlers in any order, function
   replay, `oh.testing.check_handler`.

   The header is valid C (C99/C11) and C++: a handler library may be written in either.
   Everything that crosses this boundary is plain C: opaque handles (TFOH_Op,
   TFOH_Tensor, TFOH_Context, TFOH_Library), structs of function pointers
   (TFOH_RuntimeApi, given by the runtime; TFOH_HandlerType, given by the library) and
   TensorFlow's own C API types (TF_Status, TF_Buffer, TF_DataType, TFE_TensorHandle,
   TFE_OpAttrs). No C++ type, exception or allocator crosses it. Build a library with

     g++ -shared -fPIC $(python -c "import tf_ophandlers as oh;
         print(' '.join(oh.sysconfig.get_compile_flags()))") my_handler.cc \
         -o my_handler.so $(python -c "...get_link_flags()...")

   Versioning: both structs start with `abi_version` and `struct_size`. The runtime
   refuses a type whose abi_version it does not know; fields are only ever appended, so
   a library built against an older header (smaller struct_size) keeps working and a
   newer library checks `api->struct_size` before using a field added later. The runtime
   reads a type's fields up to the smaller of its struct_size and the size its
   abi_version defines (TFOH_HANDLER_TYPE_V1_SIZE, _V2_SIZE, _V3_SIZE): a field added in
   a later version is NULL for a type of an earlier version. A type's struct_size must
   cover the fields every version requires, `abi_version` to `execute`
   (TFOH_HANDLER_TYPE_MIN_SIZE): register_type refuses a smaller one and reads nothing
   past it (the library then fails to load with that error).
   - Version 1: the hooks up to `function_input_summary`.
   - Version 2: `static_value` (tf.get_static_value of a handler's tensors).
   - Version 3: building ops (TFOH_RuntimeApi `op_new` .. `op_set_attr_tensor`: a hook
     emits *other* ops on the next stack with `execute_next`, not only the op it got)
     and the `function_cache_key` hook (a replay shared between handler instances);
     handler-defined tensor state (`tensor_set_data`, `tensor_data`) and the
     `function_output` hook that rebuilds it after a function boundary.
     A version 3 library checks `api->abi_version >= 3` (or `api->struct_size`) before
     calling a version 3 runtime function.
   - Version 4: ops a handler does not execute. `execute` may be NULL (the handler
     executes no op: every op is forwarded to the next stack without a hook call), and
     the `executes_op` hook tells, per op type, whether `execute` runs for it. An op the
     handler does not execute costs a forwarding level (no TFOH_Op, TFOH_Tensor or hook
     call is made for it), like a Python handler's `handles_ops`.
   The runtime accepts types of versions 1 to 4.

   A handler's *representation* of a tensor is a tensor of the next stack, plus (ABI
   version 3) data of the handler's own attached with `tensor_set_data`: the runtime
   keeps both in the handler tensor it creates for each output. The handler sees it as a
   TFOH_Tensor (`tensor_data` reads the data).

   Contracts common to every function below (stated per function where they differ):
   - GIL: the runtime calls every hook of a TFOH_HandlerType on the thread that runs the
     op. Hooks must not call the Python C API, must not rely on the GIL being held and
     must not release it: `execute` of a handler whose next stack is the physical one
     runs without the GIL for eager ops whose inputs are plain tensors (the runtime takes
     it only to wrap outputs that need a Python object: handler data, a type with shape
     hooks, the first op of a type on the thread); other hooks run holding it. The runtime functions
     hooks call (`execute_next`) release and retake the GIL where they block.
   - Threading: hooks of one handler state may run on several threads at once (two
     Python threads using one handler, with or without the GIL), so handler state must
     be thread-safe. The runtime functions that take a TFOH_Context (`execute_next`,
     `op_new`) must be called on the thread that runs the hook the context was given to,
     during that call: the context stands for that thread's handler state (and, while a
     function is replayed, its graph). A hook may use worker threads for its own work,
     not to call them; `execute_next` from another thread fails with
     TF_FAILED_PRECONDITION (eagerly and in a replayed function alike).
   - Status: every failure is reported through the TF_Status argument (never by
     exceptions or abort); a hook that fails must leave its out-parameters unset and
     own nothing it was to return. The status code and message reach the Python caller
     as a tf.errors exception (prefixed with the handler and the op).
   - Exceptions: no C++ exception may leave a hook. The runtime still catches one that
     does (any type, `catch (...)`) at every hook call, so that it does not end the
     process: the call raises tf_ophandlers.HandlerError naming the handler, the hook,
     the op (where there is one) and the exception's what(). What the hook did before it
     threw (references taken, out-parameters written) is leaked, not released. A
     `delete_state` that throws is reported as an unraisable exception (stderr), a
     `debug_string` that throws names the handler "<name>()" in other errors.
   - Text: names, debug strings and status messages should be UTF-8; bytes that are
     not are shown as U+FFFD (the error they carry is kept).
   - Ownership: TFOH_Op and TFOH_Context are borrowed, valid only during the call they
     are passed to. TFOH_Tensor is reference counted: inputs are borrowed for the call;
     tensors a runtime function returns are new references the handler owns; tensors a
     hook returns are new references the runtime takes. A handler releases a reference
     with `api->tensor_unref` and must not keep a TFOH_Tensor beyond the hook call that
     received or created it (ABI versions 1 to 3).
*/
#ifndef TF_OPHANDLERS_HANDLER_H_
#define TF_OPHANDLERS_HANDLER_H_

#include <stddef.h>
#include <stdint.h>

// Only TensorFlow headers that are valid C (C99/C11): TF_Status, TF_Buffer, TF_DataType,
// TF_Tensor. The eager types this header mentions (TFE_TensorHandle, TFE_OpAttrs) are
// opaque and named by their struct tags below, so a C library does not need
// tensorflow/c/eager/c_api_experimental.h (which is C++ only). A C library that reads a
// tensor's value includes tensorflow/c/eager/c_api.h itself (valid C); one that reads an
// op's attributes declares TFE_OpAttrsSerialize itself (see docs/guide.md).
#include "tensorflow/c/tf_buffer.h"
#include "tensorflow/c/tf_datatype.h"
#include "tensorflow/c/tf_status.h"
#include "tensorflow/c/tf_tensor.h"

#ifdef __cplusplus
// Source compatibility for C++ libraries written against earlier versions of this
// header, which included TensorFlow's eager C API headers.
#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/eager/c_api_experimental.h"
extern "C" {
#endif

// TensorFlow's opaque eager types (tensorflow/c/eager/c_api.h, c_api_experimental.h),
// named by struct tag: `struct TFE_TensorHandle*` is the same type as those headers'
// `TFE_TensorHandle*` (no typedef here, so including them too is valid C99).
struct TFE_TensorHandle;
struct TFE_OpAttrs;

#define TFOH_ABI_VERSION 4

#if defined(_WIN32)
#define TFOH_EXPORT __declspec(dllexport)
#else
#define TFOH_EXPORT __attribute__((visibility("default")))
#endif

// An op a handler is asked to execute: type, attributes, requested device, expected
// output count. Borrowed; valid during the hook call only. (ABI version 3: an op the
// handler built with `op_new` is the handler's until `op_delete`; its output count is -1
// until execute_next reads it from the OpDef.)
typedef struct TFOH_Op TFOH_Op;
// A tensor as a handler sees it (a tensor of the next stack, or of the handler's own
// stack for a hook's inputs once unwrapped). Reference counted; see Ownership above.
typedef struct TFOH_Tensor TFOH_Tensor;
// Where the running hook executes: the next stack. Borrowed; valid during the call.
typedef struct TFOH_Context TFOH_Context;
// A library being loaded (registration target). Borrowed; valid during
// TFOH_InitHandlerLibrary only.
typedef struct TFOH_Library TFOH_Library;

struct TFOH_HandlerType;

// Functions the runtime provides to handlers. The struct is owned by the runtime and
// lives as long as the process; a library may keep the pointer.
typedef struct TFOH_RuntimeApi {
  int abi_version;     // TFOH_ABI_VERSION of the runtime.
  size_t struct_size;  // sizeof(TFOH_RuntimeApi) of the runtime.

  // ---- ops (never fail, never block) ----
  // The op type, e.g. "AddV2". Borrowed: valid while `op` is.
  const char* (*op_type)(const TFOH_Op* op);
  // The device the user requested for the op ("" when none). Borrowed.
  const char* (*op_requested_device)(const TFOH_Op* op);
  // The number of flat outputs the op must produce.
  int (*op_num_outputs)(const TFOH_Op* op);
  // The op's attributes (TensorFlow's C API type; read them with TFE_OpAttrsSerialize).
  // Borrowed: valid while `op` is.
  const struct TFE_OpAttrs* (*op_attrs)(const TFOH_Op* op);

  // ---- tensors ----
  // The tensor's dtype. Never fails, never blocks.
  TF_DataType (*tensor_dtype)(const TFOH_Tensor* t);
  // Rank and axis length (-1: unknown). Do not block on pending computations. On
  // failure `status` is set and -1 returned.
  int (*tensor_num_dims)(const TFOH_Tensor* t, TF_Status* status);
  int64_t (*tensor_dim)(const TFOH_Tensor* t, int index, TF_Status* status);
  // The eager TensorFlow handle behind `t`, or NULL while a function is replayed (the
  // tensor is symbolic then). Borrowed: valid while the handler holds `t`. Reading its
  // value (TFE_TensorHandleResolve) may block and needs no GIL.
  struct TFE_TensorHandle* (*tensor_handle)(const TFOH_Tensor* t);
  // Takes / releases one reference. `tensor_unref` of the last reference frees it.
  void (*tensor_ref)(TFOH_Tensor* t);
  void (*tensor_unref)(TFOH_Tensor* t);

  // ---- execution ----
  // Executes `op` (the hook's op, or one it built: ABI version 3) on the next stack (the
  // stack below the handler whose hook got `ctx`) with `inputs` (tensors of the next
  // stack: a hook's inputs, or results of earlier execute_next calls). `*num_outputs` is
  // in: the capacity of `outputs`, out: the number written (new references). Fails
  // with `status` set (an error of a handler below, or of the TensorFlow kernel). May
  // block; releases the GIL while TensorFlow executes. Only on the thread running the
  // hook that got `ctx`, during that call (see Threading above): from another thread it
  // fails with TF_FAILED_PRECONDITION and executes nothing.
  void (*execute_next)(TFOH_Context* ctx, const TFOH_Op* op, int num_inputs,
                       TFOH_Tensor* const* inputs, int* num_outputs, TFOH_Tensor** outputs,
                       TF_Status* status);

  // ---- registration (only inside TFOH_InitHandlerLibrary) ----
  // Registers a handler type. `type` is copied except for its function pointers and
  // `type_data`, which must stay valid while the library is loaded (libraries are
  // never unloaded). Fails for an unknown abi_version, a struct_size smaller than
  // TFOH_HANDLER_TYPE_MIN_SIZE, a missing name, create or delete_state, a missing
  // execute in a type of ABI version 1 to 3, or a name registered twice in the library.
  void (*register_type)(TFOH_Library* library, const struct TFOH_HandlerType* type,
                        TF_Status* status);

  // ---- ABI version 3: building ops (present when api->abi_version >= 3) ----
  // A hook may emit ops of its own: `op_new` makes an op of a registered TensorFlow
  // `type` (e.g. "Round", "Mul", "Const"), the op_set_attr_* functions set its
  // attributes, and `execute_next(ctx, op, ...)` runs it on the next stack exactly like
  // the op the hook got (inputs: tensors of the next stack; outputs: new references).
  // Every attribute the op's OpDef has without a default must be set, the type
  // attributes too ("T": they are not inferred from the inputs), so that the number and
  // dtypes of its outputs are known before it runs; execute_next fails with
  // TF_INVALID_ARGUMENT otherwise. The op belongs to the handler: `op_delete` it (it
  // may be executed any number of times before that, also by later hook calls of the
  // same thread while the handler holds it; it is not thread-safe). Its requested
  // device is "" (the next stack places it). Creating and setting attributes never
  // block; they may be called with the GIL held from any hook that got a `ctx`.
  // `op_new` returns NULL with `status` set for an unknown type. A failed attribute
  // setter is reported by the next execute_next of the op (the setters return nothing)
  // except op_set_attr_tensor, which reports through `status`.
  TFOH_Op* (*op_new)(TFOH_Context* ctx, const char* type, TF_Status* status);
  void (*op_delete)(TFOH_Op* op);
  void (*op_set_attr_type)(TFOH_Op* op, const char* name, TF_DataType value);
  void (*op_set_attr_int)(TFOH_Op* op, const char* name, int64_t value);
  void (*op_set_attr_float)(TFOH_Op* op, const char* name, float value);
  void (*op_set_attr_bool)(TFOH_Op* op, const char* name, unsigned char value);
  // `value` stays the caller's (the op keeps its own copy), e.g. a "Const" op's "value"
  // (with "dtype"): how a handler makes a constant on the next stack.
  void (*op_set_attr_tensor)(TFOH_Op* op, const char* name, TF_Tensor* value,
                             TF_Status* status);

  // ---- ABI version 3: handler-defined tensor state ----
  // A handler's representation of a tensor may carry data of its own (e.g. the scale of a
  // quantized value, a per-tensor statistic). `tensor_set_data` attaches `data` to `t`, a
  // tensor the hook is about to return as its output (execute, copy_on,
  // function_output); the handler tensor made of it keeps the data, and whenever that
  // tensor reaches a hook of the handler again (execute's inputs, copy_off, num_dims/dim,
  // tensor_debug_string, function_input_summary, static_value) `tensor_data` returns it.
  // The runtime owns `data` from the call on and calls `delete_data(data)` (may be NULL)
  // exactly once when no tensor or value holds it any more: with the GIL held, on any
  // thread, possibly after the handler state is gone (so it must not need the state).
  // Setting data again replaces (and deletes) data set before on the same tensor.
  // `tensor_data` returns NULL for a tensor without data (a tensor of the next stack, an
  // execute_next result); the pointer is borrowed, valid while the handler holds `t`.
  // Data does not leave the handler: a resource output (left on the next stack) and the
  // value copy_off returns carry none. Across a function boundary (a replayed
  // tf.function) the data crosses only through `function_input_summary` and
  // `function_output`. Never fail, never block.
  void (*tensor_set_data)(TFOH_Tensor* t, void* data, void (*delete_data)(void* data));
  void* (*tensor_data)(const TFOH_Tensor* t);
} TFOH_RuntimeApi;

// A handler type: the hooks of RFC "Available hooks". Only `name`, `create`,
// `delete_state` and (before ABI version 4) `execute` are required; a NULL optional hook
// has the default behaviour described with it.
typedef struct TFOH_HandlerType {
  int abi_version;     // TFOH_ABI_VERSION the library was built with.
  size_t struct_size;  // sizeof(TFOH_HandlerType) of the library.
  // The Python class name (an identifier) and its docstring (may be NULL). Copied.
  const char* name;
  const char* doc;
  // Passed back to `create`. Not owned by the runtime.
  void* type_data;

  // Creates a handler state for `config` (the string the Python constructor got; "" by
  // default). Returns the state (non-NULL), or NULL with `status` set (the constructor
  // raises). The runtime holds the state until the Python handler object and every
  // tensor and stack of it are gone, then calls `delete_state` exactly once, with the
  // GIL held, on any thread.
  void* (*create)(void* type_data, const char* config, TF_Status* status);
  void (*delete_state)(void* state);

  // Execute (required before ABI version 4): produce the op's outputs from `inputs` (this
  // handler's representations: tensors of the next stack). Write at most `*num_outputs`
  // new references into `outputs` and set `*num_outputs`; the count and dtypes must match
  // the op's OpDef (the runtime checks and raises otherwise). A hook forwards an op with
  // `api->execute_next(ctx, op, num_inputs, inputs, num_outputs, outputs, status)`.
  // NULL (ABI version 4 on): the handler executes no op; the runtime forwards every op to
  // the next stack itself (inputs that are the handler's are unwrapped, outputs wrapped as
  // its tensors, other inputs go through copy_on) without calling any hook per op: the
  // cheapest pass-through. GIL: see the common contract (may run without it).
  void (*execute)(void* state, TFOH_Context* ctx, const TFOH_Op* op, int num_inputs,
                  TFOH_Tensor* const* inputs, int* num_outputs, TFOH_Tensor** outputs,
                  TF_Status* status);

  // CopyOn (optional): the representation of `tensor`, a tensor already moved onto the
  // next stack. Returns a new reference. NULL hook: the tensor itself.
  TFOH_Tensor* (*copy_on)(void* state, TFOH_Context* ctx, TFOH_Tensor* tensor,
                          TF_Status* status);
  // CopyOff (optional): a tensor of the next stack for representation `value`, on its
  // way to physical `device` (may be ""). Returns a new reference. Fail (e.g.
  // TF_FAILED_PRECONDITION) to refuse copies off this handler. NULL hook: the value.
  TFOH_Tensor* (*copy_off)(void* state, TFOH_Context* ctx, TFOH_Tensor* value,
                           const char* device, TF_Status* status);

  // Shape (optional): rank and axis length of this handler's tensor whose
  // representation is `value`, answered without blocking (-1: unknown). Called by
  // TensorFlow's shape accessors. NULL hooks: the representation's own shape, read
  // without the GIL.
  int (*num_dims)(void* state, const TFOH_Tensor* value, TF_Status* status);
  int64_t (*dim)(void* state, const TFOH_Tensor* value, int index, TF_Status* status);

  // Debug strings (optional): write UTF-8 text into `out` (TF_Buffer owned by the
  // runtime; set data/length/data_deallocator, or use a buffer from
  // TF_NewBufferFromString's content). `debug_string` names the handler in errors
  // (NULL: "<name>()"); `tensor_debug_string` is repr() of its tensors (NULL: the
  // representation's value as TensorFlow shows it; these handlers are transparent).
  void (*debug_string)(void* state, TF_Buffer* out);
  void (*tensor_debug_string)(void* state, const TFOH_Tensor* value, TF_Buffer* out,
                              TF_Status* status);

  // Query (optional): a handler-defined read-only request `key` (e.g. "counts"), its
  // answer written to `out` as bytes; exposed in Python as `handler.query(key)`. Fails
  // with TF_INVALID_ARGUMENT for an unknown key.
  void (*query)(void* state, const char* key, TF_Buffer* out, TF_Status* status);

  // Function replay (optional): a summary of how a representation crosses a function
  // boundary, written to `out` (part of the replay cache key; NULL hook: an empty
  // summary, which suits a tensor of the next stack; the representation itself is what
  // crosses; its data, ABI version 3, only through this summary and `function_output`).
  // Function replay is otherwise transparent to handlers: their `execute` is called for
  // each op of a replayed function, with symbolic tensors (tensor_handle returns NULL)
  // that they pass to execute_next.
  void (*function_input_summary)(void* state, const TFOH_Tensor* value, TF_Buffer* out,
                                 TF_Status* status);

  // ---- ABI version 2 (read only for a type whose abi_version is 2 or more) ----

  // StaticValue (optional): the value of this handler's tensor whose representation is
  // `value`, when it is known without running anything (tf.get_static_value; TensorFlow's
  // gradient functions use it to short-circuit, e.g. a parallel handler whose components
  // are all equal). Known: set `*out` to a new TF_Tensor of the tensor's dtype and a
  // shape compatible with its shape (the runtime takes it; it checks both and raises
  // otherwise) and return 1. Unknown: return 0 and leave `*out` unset
  // (tf.get_static_value returns None). Must not block on pending computations or
  // execute ops; `value` may be symbolic (api->tensor_handle returns NULL). On failure
  // set `status` (the Python caller raises; the return value is ignored). NULL hook:
  // the representation's own static value (tf.get_static_value of it).
  int (*static_value)(void* state, const TFOH_Tensor* value, TF_Tensor** out,
                      TF_Status* status);

  // ---- ABI version 3 (read only for a type whose abi_version is 3 or more) ----

  // FunctionCacheKey (optional): what identifies this handler in the function replay
  // cache (with its inputs' function_input_summary), written to `out` as bytes. Two
  // handlers of the type with equal keys share replays: a handler opened afresh per
  // training step (`with Handler():` per step) replays a tf.function once, not once per
  // step. Return a key that captures everything the hooks' behaviour inside a replay
  // depends on (e.g. the config). NULL hook: the handler instance itself is the key (a
  // new handler replays again and its execute sees the function's ops). Must not block
  // or execute ops. On failure set `status` (the call raises).
  void (*function_cache_key)(void* state, TF_Buffer* out, TF_Status* status);

  // FunctionOutput (optional): the representation rebuilt on the other side of a function
  // boundary from the `summary` (`summary_length` bytes; what function_input_summary
  // wrote for the value, empty without that hook) and `tensor` (the tensor of the next
  // stack that crossed: symbolic inside a replay, the replayed call's result outside).
  // Returns a new reference: typically `tensor` itself (api->tensor_ref) with its data
  // set again from the summary (api->tensor_set_data). Must not execute ops. NULL hook:
  // the tensor itself, without data. On failure set `status` (the call raises).
  TFOH_Tensor* (*function_output)(void* state, const char* summary, size_t summary_length,
                                  TFOH_Tensor* tensor, TF_Status* status);

  // ---- ABI version 4 (read only for a type whose abi_version is 4 or more) ----

  // ExecutesOp (optional): whether `execute` runs for ops of type `op_type` (nonzero) or
  // the runtime forwards them to the next stack without a hook call (0), as a Python
  // handler's `handles_ops`. The answer must depend only on `state` and `op_type`: the
  // runtime asks once per (handler stack, op type) and caches it, so a further level that
  // does not execute an op costs no per-op hook call. Copy ops (CopyOn, CopyOff, ...) are
  // never asked. Called with the GIL held, on the thread that runs the op; must not
  // block, fail or execute ops. `op_type` is borrowed for the call. NULL hook: `execute`
  // runs for every op (or for none when `execute` is NULL). A type with this hook runs
  // its executed ops with the GIL held (the no-GIL path of execute is not taken for it).
  int (*executes_op)(void* state, const char* op_type);
} TFOH_HandlerType;

// The smallest struct_size register_type accepts (any ABI version): the fields every
// version requires, abi_version .. execute.
#define TFOH_HANDLER_TYPE_MIN_SIZE offsetof(TFOH_HandlerType, copy_on)
// sizeof(TFOH_HandlerType) of ABI version 1: what a version 1 type's struct_size is.
#define TFOH_HANDLER_TYPE_V1_SIZE offsetof(TFOH_HandlerType, static_value)
// sizeof(TFOH_HandlerType) of ABI version 2.
#define TFOH_HANDLER_TYPE_V2_SIZE offsetof(TFOH_HandlerType, function_cache_key)
// sizeof(TFOH_HandlerType) of ABI version 3.
#define TFOH_HANDLER_TYPE_V3_SIZE offsetof(TFOH_HandlerType, executes_op)

// The entry point every handler library exports (looked up by this name). Called once,
// with the GIL held, by tf_ophandlers.load_handler_library. `api` lives for the process;
// `library` only during the call. Registers the library's types; on failure sets
// `status` (the load raises with its message).
typedef void (*TFOH_InitHandlerLibraryFn)(const TFOH_RuntimeApi* api, TFOH_Library* library,
                                          TF_Status* status);
#define TFOH_INIT_HANDLER_LIBRARY_SYMBOL "TFOH_InitHandlerLibrary"

#ifdef __cplusplus
}
#endif

#endif  // TF_OPHANDLERS_HANDLER_H_
