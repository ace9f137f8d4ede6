// tf-ophandlers: the package's own C++ handlers (oh.native.PassThrough, oh.native.OpCounter),
// written only against the public header include/tf_ophandlers/handler.h: the proof that
// the header is enough to write a handler. Built by setup.py as the handler library
// tf_ophandlers/_native_handlers*.so and loaded by tf_ophandlers/native.py.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "tf_ophandlers/handler.h"

namespace {

const TFOH_RuntimeApi* g_api = nullptr;

// Writes `text` into `out` (a copy the buffer frees).
void SetBuffer(TF_Buffer* out, const std::string& text) {
  void* data = std::malloc(text.size() ? text.size() : 1);
  std::memcpy(data, text.data(), text.size());
  out->data = data;
  out->length = text.size();
  out->data_deallocator = [](void* d, size_t) { std::free(d); };
}

// ---- PassThrough: forwards every op to the next stack ----------------------------------
//
// No execute hook (ABI version 4): the runtime forwards every op itself, a forwarding
// level with no hook call and no TFOH_* object per op (a handler that executes some ops
// and forwards the rest names them with executes_op instead).

struct PassThroughState {};

void* PassThroughCreate(void*, const char* config, TF_Status* status) {
  if (config != nullptr && config[0] != '\0') {
    TF_SetStatus(status, TF_INVALID_ARGUMENT, "PassThrough takes no configuration");
    return nullptr;
  }
  return new PassThroughState();
}

void PassThroughDelete(void* state) { delete static_cast<PassThroughState*>(state); }


// ---- OpCounter: counts the ops it executes, by type -------------------------------------
//
// Per op: one atomic increment, found through a small per-thread cache of (counter,
// op type) -> counter slot, so the common case takes no lock, builds no std::string and
// hashes nothing. A miss takes the mutex and finds or inserts the type's slot (the map
// is node-based: a slot never moves while its counter lives).

std::atomic<uint64_t> g_next_counter_id{1};

struct OpCounterState {
  const uint64_t id = g_next_counter_id.fetch_add(1);  // never reused: keys the caches
  std::mutex mu;
  std::unordered_map<std::string, std::atomic<long long>> counts;  // inserts under mu
};

// The per-thread cache. An entry names its counter by id, so an entry of a deleted
// counter never matches again (its slot pointer is never followed).
struct CounterCacheEntry {
  uint64_t id = 0;
  char type[56] = {0};
  std::atomic<long long>* slot = nullptr;
};
constexpr int kCounterCache = 16;
thread_local CounterCacheEntry t_counter_cache[kCounterCache];
thread_local unsigned t_counter_next = 0;

std::atomic<long long>* CounterSlot(OpCounterState* s, const char* type) {
  for (CounterCacheEntry& e : t_counter_cache) {
    if (e.id == s->id && std::strcmp(e.type, type) == 0) return e.slot;
  }
  std::atomic<long long>* slot;
  {
    std::lock_guard<std::mutex> l(s->mu);
    auto it = s->counts.find(type);
    if (it == s->counts.end()) {
      it = s->counts
               .emplace(std::piecewise_construct, std::forward_as_tuple(type),
                        std::forward_as_tuple(0))
               .first;
    }
    slot = &it->second;
  }
  if (std::strlen(type) < sizeof(CounterCacheEntry::type)) {
    CounterCacheEntry& e = t_counter_cache[t_counter_next++ % kCounterCache];
    e.id = s->id;
    std::strcpy(e.type, type);
    e.slot = slot;
  }
  return slot;
}

void* OpCounterCreate(void*, const char* config, TF_Status* status) {
  if (config != nullptr && config[0] != '\0') {
    TF_SetStatus(status, TF_INVALID_ARGUMENT, "OpCounter takes no configuration");
    return nullptr;
  }
  return new OpCounterState();
}

void OpCounterDelete(void* state) { delete static_cast<OpCounterState*>(state); }

void OpCounterExecute(void* state, TFOH_Context* ctx, const TFOH_Op* op, int num_inputs,
                      TFOH_Tensor* const* inputs, int* num_outputs, TFOH_Tensor** outputs,
                      TF_Status* status) {
  g_api->execute_next(ctx, op, num_inputs, inputs, num_outputs, outputs, status);
  if (TF_GetCode(status) != TF_OK) return;  // only ops that ran are counted
  CounterSlot(static_cast<OpCounterState*>(state), g_api->op_type(op))
      ->fetch_add(1, std::memory_order_relaxed);
}

// Queries: "counts" -> "Type\tN\n" lines; "total" -> the number of ops; "reset" is not a
// query (queries are read-only): make a new OpCounter instead.
void OpCounterQuery(void* state, const char* key, TF_Buffer* out, TF_Status* status) {
  auto* s = static_cast<OpCounterState*>(state);
  std::lock_guard<std::mutex> l(s->mu);
  std::string text;
  if (std::strcmp(key, "counts") == 0) {
    for (const auto& kv : s->counts) {
      long long n = kv.second.load();
      if (n > 0) text += kv.first + "\t" + std::to_string(n) + "\n";  // 0: being inserted
    }
  } else if (std::strcmp(key, "total") == 0) {
    long long n = 0;
    for (const auto& kv : s->counts) n += kv.second.load();
    text = std::to_string(n);
  } else {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 (std::string("OpCounter has no query '") + key + "' (try 'counts', 'total')")
                     .c_str());
    return;
  }
  SetBuffer(out, text);
}

void OpCounterDebugString(void* state, TF_Buffer* out) {
  auto* s = static_cast<OpCounterState*>(state);
  long long n = 0;
  {
    std::lock_guard<std::mutex> l(s->mu);
    for (const auto& kv : s->counts) n += kv.second.load();
  }
  SetBuffer(out, "OpCounter(" + std::to_string(n) + " ops)");
}

TFOH_HandlerType MakeType(const char* name, const char* doc) {
  TFOH_HandlerType t;
  std::memset(&t, 0, sizeof(t));
  t.abi_version = TFOH_ABI_VERSION;
  t.struct_size = sizeof(TFOH_HandlerType);
  t.name = name;
  t.doc = doc;
  return t;
}

}  // namespace

extern "C" TFOH_EXPORT void TFOH_InitHandlerLibrary(const TFOH_RuntimeApi* api,
                                                    TFOH_Library* library, TF_Status* status) {
  if (api->abi_version < TFOH_ABI_VERSION) {  // PassThrough needs version 4's NULL execute
    TF_SetStatus(status, TF_FAILED_PRECONDITION, "runtime ABI too old");
    return;
  }
  g_api = api;
  TFOH_HandlerType pass = MakeType("PassThrough", "Forwards every op unchanged (C++).");
  pass.create = PassThroughCreate;
  pass.delete_state = PassThroughDelete;
  pass.execute = nullptr;  // forwards every op (ABI version 4)
  api->register_type(library, &pass, status);
  if (TF_GetCode(status) != TF_OK) return;

  TFOH_HandlerType counter =
      MakeType("OpCounter", "Counts executed ops by type (C++); `.counts` in Python.");
  counter.create = OpCounterCreate;
  counter.delete_state = OpCounterDelete;
  counter.execute = OpCounterExecute;
  counter.query = OpCounterQuery;
  counter.debug_string = OpCounterDebugString;
  api->register_type(library, &counter, status);
}
