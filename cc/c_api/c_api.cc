// tf-ophandlers: the public C API (include/tf_ophandlers/c_api.h): dispatchers, handler
// libraries, handlers and scopes, over the Python-free runtime of c_runtime.cc.
#include "tf_ophandlers/c_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "c_api/c_runtime.h"

using tf_ophandlers::c_runtime::DispatcherState;
using tf_ophandlers::c_runtime::Handler;
using tf_ophandlers::c_runtime::Stack;
using tf_ophandlers::c_runtime::TypeRecord;

// The package's own handlers (native_handlers.cc compiled into this library under this
// name: c_native_handlers.cc).
extern "C" void TFOH_C_InitNativeHandlers(const TFOH_RuntimeApi* api, TFOH_Library* library,
                                          TF_Status* status);

struct TFOH_C_Dispatcher {
  std::shared_ptr<DispatcherState> state;
};

namespace {

std::atomic<uint64_t> g_next_dispatcher{1};

// Loaded libraries by path (never unloaded); guarded by g_libraries_mu, also while a
// library's init function runs, so that two threads loading one path load it once.
std::mutex g_libraries_mu;
std::map<std::string, TFOH_C_Library*>& Libraries() {
  static auto* libraries = new std::map<std::string, TFOH_C_Library*>();
  return *libraries;
}

bool ContextGone(const DispatcherState& d, const char* what, const std::string& who,
                 TF_Status* status) {
  if (d.alive.load()) return false;
  TF_SetStatus(status, TF_FAILED_PRECONDITION,
               ("tf_ophandlers: " + std::string(what) + " " + who + ": the TFE_Context of its dispatcher device " +
                d.name + " was deleted")
                   .c_str());
  return true;
}

// Runs a library's init function into a new TFOH_C_Library; null with `status` set.
TFOH_C_Library* InitLibrary(const std::string& path, TFOH_InitHandlerLibraryFn init,
                            TF_Status* status) {
  auto* lib = new TFOH_C_Library();
  lib->path = path;
  TFOH_Library target{&lib->types};
  try {
    init(&tf_ophandlers::c_runtime::kApi, &target, status);
  } catch (...) {
    TF_SetStatus(status, TF_INTERNAL, "the init function threw a C++ exception");
  }
  if (TF_GetCode(status) != TF_OK) {
    // Types registered before the failure stay allocated: their hooks may point into the
    // library, which stays loaded.
    std::string m = "tf_ophandlers: cannot load handler library " + path + ": " +
                    TF_Message(status);
    TF_SetStatus(status, TF_GetCode(status), m.c_str());
    delete lib;
    return nullptr;
  }
  return lib;
}

void SetBuffer(TF_Buffer* out, const std::string& text) {
  if (out->data_deallocator != nullptr) out->data_deallocator(const_cast<void*>(out->data), out->length);
  void* data = std::malloc(text.size() + 1);
  std::memcpy(data, text.c_str(), text.size() + 1);
  out->data = data;
  out->length = text.size();
  out->data_deallocator = [](void* d, size_t) { std::free(d); };
}

}  // namespace

extern "C" {

int TFOH_C_ApiVersion(void) { return TFOH_C_API_VERSION; }

TFOH_C_Dispatcher* TFOH_C_RegisterDispatcher(TFE_Context* ctx,
                                             const TFOH_C_DispatcherOptions* options,
                                             TF_Status* status) {
  const char* device = TFOH_C_DEFAULT_DEVICE;
  const char* physical = TFOH_C_DEFAULT_PHYSICAL_DEVICE;
  if (options != nullptr) {
    if (options->api_version < 1 || options->api_version > TFOH_C_API_VERSION) {
      TF_SetStatus(status, TF_FAILED_PRECONDITION,
                   ("tf_ophandlers: TFOH_C_RegisterDispatcher: C API version " +
                    std::to_string(options->api_version) + " is unknown to this library "
                    "(it knows versions 1 to " + std::to_string(TFOH_C_API_VERSION) +
                    "); build against this package's tf_ophandlers/c_api.h")
                       .c_str());
      return nullptr;
    }
    if (options->struct_size < sizeof(TFOH_C_DispatcherOptions)) {
      TF_SetStatus(status, TF_INVALID_ARGUMENT,
                   "tf_ophandlers: TFOH_C_RegisterDispatcher: options.struct_size is smaller "
                   "than version 1's TFOH_C_DispatcherOptions; set it to "
                   "sizeof(TFOH_C_DispatcherOptions)");
      return nullptr;
    }
    if (options->device_name != nullptr) device = options->device_name;
    if (options->physical_device != nullptr) physical = options->physical_device;
  }
  if (ctx == nullptr) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT, "tf_ophandlers: TFOH_C_RegisterDispatcher: null context");
    return nullptr;
  }
  auto state = std::make_shared<DispatcherState>();
  state->id = g_next_dispatcher.fetch_add(1);
  state->name = device;
  state->physical = physical;
  state->ctx = ctx;
  tf_ophandlers::c_runtime::RegisterDevice(state, status);
  if (TF_GetCode(status) != TF_OK) {
    std::string m = std::string("tf_ophandlers: cannot register the dispatcher device ") +
                    device + ": " + TF_Message(status);
    TF_SetStatus(status, TF_GetCode(status), m.c_str());
    return nullptr;
  }
  return new TFOH_C_Dispatcher{std::move(state)};
}

