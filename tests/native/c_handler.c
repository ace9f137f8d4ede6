/* A handler library written in C (not C++): the proof that tf_ophandlers/handler.h is
   valid C. Built by tests/native/test_c_handler.py with
   gcc -std=c11 -Wall -Werror $(oh.sysconfig.get_c_compile_flags()) ... $(link flags).

   CCounter(config="")  forwards every op to the next stack and counts the ops that ran,
                        by type. query("counts"): "Type count\n" lines sorted by type;
                        query("total"): the number of ops; query("dims"): the rank of
                        the last op's first output (tensor_num_dims), "-" when none.
                        config "fail:<Type>" fails ops of that type with
                        TF_INVALID_ARGUMENT and a message naming the op. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tf_ophandlers/handler.h"
/* Valid C too; included after handler.h to check the two declare the same types. */
#include "tensorflow/c/eager/c_api.h"

static const TFOH_RuntimeApi* api;

#define MAX_TYPES 256
#define MAX_NAME 128

typedef struct {
  pthread_mutex_t mu;
  char fail_on[MAX_NAME];
  int num_types;
  char names[MAX_TYPES][MAX_NAME];
  long counts[MAX_TYPES];
  long total;
  int last_rank;
} Counter;

static void* Create(void* type_data, const char* config, TF_Status* status) {
  (void)type_data;
  if (strncmp(config, "fail:", 5) != 0 && config[0] != '\0') {
    TF_SetStatus(status, TF_INVALID_ARGUMENT, "CCounter config must be \"\" or \"fail:<Type>\"");
    return NULL;
  }
  Counter* c = (Counter*)calloc(1, sizeof(Counter));
  if (c == NULL) {
    TF_SetStatus(status, TF_RESOURCE_EXHAUSTED, "CCounter: out of memory");
    return NULL;
  }
  pthread_mutex_init(&c->mu, NULL);
  if (config[0] != '\0') snprintf(c->fail_on, MAX_NAME, "%s", config + 5);
  c->last_rank = -2;
  return c;
}

static void Delete(void* state) {
  Counter* c = (Counter*)state;
  pthread_mutex_destroy(&c->mu);
  free(c);
}

static void Execute(void* state, TFOH_Context* ctx, const TFOH_Op* op, int num_inputs,
                    TFOH_Tensor* const* inputs, int* num_outputs, TFOH_Tensor** outputs,
                    TF_Status* status) {
  Counter* c = (Counter*)state;
  const char* type = api->op_type(op);
  if (c->fail_on[0] != '\0' && strcmp(c->fail_on, type) == 0) {
    char message[2 * MAX_NAME];
    snprintf(message, sizeof(message), "CCounter refuses op %s", type);
    TF_SetStatus(status, TF_INVALID_ARGUMENT, message);
    return;
  }
  api->execute_next(ctx, op, num_inputs, inputs, num_outputs, outputs, status);
  if (TF_GetCode(status) != TF_OK) return; /* count only the ops that ran */
  int rank = -2;
  if (*num_outputs > 0) {
    TF_Status* s = TF_NewStatus();
    rank = api->tensor_num_dims(outputs[0], s);
    if (TF_GetCode(s) != TF_OK) rank = -2;
    TF_DeleteStatus(s);
  }
  pthread_mutex_lock(&c->mu);
  int i = 0;
  while (i < c->num_types && strcmp(c->names[i], type) != 0) ++i;
  if (i == c->num_types && i < MAX_TYPES) {
    snprintf(c->names[i], MAX_NAME, "%s", type);
    c->num_types++;
  }
  if (i < MAX_TYPES) c->counts[i]++;
  c->total++;
  c->last_rank = rank;
  pthread_mutex_unlock(&c->mu);
}

static void FreeText(void* data, size_t length) {
  (void)length;
  free(data);
}

static int ByName(const void* a, const void* b) { return strcmp(*(char* const*)a, *(char* const*)b); }

static void Query(void* state, const char* key, TF_Buffer* out, TF_Status* status) {
  Counter* c = (Counter*)state;
  size_t cap = (size_t)MAX_TYPES * (MAX_NAME + 24) + 32;
  char* text = (char*)malloc(cap);
  if (text == NULL) {
    TF_SetStatus(status, TF_RESOURCE_EXHAUSTED, "CCounter: out of memory");
    return;
  }
  size_t n = 0;
  pthread_mutex_lock(&c->mu);
  if (strcmp(key, "total") == 0) {
    n = (size_t)snprintf(text, cap, "%ld", c->total);
  } else if (strcmp(key, "dims") == 0) {
    n = c->last_rank < -1 ? (size_t)snprintf(text, cap, "-")
                          : (size_t)snprintf(text, cap, "%d", c->last_rank);
  } else if (strcmp(key, "counts") == 0) {
    char* order[MAX_TYPES];
    for (int i = 0; i < c->num_types; ++i) order[i] = c->names[i];
    qsort(order, (size_t)c->num_types, sizeof(char*), ByName);
    for (int j = 0; j < c->num_types; ++j) {
      int i = (int)((order[j] - c->names[0]) / MAX_NAME);
      n += (size_t)snprintf(text + n, cap - n, "%s %ld\n", c->names[i], c->counts[i]);
    }
  } else {
    pthread_mutex_unlock(&c->mu);
    free(text);
    TF_SetStatus(status, TF_INVALID_ARGUMENT, "CCounter: unknown query key");
    return;
  }
  pthread_mutex_unlock(&c->mu);
  out->data = text;
  out->length = n;
  out->data_deallocator = FreeText;
}

static void DebugString(void* state, TF_Buffer* out) {
  static const char kName[] = "CCounter()";
  (void)state;
  out->data = kName;
  out->length = sizeof(kName) - 1;
  out->data_deallocator = NULL;
}

TFOH_EXPORT void TFOH_InitHandlerLibrary(const TFOH_RuntimeApi* a, TFOH_Library* library,
                                         TF_Status* status) {
  /* TFE_TensorHandle from eager/c_api.h and handler.h's struct tag are one type. */
  struct TFE_TensorHandle* (*handle_fn)(const TFOH_Tensor*) = a->tensor_handle;
  TFE_TensorHandle* (*same_fn)(const TFOH_Tensor*) = handle_fn;
  (void)same_fn;
  api = a;
  TFOH_HandlerType t;
  memset(&t, 0, sizeof(t));
  t.abi_version = TFOH_ABI_VERSION;
  t.struct_size = sizeof(t);
  t.name = "CCounter";
  t.doc = "A pass-through handler written in C that counts ops by type.";
  t.create = Create;
  t.delete_state = Delete;
  t.execute = Execute;
  t.query = Query;
  t.debug_string = DebugString;
  api->register_type(library, &t, status);
}
