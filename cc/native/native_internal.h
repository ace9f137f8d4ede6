/* tf-ophandlers: what the pieces of the native-handler implementation share
   (native_library.cc, native_type.cc, native_execute.cc); private to them (and to
   the fast_*.cc files for the shared runtime state), the interface for the rest of the
   extension is native.h.

   The opaque types of include/tf_ophandlers/handler.h are defined here. Everything else
   lives in namespace tf_ophandlers::native_internal. Unless a comment says otherwise,
   every function needs the GIL held, and "new"/"borrowed" describe references.
*/
#ifndef TF_OPHANDLERS_NATIVE_INTERNAL_H_
#define TF_OPHANDLERS_NATIVE_INTERNAL_H_

#include <Python.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "native/native.h"
#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/tf_status.h"
#include "tf_ophandlers/handler.h"

// ---- the opaque types of handler.h ------------------------------------------------------

struct TFOH_Tensor {
  std::atomic<int> refs;
  TFE_TensorHandle* h;  // owned iff py == nullptr; null for a symbolic tensor
  PyObject* py;         // owned; may be null (a tensor the C path made)
  // ABI 3 handler data: `wrapper` (owned, may be null) is the _C.NativeValue this tensor
  // was read from or became (PyOf); `data`/`del` (owned while has_data) were set by
  // tensor_set_data and move into the NativeValue PyOf makes.
  PyObject* wrapper = nullptr;
  void* data = nullptr;
  void (*del)(void*) = nullptr;
  bool has_data = false;
};

struct TFOH_Op {
  const TFE_Op* tfe;  // attribute source, borrowed (owned through `built` for a built op)
  PyObject* py;       // the Python Op (tf_ophandlers.Op), borrowed; may be null
  const char* type;
  const char* device;
  int num_outputs;    // -1: unknown (a built op: read from its OpDef at execute_next)
  TFE_Op* built = nullptr;  // ABI 3 op_new: the op's own TFE_Op (== tfe), owned
};

struct TFOH_Context {
  PyObject* stack;  // the handler's stack, borrowed
  PyObject* next;   // its next stack, borrowed
  bool eager;       // no function is being replayed
  PyObject* device; // state.device (str), borrowed
  // The no-GIL path (NativeNoGilExecute): the hook runs without the GIL; execute_next
  // then uses `device_utf8` (state.device read at the op's start) and takes the GIL for
  // anything but a physical execution.
  bool gil = true;
  const char* device_utf8 = nullptr;
  // The thread running the hook: execute_next is refused on any other (it reads and sets
  // that thread's handler state, builds into its graph while a function is replayed, and
  // relies on the GIL discipline of the hook's call; handler.h).
  std::thread::id thread = std::this_thread::get_id();
};

struct TFOH_Library {
  std::vector<void*>* types;  // tf_ophandlers::TypeRecord*
};