void TFOH_C_DeleteDispatcher(TFOH_C_Dispatcher* dispatcher) { delete dispatcher; }

const char* TFOH_C_DispatcherDeviceName(const TFOH_C_Dispatcher* dispatcher) {
  return dispatcher->state->name.c_str();
}

const TFOH_C_Library* TFOH_C_LoadHandlerLibrary(const char* path, TF_Status* status) {
  if (path == nullptr) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT, "tf_ophandlers: TFOH_C_LoadHandlerLibrary: null path");
    return nullptr;
  }
  std::lock_guard<std::mutex> l(g_libraries_mu);
  auto it = Libraries().find(path);
  if (it != Libraries().end()) return it->second;
  void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* e = dlerror();
    TF_SetStatus(status, TF_NOT_FOUND,
                 (std::string("tf_ophandlers: cannot load handler library ") + path + ": " +
                  (e ? e : "unknown error"))
                     .c_str());
    return nullptr;
  }
  auto init = reinterpret_cast<TFOH_InitHandlerLibraryFn>(
      dlsym(handle, TFOH_INIT_HANDLER_LIBRARY_SYMBOL));
  if (init == nullptr) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 (std::string("tf_ophandlers: ") + path + " is not a handler library (it does "
                  "not export " TFOH_INIT_HANDLER_LIBRARY_SYMBOL ")")
                     .c_str());
    return nullptr;  // stays loaded, as a failed init's library does
  }
  TFOH_C_Library* lib = InitLibrary(path, init, status);
  if (lib != nullptr) Libraries()[path] = lib;
  return lib;
}

const TFOH_C_Library* TFOH_C_NativeHandlers(TF_Status* status) {
  static std::once_flag once;
  static TFOH_C_Library* lib = nullptr;
  static TF_Code code = TF_OK;
  static std::string message;
  std::call_once(once, [] {
    TF_Status* s = TF_NewStatus();
    lib = InitLibrary("<built-in native handlers>", TFOH_C_InitNativeHandlers, s);
    code = TF_GetCode(s);
    message = TF_Message(s);
    TF_DeleteStatus(s);
  });
  if (lib == nullptr) TF_SetStatus(status, code, message.c_str());
  return lib;
}

int TFOH_C_LibraryNumTypes(const TFOH_C_Library* library) {
  return static_cast<int>(library->types.size());
}

const char* TFOH_C_LibraryTypeName(const TFOH_C_Library* library, int index) {
  if (index < 0 || index >= static_cast<int>(library->types.size())) return nullptr;
  return library->types[index]->name.c_str();
}

TFOH_C_Handler* TFOH_C_NewHandler(TFOH_C_Dispatcher* dispatcher, const TFOH_C_Library* library,
                                  const char* type_name, const char* config, TF_Status* status) {
  if (dispatcher == nullptr || library == nullptr || type_name == nullptr) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 "tf_ophandlers: TFOH_C_NewHandler: null dispatcher, library or type name");
    return nullptr;
  }
  const TypeRecord* type = nullptr;
  std::string known;
  for (const TypeRecord* t : library->types) {
    if (t->name == type_name) type = t;
    known += (known.empty() ? "" : ", ") + t->name;
  }
  if (type == nullptr) {
    TF_SetStatus(status, TF_NOT_FOUND,
                 ("tf_ophandlers: handler library " + library->path + " has no type " +
                  type_name + " (it has: " + known + ")")
                     .c_str());
    return nullptr;
  }
  if (ContextGone(*dispatcher->state, "cannot create handler", type->name, status)) return nullptr;
  void* state = nullptr;
  try {
    state = type->hooks.create(type->hooks.type_data, config ? config : "", status);
  } catch (...) {
    TF_SetStatus(status, TF_INTERNAL, "the create hook threw a C++ exception");
  }
  if (TF_GetCode(status) == TF_OK && state == nullptr) {
    TF_SetStatus(status, TF_INTERNAL, "the create hook returned no state");
  }
  if (TF_GetCode(status) != TF_OK) {
    // A state returned along with an error is still the caller's to free.
    if (state != nullptr) {
      try {
        type->hooks.delete_state(state);
      } catch (...) {
      }
    }
    std::string m = "tf_ophandlers: cannot create handler " + type->name + ": " +
                    TF_Message(status);
    TF_SetStatus(status, TF_GetCode(status), m.c_str());
    return nullptr;
  }
  auto* h = new TFOH_C_Handler();
  h->type = type;
  h->state = state;
  h->dispatcher = dispatcher->state;
  return h;
}

