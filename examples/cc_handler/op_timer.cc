// OpTimer: a third-party op handler in C++ that measures the wall time every op type
// takes on the stack below it (per-op profiling without Python in the loop).
//
// Written only against tf_ophandlers/handler.h. Build it with the package's flags
// (README.md here has the oh.sysconfig one-liner: g++ -shared -fPIC -O2 <compile flags>
// op_timer.cc -o op_timer.so <link flags>), or with Bazel from the repository root:
//   ./configure.sh && bazel build //examples/cc_handler:op_timer.so
// and use it from Python:
//   timer = oh.load_handler_library("op_timer.so").OpTimer()
//   with timer: ...
//   timer.query("timings")  # b"MatMul\t<count>\t<total ns>\n..."
//
// Eager ops run synchronously (TFE_Execute returns when the kernel is done), so the time
// of `execute_next` is the op's time below this handler: its kernel, plus the handlers
// below. Ops of a replayed tf.function are timed once, while they are replayed (the
// replay builds the function), not at every call: time eager code.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

#include "tf_ophandlers/handler.h"

namespace {

const TFOH_RuntimeApi* api = nullptr;

struct Entry {
  long long count = 0;
  long long nanos = 0;
};

struct Timer {
  std::mutex mu;  // hooks may run on several threads at once (handler.h)
  std::unordered_map<std::string, Entry> entries;
};

void* Create(void*, const char* config, TF_Status* status) {
  if (config[0] != '\0') {
    TF_SetStatus(status, TF_INVALID_ARGUMENT, "OpTimer takes no configuration");
    return nullptr;
  }
  return new Timer();
}

void Delete(void* state) { delete static_cast<Timer*>(state); }

void Execute(void* state, TFOH_Context* ctx, const TFOH_Op* op, int num_inputs,
             TFOH_Tensor* const* inputs, int* num_outputs, TFOH_Tensor** outputs,
             TF_Status* status) {
  auto start = std::chrono::steady_clock::now();
  api->execute_next(ctx, op, num_inputs, inputs, num_outputs, outputs, status);
  auto nanos = std::chrono::duration_cast<std::chrono::nanoseconds>(
                   std::chrono::steady_clock::now() - start).count();
  if (TF_GetCode(status) != TF_OK) return;
  auto* timer = static_cast<Timer*>(state);
  std::lock_guard<std::mutex> lock(timer->mu);
  Entry& e = timer->entries[api->op_type(op)];
  e.count += 1;
  e.nanos += nanos;
}

void SetText(TF_Buffer* out, const std::string& text) {
  void* data = std::malloc(text.size() + 1);
  std::memcpy(data, text.data(), text.size());
  out->data = data;
  out->length = text.size();
  out->data_deallocator = [](void* d, size_t) { std::free(d); };
}

// "timings": one line per op type, "type\tcount\ttotal_nanoseconds".
void Query(void* state, const char* key, TF_Buffer* out, TF_Status* status) {
  if (std::strcmp(key, "timings") != 0) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT, "OpTimer answers only 'timings'");
    return;
  }
  auto* timer = static_cast<Timer*>(state);
  std::string text;
  std::lock_guard<std::mutex> lock(timer->mu);
  for (const auto& kv : timer->entries) {
    text += kv.first + "\t" + std::to_string(kv.second.count) + "\t" +
            std::to_string(kv.second.nanos) + "\n";
  }
  SetText(out, text);
}

}  // namespace

extern "C" TFOH_EXPORT void TFOH_InitHandlerLibrary(const TFOH_RuntimeApi* runtime,
                                                    TFOH_Library* library, TF_Status* status) {
  api = runtime;
  TFOH_HandlerType type;
  std::memset(&type, 0, sizeof(type));
  type.abi_version = TFOH_ABI_VERSION;
  type.struct_size = sizeof(type);
  type.name = "OpTimer";
  type.doc = "Wall time per op type of the ops it executes (C++); query('timings').";
  type.create = Create;
  type.delete_state = Delete;
  type.execute = Execute;
  type.query = Query;
  runtime->register_type(library, &type, status);
}
