// tf-ophandlers: process-wide state of the C++ boundary. Contracts: runtime.h.
#define PY_SSIZE_T_CLEAN
#include "boundary/runtime.h"

#include <cstring>
#include <unordered_map>

#include "tensorflow/core/framework/types.pb.h"

namespace tf_ophandlers {

TFE_Context* g_ctx = nullptr;
std::string g_device_name;
PyTypeObject* g_op_type = nullptr;
PyObject* g_execute = nullptr;
PyObject* g_copy_to = nullptr;
PyObject* g_copy_from = nullptr;
PyObject* g_stash_error = nullptr;
PyObject* g_num_dims = nullptr;
PyObject* g_dim = nullptr;
PyObject* g_summarize = nullptr;
PyObject* g_error_text = nullptr;
std::atomic<bool> g_shutdown{false};

namespace {
// Python 3.13 made the finalization check public (Py_IsFinalizing) and removed the
// private one; older versions only have _Py_IsFinalizing.
bool IsFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}
}  // namespace

bool PythonAlive() {
  return !g_shutdown.load(std::memory_order_acquire) && Py_IsInitialized() &&
         !IsFinalizing();
}

bool RequireInit() {
  if (g_ctx == nullptr || g_op_type == nullptr) {
    PyErr_SetString(PyExc_RuntimeError,
                    "tf_ophandlers: the dispatcher is not initialized (open a handler scope first)");
    return false;
  }
  return true;
}

TF_Status* ThreadStatus() {
  thread_local TF_Status* s = TF_NewStatus();
  TF_SetStatus(s, TF_OK, "");
  return s;
}

namespace {
// InternedString's strings, each with one reference for the process (never released).
std::unordered_map<std::string, PyObject*>* InternCache() {
  static auto* cache = new std::unordered_map<std::string, PyObject*>();
  return cache;
}
constexpr size_t kMaxInterned = 100000;
}  // namespace

PyObject* InternedStringKept(const char* text) {
  PyObject* s = InternedString(text);
  if (s == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  auto* cache = InternCache();
  auto it = cache->find(text);
  PyObject* kept = it != cache->end() && it->second == s ? s : nullptr;
  Py_DECREF(s);
  return kept;
}

PyObject* InternedString(const char* text) {
  auto* cache = InternCache();
  // The last few hits of this thread, compared by content (a caller's buffer may hold
  // another text next time): no std::string and no hash for an op type seen just before.
  // Entries point at strings the cache holds for the process (never released).
  struct Recent {
    char text[64];  // room for the dispatcher's device name (51)
    PyObject* value;
  };
  constexpr int kRecent = 4;
  thread_local Recent recent[kRecent] = {};
  thread_local unsigned next_recent = 0;
  for (Recent& r : recent) {
    if (r.value != nullptr && std::strcmp(r.text, text) == 0) {
      Py_INCREF(r.value);
      return r.value;
    }
  }
  auto it = cache->find(text);
  if (it != cache->end()) {
    if (std::strlen(text) < sizeof(Recent::text)) {
      Recent& r = recent[next_recent++ % kRecent];
      std::strcpy(r.text, text);
      r.value = it->second;
    }
    Py_INCREF(it->second);
    return it->second;
  }
  PyObject* s = PyUnicode_FromString(text);
  if (s == nullptr) return nullptr;
  if (cache->size() < kMaxInterned) {
    Py_INCREF(s);
    (*cache)[text] = s;
  }
  return s;
}

bool ValidDataType(long dtype) {
  return dtype > 0 && dtype < 100 &&
         tensorflow::DataType_IsValid(static_cast<int>(dtype));
}

}  // namespace tf_ophandlers
