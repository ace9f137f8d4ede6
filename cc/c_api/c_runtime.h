/* tf-ophandlers: the Python-free handler runtime behind include/tf_ophandlers/c_api.h
   (libtf_ophandlers_c.so); internal header. c_runtime.cc runs ops through handler stacks
   (the dispatcher device's callbacks, the TFOH_RuntimeApi handlers get); c_api.cc is
   the public C API (dispatchers, libraries, handlers, scopes).

   It shares the handler ABI (handler.h) with the Python extension _C.so but none of its
   code: _C's dispatcher keeps its stacks, scopes and handler states as Python objects
   (DESIGN.md decision 1) and takes the GIL around them, so it cannot run without an
   interpreter. This runtime keeps the same concepts as C++ objects:
   - a Handler is a handler state of a registered type (reference counted: the
     caller's TFOH_C_Handler, the stacks pushing it, and its tensors hold it);
   - a Stack is a handler over its next stack (null: the physical device); each push
     makes a new one, so stacks are compared by their handlers (SameStack), never by
     pointer;
   - a tensor of a stack is a dispatcher-device tensor handle whose Payload holds the
     stack and the handler's representation (a TFOH_Tensor of the next stack).
   Nothing here needs a lock on the per-op path except the scope stacks, which are
   thread-local.
*/
#ifndef TF_OPHANDLERS_C_RUNTIME_H_
#define TF_OPHANDLERS_C_RUNTIME_H_

#include <atomic>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/eager/c_api_experimental.h"
#include "tensorflow/c/tf_status.h"
#include "tf_ophandlers/handler.h"

// ---- the opaque types of handler.h, as this runtime defines them ---------------------------

struct TFOH_Tensor {
  std::atomic<int> refs{1};
  TFE_TensorHandle* h = nullptr;  // owned: a physical handle or a dispatcher-device handle
  void* data = nullptr;           // ABI 3 handler data (owned, `del` releases it)
  void (*del)(void*) = nullptr;
};

struct TFOH_Op {
  const TFE_Op* tfe;  // attribute source; borrowed (owned through `built` for a built op)
  const char* type;
  const char* device;
  int num_outputs;    // -1: unknown (a built op: the physical execution tells)
  TFE_Op* built = nullptr;  // ABI 3 op_new: owned
  std::string type_storage;
};

namespace tf_ophandlers {
namespace c_runtime {

struct Stack;

// One registered dispatcher device. Shared by the caller's TFOH_C_Dispatcher, the device
// (TensorFlow's device_info) and every handler of it; `alive` turns false when TensorFlow
// deletes the device (TFE_DeleteContext).
struct DispatcherState {
  uint64_t id;  // never reused: keys the thread-local scope stacks
  std::string name;
  std::string physical;
  TFE_Context* ctx;  // valid while alive
  std::atomic<bool> alive{true};
};

struct TypeRecord {
  TFOH_HandlerType hooks;  // zero-filled past the library's struct_size
  std::string name;
  std::string doc;
};

}  // namespace c_runtime
}  // namespace tf_ophandlers

struct TFOH_C_Library {
  std::string path;
  std::vector<tf_ophandlers::c_runtime::TypeRecord*> types;
};

// A handler (c_api.h's TFOH_C_Handler).
struct TFOH_C_Handler {
  std::atomic<int> refs{1};
  const tf_ophandlers::c_runtime::TypeRecord* type;
  void* state;  // owned: delete_state with the last reference
  std::shared_ptr<tf_ophandlers::c_runtime::DispatcherState> dispatcher;
};

struct TFOH_Library {
  std::vector<tf_ophandlers::c_runtime::TypeRecord*>* types;
};

struct TFOH_Context {
  tf_ophandlers::c_runtime::Stack* stack;  // the stack of the handler whose hook runs
  tf_ophandlers::c_runtime::DispatcherState* dispatcher;
  std::thread::id thread = std::this_thread::get_id();
};

namespace tf_ophandlers {
namespace c_runtime {

using Handler = TFOH_C_Handler;

struct Stack {
  std::atomic<int> refs{1};
  Handler* handler;  // one reference
  Stack* next;       // one reference; null: the physical device
};

// What a dispatcher-device handle owns.
struct Payload {
  Stack* stack;      // one reference
  TFOH_Tensor* rep;  // one reference: a tensor of stack->next
};

void HandlerRef(Handler* h);
void HandlerUnref(Handler* h);  // the last reference runs delete_state
Stack* NewStack(Handler* handler, Stack* next);  // takes new references to both
void StackRef(Stack* s);
void StackUnref(Stack* s);
void Unref(TFOH_Tensor* t);

// "<debug_string>" of the handler (its hook, or "TypeName()"); never fails.
std::string DebugString(const Handler* h);

// The payload of `h` if it is a tensor of `d`'s device, else null. Never fails.
Payload* PayloadOf(const DispatcherState* d, TFE_TensorHandle* h);

// The runtime functions handed to handler libraries.
extern const TFOH_RuntimeApi kApi;

// The registration of the dispatcher device on d->ctx (`d` held by the device until
// TensorFlow deletes it). Fails as TFE_RegisterCustomDevice.
void RegisterDevice(std::shared_ptr<DispatcherState> d, TF_Status* status);

// The calling thread's scope stack for dispatcher `id` (innermost last; each entry holds
// one Stack reference).
std::vector<Stack*>& ThreadScopes(uint64_t id);

// Runs `call` (a hook call of `h`); a C++ exception leaving it becomes a failed `status`
// naming the hook and the exception (callers prefix the handler, as for a failed hook).
template <typename F>
void GuardHook(const Handler* h, const char* hook, TF_Status* status, F&& call) noexcept {
  (void)h;
  try {
    call();
  } catch (const std::exception& e) {
    TF_SetStatus(status, TF_INTERNAL,
                 (std::string("hook ") + hook + " threw a C++ exception: " + e.what()).c_str());
  } catch (...) {
    TF_SetStatus(status, TF_INTERNAL,
                 (std::string("hook ") + hook + " threw a C++ exception").c_str());
  }
}

}  // namespace c_runtime
}  // namespace tf_ophandlers

#endif  // TF_OPHANDLERS_C_RUNTIME_H_