void TFOH_C_DeleteHandler(TFOH_C_Handler* handler) {
  tf_ophandlers::c_runtime::HandlerUnref(handler);
}

void TFOH_C_PushHandler(TFOH_C_Handler* handler, TF_Status* status) {
  if (handler == nullptr) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT, "tf_ophandlers: TFOH_C_PushHandler: null handler");
    return;
  }
  const DispatcherState& d = *handler->dispatcher;
  if (ContextGone(d, "cannot push handler", tf_ophandlers::c_runtime::DebugString(handler),
                  status)) {
    return;
  }
  std::vector<Stack*>& scopes = tf_ophandlers::c_runtime::ThreadScopes(d.id);
  scopes.push_back(tf_ophandlers::c_runtime::NewStack(
      handler, scopes.empty() ? nullptr : scopes.back()));
}

void TFOH_C_PopHandler(TFOH_C_Handler* handler, TF_Status* status) {
  if (handler == nullptr) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT, "tf_ophandlers: TFOH_C_PopHandler: null handler");
    return;
  }
  const DispatcherState& d = *handler->dispatcher;
  std::string who = tf_ophandlers::c_runtime::DebugString(handler);
  if (ContextGone(d, "cannot pop handler", who, status)) return;
  std::vector<Stack*>& scopes = tf_ophandlers::c_runtime::ThreadScopes(d.id);
  if (scopes.empty() || scopes.back()->handler != handler) {
    std::string top = scopes.empty()
                          ? std::string("no scope is open on this thread")
                          : "the innermost scope is " +
                                tf_ophandlers::c_runtime::DebugString(scopes.back()->handler) +
                                "'s";
    TF_SetStatus(status, TF_FAILED_PRECONDITION,
                 ("tf_ophandlers: cannot pop handler " + who +
                  ": it is not the innermost scope of this thread (" + top +
                  "); pop scopes in the reverse order of pushing them")
                     .c_str());
    return;
  }
  Stack* s = scopes.back();
  scopes.pop_back();
  tf_ophandlers::c_runtime::StackUnref(s);
}

void TFOH_C_HandlerQuery(const TFOH_C_Handler* handler, const char* key, TF_Buffer* out,
                         TF_Status* status) {
  if (handler == nullptr || key == nullptr || out == nullptr) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 "tf_ophandlers: TFOH_C_HandlerQuery: null handler, key or buffer");
    return;
  }
  std::string who = tf_ophandlers::c_runtime::DebugString(handler);
  if (handler->type->hooks.query == nullptr) {
    TF_SetStatus(status, TF_UNIMPLEMENTED,
                 ("tf_ophandlers: handler " + who + " has no query hook").c_str());
    return;
  }
  TF_Buffer* fresh = TF_NewBuffer();
  tf_ophandlers::c_runtime::GuardHook(handler, "query", status, [&] {
    handler->type->hooks.query(handler->state, key, fresh, status);
  });
  if (TF_GetCode(status) != TF_OK) {
    std::string m = "tf_ophandlers: handler " + who + ": query '" + key + "': " +
                    TF_Message(status);
    TF_SetStatus(status, TF_GetCode(status), m.c_str());
  } else {
    SetBuffer(out, std::string(static_cast<const char*>(fresh->data ? fresh->data : ""),
                               fresh->length));
  }
  TF_DeleteBuffer(fresh);
}

void TFOH_C_HandlerDebugString(const TFOH_C_Handler* handler, TF_Buffer* out) {
  SetBuffer(out, tf_ophandlers::c_runtime::DebugString(handler));
}

int TFOH_C_IsHandlerTensor(const TFOH_C_Dispatcher* dispatcher, TFE_TensorHandle* tensor) {
  return dispatcher != nullptr && tensor != nullptr &&
         tf_ophandlers::c_runtime::PayloadOf(dispatcher->state.get(), tensor) != nullptr;
}

}  // extern "C"