namespace tf_ophandlers {
namespace native_internal {

struct TypeRecord {
  TFOH_HandlerType hooks;  // zero-filled past the library's struct_size
  std::string name;
  std::string doc;
};

struct NativeHandlerObject {
  PyObject_HEAD
  TypeRecord* type;  // never freed (libraries are never unloaded)
  void* state;       // owned: delete_state on dealloc
};

// The runtime state shared with the fast path (fast_internal.h), set by SetSharedState from
// both native_setup (tf_ophandlers.core.native at import) and fast_setup (core/stack.py at
// import), which pass the same objects. Strong references; null until then (the C paths
// then decline: NativeStackRun and TryFastExecute return false). Defined in
// native_library.cc.
extern PyObject* g_state;     // tf_ophandlers.core.state.state (thread-local object)
extern PyObject* g_physical;  // tf_ophandlers.core.stack.PHYSICAL
extern PyObject* s_mode;      // interned attribute names
extern PyObject* s_current;
extern PyObject* s_handler;
extern PyObject* s_next;
extern PyObject* s_device;
extern PyObject* s_execute;
extern PyObject* s_frames;   // "frames" (state.frames: the hook frames; fast_hook.cc, handlers/)

// Sets g_state and g_physical (new references to `state`, `physical`; the previous ones
// released) and interns the names above, each once per process (a repeated call takes no
// further references). Returns false with a Python exception set when interning fails.
// GIL: held.
bool SetSharedState(PyObject* state, PyObject* physical);

// The value of attribute `name` (one of the interned names above) of `state` on this
// thread, borrowed: valid until Python code next runs on this thread (which may rebind
// the attribute). Read from the thread's instance dict of `state` (a threading.local),
// which is looked up once per thread and then kept (one reference per thread that ran
// an op, not released at thread exit: freeing it there would need the GIL). Null when
// the setup has not run or the attribute is missing (no Python exception left set).
// GIL: held.
PyObject* StateGet(PyObject* name);

// StateGet for the no-GIL path (NativeNoGilExecute): the same borrowed value, read without
// the GIL from this thread's dict of `state` (only this thread changes it, and it is
// running C code here). Null when this thread's dict is not known yet (StateGet, with the
// GIL, looks it up on first use) or the attribute is missing; never sets a Python
// exception and never touches the thread state. GIL: not needed.
PyObject* StateGetNoGil(PyObject* name);

// Interns `text` into `*slot` unless the slot already holds a name (one reference per
// process, never released). Returns false with a Python exception set on failure.
// GIL: held.
bool InternOnce(PyObject** slot, const char* text);

// A new EagerTensor sharing `h`'s tensor (its own handle; `h` stays borrowed), or null
// with a RuntimeError (TensorFlow's message) set. Used wherever C hands a tensor it
// borrows to Python: the fast path's hook inputs, PyOf. GIL: held.
PyObject* EagerTensorSharing(TFE_TensorHandle* h);

// ---- handler data (native_value.cc) ----------------------------------------------------

// A _C.NativeValue: a C/C++ handler's representation carrying data of its own.
struct NativeValueObject {
  PyObject_HEAD
  PyObject* tensor;  // the tensor of the next stack; owned
  void* data;        // the handler's; `del(data)` on dealloc (GIL held)
  void (*del)(void*);
};
extern PyTypeObject NativeValueType;

// Readies NativeValueType; false with a Python exception set. GIL: held.
bool ReadyNativeValueType();

// A new NativeValue of `tensor` (borrowed; the value takes a reference) owning `data`
// (deleted with `del` even when this fails: null with a Python exception set). GIL: held.
PyObject* NewNativeValue(PyObject* tensor, void* data, void (*del)(void*));

// handler.h's tensor_set_data and tensor_data. GIL: held.
void ApiTensorSetData(TFOH_Tensor* t, void* data, void (*del)(void*));
void* ApiTensorData(const TFOH_Tensor* t);

// ---- TFOH_Tensor (native_execute.cc) ------------------------------------------------------

// A new tensor (one reference) owning the handle `owned`. Never fails. GIL: not needed.
TFOH_Tensor* TensorFromHandle(TFE_TensorHandle* owned);

// A tensor for a Python object (an EagerTensor or a symbolic tensor); takes a new
// reference to `py`. Never fails. GIL: held.
TFOH_Tensor* TensorFromPy(PyObject* py);

// Drops one reference to `t` (null allowed); the last one releases its Python object or
// handle. GIL: held when `t` may hold a Python object.
void Unref(TFOH_Tensor* t);

// A new Python object for `t` (its own, or a new EagerTensor sharing its handle), or
// null with a Python exception set. `t` stays borrowed. GIL: held.
PyObject* PyOf(TFOH_Tensor* t);

// PyOf for a tensor about to be released: when this is its last reference and it owns
// a handle, the new EagerTensor takes that handle (no copy; `t` keeps only a reference
// to the EagerTensor, released by its Unref). GIL: held.
PyObject* PyOfLast(TFOH_Tensor* t);

// ---- the runtime API (native_library.cc; ApiExecuteNext in native_execute.cc) --------------

// The TFOH_RuntimeApi handed to every library's init function.
extern const TFOH_RuntimeApi kApi;

// `t`'s dtype (for a symbolic tensor read from Python; 0 if that fails, no exception
// left set). GIL: held.
TF_DataType ApiTensorDtype(const TFOH_Tensor* t);

// handler.h's ABI version 3 op building (native_build.cc): op_new, op_delete and the
// attribute setters of kApi. GIL: held (op_delete: not needed).
TFOH_Op* ApiOpNew(TFOH_Context* ctx, const char* type, TF_Status* status);
void ApiOpDelete(TFOH_Op* op);
void ApiOpSetAttrType(TFOH_Op* op, const char* name, TF_DataType value);
void ApiOpSetAttrInt(TFOH_Op* op, const char* name, int64_t value);
void ApiOpSetAttrFloat(TFOH_Op* op, const char* name, float value);
void ApiOpSetAttrBool(TFOH_Op* op, const char* name, unsigned char value);
void ApiOpSetAttrTensor(TFOH_Op* op, const char* name, TF_Tensor* value, TF_Status* status);

// For a built op (`op->built`): a copy of `*op` with num_outputs read from its OpDef and
// attributes into `*resolved`, which execute_next then runs; false with `status` set
// (TF_INVALID_ARGUMENT naming the op) when they cannot be known. For another op: true,
// `*resolved` = `*op`. GIL: not needed.
bool ResolveBuiltOp(const TFOH_Op* op, TFOH_Op* resolved, TF_Status* status);

// handler.h's execute_next: runs `op` on ctx->next. Failures go to `status`; on success
// `outputs` holds `*num_outputs` new tensors. GIL: held; released around TFE_Execute.
void ApiExecuteNext(TFOH_Context* ctx, const TFOH_Op* op, int n_in, TFOH_Tensor* const* in,
                    int* num_outputs, TFOH_Tensor** outputs, TF_Status* status);

// ---- the execute path (native_execute.cc) ---------------------------------------------------

// Whether `type` is one of the copy ops or _EagerConst (never run by a native handler in
// C). Never fails. GIL: not needed.
bool IsCopyOrConst(const char* type);

// Runs `op` on `stack` in C when its handler `self` is native (`next`: the stack's next
// stack; both borrowed) and every input (`in`, borrowed handles) is already on it, or is
// physical and taken as it is (the next stack is PHYSICAL and the type has no copy_on).
// Returns false when not (nothing done, `status` untouched); true when it ran: `status`
// tells whether it succeeded, and on success `outputs` holds `*num_outputs` new handles
// (handler tensors of `stack`, or tensors that left the stacks below).
// `op->num_outputs` < 0: read from the OpDef. GIL: held.
bool NativeStackExecute(PyObject* stack, NativeHandlerObject* self, PyObject* next,
                        const TFOH_Op* op, int n_in, TFE_TensorHandle** in, int* num_outputs,
                        TFE_TensorHandle** outputs, TF_Status* status);

// Runs the execute hook and checks what it returned against the op (`want`: the OpDef's
// output dtypes, may be null). On success `outs` holds the new output tensors. Returns
// false with `status` set (prefixed with the handler and op). `ins` stay borrowed. GIL: held.
bool RunExecute(NativeHandlerObject* self, TFOH_Context* ctx, TFOH_Op* op,
                absl::InlinedVector<TFOH_Tensor*, 4>& ins,
                absl::InlinedVector<TFOH_Tensor*, 4>& outs,
                const absl::InlinedVector<TF_DataType, 4>* want,
                TF_Status* status);

// NativeStackExecute's wrap: the handler tensors of `stack` for the hook's outputs `outs`
// (checked against `want`), or the tensors that left the stacks below (resources, or
// outputs not on `next`). On success `outputs` holds outs.size() new handles; on failure
// it holds nothing and `status` is set. `outs` stay the caller's. GIL: held.
bool WrapNativeOutputs(PyObject* stack, NativeHandlerObject* self, PyObject* next,
                       const char* type, const absl::InlinedVector<TF_DataType, 4>& want,
                       absl::InlinedVector<TFOH_Tensor*, 4>& outs, TFE_TensorHandle** outputs,
                       TF_Status* status);

// ---- helpers (native_type.cc) ---------------------------------------------------------------

// The handler's debug_string hook's text (invalid UTF-8 replaced), or "<type name>()"
// without the hook or when it throws (then `*threw`, when given, gets the exception's
// text). Never fails. GIL: held.
std::string DebugString(NativeHandlerObject* self, std::string* threw = nullptr);

// ---- C++ exceptions escaping a hook -------------------------------------------------------
// handler.h forbids them, but one must not unwind through TensorFlow's C API or Python
// (std::terminate ends the process): every hook call goes through CallHook, which turns
// an exception into a failed status carrying an oh.HandlerError (status.h).

// Inside a catch block for a hook call of `self`: SetHandlerError with HookThrewMessage
// naming the handler (DebugString). Never throws.
void HookThrew(NativeHandlerObject* self, const char* hook, const char* op_type,
               TF_Status* status) noexcept;

// Runs `call` (one hook call) and returns its result; if the hook throws, sets `status`
// (HookThrew: names the handler, `hook` and `op_type` when not null) and returns
// `failed`. `self->type` must be set.
template <typename R, typename F>
R CallHook(NativeHandlerObject* self, const char* hook, const char* op_type, TF_Status* status,
           R failed, F&& call) noexcept {
  try {
    return call();
  } catch (...) {
    HookThrew(self, hook, op_type, status);
    return failed;
  }
}

// CallHook for a hook returning nothing.
template <typename F>
void CallVoidHook(NativeHandlerObject* self, const char* hook, const char* op_type,
                  TF_Status* status, F&& call) noexcept {
  CallHook<int>(self, hook, op_type, status, 0, [&] {
    call();
    return 0;
  });
}

// Prefixes a failed `status` with the handler, hook and op (`op_type` may be null).
// GIL: held.
void PrefixStatus(NativeHandlerObject* self, const char* hook, const char* op_type,
                  TF_Status* status);

// Raises the failed `status` as a Python exception. GIL: held.
void RaiseStatus(TF_Status* status);

// Whether `self` was initialized; false with a Python exception set otherwise. GIL: held.
bool CheckState(NativeHandlerObject* self);

// Whether `self`'s execute hook runs for ops of `type` (ABI version 4: false for every
// type when the hook is NULL; else the executes_op hook's answer, true without it). `self`
// must be initialized. Never fails. GIL: held (the executes_op hook runs with it).
bool ExecutesOp(NativeHandlerObject* self, const char* type, std::string* threw = nullptr);

}  // namespace native_internal
}  // namespace tf_ophandlers

#endif  // TF_OPHANDLERS_NATIVE_INTERNAL_H_
