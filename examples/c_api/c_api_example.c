/* Op handlers from TensorFlow's C API, with no Python in the process.

   Runs a small computation (MatMul, AddV2, Tanh, Sum) with TFE_Execute three times:
   plainly, then under two nested native handlers (OpTimer from examples/cc_handler,
   inside OpCounter, the package's op counter), then once more with the handlers'
   scopes closed. Prints both handlers' state, checks the values against the plain run,
   and reads /proc/self/maps to show that no libpython was loaded.

     make c-api-example                  # builds libtf_ophandlers_c.so, op_timer.so, this
     ./build/c_api/c_api_example build/c_api/op_timer.so

   Exit status 0 when everything matched. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensorflow/c/eager/c_api.h"
#include "tf_ophandlers/c_api.h"

#define CHECK_OK(s, what)                                                   \
  do {                                                                      \
    if (TF_GetCode(s) != TF_OK) {                                           \
      fprintf(stderr, "FAILED: %s: %s\n", (what), TF_Message(s));           \
      exit(1);                                                              \
    }                                                                       \
  } while (0)

static const char* kCpu = "/job:localhost/replica:0/task:0/device:CPU:0";

static TFE_TensorHandle* Matrix(const float* values, int64_t rows, int64_t cols,
                                TF_Status* s) {
  int64_t dims[2] = {rows, cols};
  TF_Tensor* t = TF_AllocateTensor(TF_FLOAT, dims, 2, sizeof(float) * rows * cols);
  memcpy(TF_TensorData(t), values, sizeof(float) * rows * cols);
  TFE_TensorHandle* h = TFE_NewTensorHandle(t, s);
  TF_DeleteTensor(t);
  return h;
}

/* One op: `type` with inputs `a` (and `b` when not NULL), on `device` (NULL: none). */
static TFE_TensorHandle* Run(TFE_Context* ctx, const char* type, TFE_TensorHandle* a,
                             TFE_TensorHandle* b, const char* device, TF_Status* s) {
  TFE_Op* op = TFE_NewOp(ctx, type, s);
  CHECK_OK(s, type);
  TFE_OpAddInput(op, a, s);
  if (b != NULL) TFE_OpAddInput(op, b, s);
  TFE_OpSetAttrType(op, "T", TF_FLOAT);
  if (strcmp(type, "Sum") == 0) TFE_OpSetAttrType(op, "Tidx", TF_INT32);
  if (device != NULL) TFE_OpSetDevice(op, device, s);
  CHECK_OK(s, type);
  TFE_TensorHandle* out = NULL;
  int n = 1;
  TFE_Execute(op, &out, &n, s);
  TFE_DeleteOp(op);
  CHECK_OK(s, type);
  return out;
}

/* The computation: sum(tanh(x @ w + x), axis=1). Only the first op is placed on
   `device`; the others follow their inputs (type-based dispatch). Writes 3 values. */
static void Compute(TFE_Context* ctx, const char* device, float* result, TF_Status* s) {
  const float xv[9] = {0.1f, -0.2f, 0.3f, 0.4f, 0.5f, -0.6f, 0.7f, 0.8f, 0.9f};
  const float wv[9] = {1.0f, 0.5f, -0.5f, 0.25f, 2.0f, 0.0f, -1.0f, 0.75f, 1.5f};
  const int32_t axis = 1;
  TFE_TensorHandle* x = Matrix(xv, 3, 3, s);
  TFE_TensorHandle* w = Matrix(wv, 3, 3, s);
  CHECK_OK(s, "inputs");
  TF_Tensor* axis_t = TF_AllocateTensor(TF_INT32, NULL, 0, sizeof(int32_t));
  memcpy(TF_TensorData(axis_t), &axis, sizeof(axis));
  TFE_TensorHandle* ax = TFE_NewTensorHandle(axis_t, s);
  TF_DeleteTensor(axis_t);
  CHECK_OK(s, "axis");

  TFE_TensorHandle* xw = Run(ctx, "MatMul", x, w, device, s);
  TFE_TensorHandle* sum = Run(ctx, "AddV2", xw, x, NULL, s);
  TFE_TensorHandle* th = Run(ctx, "Tanh", sum, NULL, NULL, s);
  TFE_TensorHandle* red = Run(ctx, "Sum", th, ax, NULL, s);

  /* A handler tensor's value: copy it to a physical device (copy_off hooks), then read. */
  TFE_TensorHandle* cpu = TFE_TensorHandleCopyToDevice(red, ctx, kCpu, s);
  CHECK_OK(s, "copy to CPU");
  TF_Tensor* value = TFE_TensorHandleResolve(cpu, s);
  CHECK_OK(s, "resolve");
  memcpy(result, TF_TensorData(value), 3 * sizeof(float));
  TF_DeleteTensor(value);
  TFE_TensorHandle* handles[] = {x, w, ax, xw, sum, th, red, cpu};
  for (size_t i = 0; i < sizeof(handles) / sizeof(handles[0]); ++i) {
    TFE_DeleteTensorHandle(handles[i]);
  }
}

static void PrintQuery(const char* title, TFOH_C_Handler* h, const char* key, TF_Status* s) {
  TF_Buffer* out = TF_NewBuffer();
  TFOH_C_HandlerQuery(h, key, out, s);
  CHECK_OK(s, title);
  printf("%s (%s):\n%.*s%s", title, key, (int)out->length, (const char*)out->data,
         out->length && ((const char*)out->data)[out->length - 1] != '\n' ? "\n" : "");
  TF_DeleteBuffer(out);
}

/* How many ops of `type` the counter's "counts" text lists (0 when absent). */
static long Count(TFOH_C_Handler* counter, const char* type, TF_Status* s) {
  TF_Buffer* out = TF_NewBuffer();
  TFOH_C_HandlerQuery(counter, "counts", out, s);
  CHECK_OK(s, "counts");
  long n = 0;
  const char* p = (const char*)out->data;
  const char* end = p + out->length;
  size_t len = strlen(type);
  while (p < end) {
    const char* eol = memchr(p, '\n', (size_t)(end - p));
    if (eol == NULL) eol = end;
    if ((size_t)(eol - p) > len && strncmp(p, type, len) == 0 && p[len] == '\t') {
      n = strtol(p + len + 1, NULL, 10);
    }
    p = eol + 1;
  }
  TF_DeleteBuffer(out);
  return n;
}

/* Whether a libpython is mapped into this process (/proc/self/maps). */
static int LibpythonLoaded(void) {
  FILE* f = fopen("/proc/self/maps", "r");
  if (f == NULL) {
    perror("/proc/self/maps");
    exit(1);
  }
  char line[4096];
  int found = 0;
  while (fgets(line, sizeof line, f) != NULL) {
    if (strstr(line, "libpython") != NULL) {
      printf("mapped: %s", line);
      found = 1;
    }
  }
  fclose(f);
  return found;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s path/to/op_timer.so\n", argv[0]);
    return 2;
  }
  int failures = 0;
  TF_Status* s = TF_NewStatus();
  TFE_ContextOptions* opts = TFE_NewContextOptions();
  TFE_Context* ctx = TFE_NewContext(opts, s);
  TFE_DeleteContextOptions(opts);
  CHECK_OK(s, "context");

  TFOH_C_DispatcherOptions options;
  memset(&options, 0, sizeof options);
  options.api_version = TFOH_C_API_VERSION;
  options.struct_size = sizeof options;
  TFOH_C_Dispatcher* d = TFOH_C_RegisterDispatcher(ctx, &options, s);
  CHECK_OK(s, "register the dispatcher");
  const char* device = TFOH_C_DispatcherDeviceName(d);

  const TFOH_C_Library* native = TFOH_C_NativeHandlers(s);
  CHECK_OK(s, "native handlers");
  const TFOH_C_Library* timers = TFOH_C_LoadHandlerLibrary(argv[1], s);
  CHECK_OK(s, "load op_timer.so");
  TFOH_C_Handler* counter = TFOH_C_NewHandler(d, native, "OpCounter", "", s);
  CHECK_OK(s, "OpCounter");
  TFOH_C_Handler* timer = TFOH_C_NewHandler(d, timers, "OpTimer", "", s);
  CHECK_OK(s, "OpTimer");

  float plain[3], handled[3], after[3];
  Compute(ctx, NULL, plain, s);

  /* Nested scopes: the timer (pushed last) sees each op first and executes it on the
     counter, which executes it on the CPU. */
  TFOH_C_PushHandler(counter, s);
  CHECK_OK(s, "push OpCounter");
  TFOH_C_PushHandler(timer, s);
  CHECK_OK(s, "push OpTimer");
  Compute(ctx, device, handled, s);
  TFOH_C_PopHandler(timer, s);
  CHECK_OK(s, "pop OpTimer");
  TFOH_C_PopHandler(counter, s);
  CHECK_OK(s, "pop OpCounter");

  /* Scopes closed: an op placed on the dispatcher runs on the physical device. */
  Compute(ctx, device, after, s);

  PrintQuery("OpCounter", counter, "counts", s);
  PrintQuery("OpTimer", timer, "timings", s);

  printf("plain:    %.7g %.7g %.7g\n", plain[0], plain[1], plain[2]);
  printf("handlers: %.7g %.7g %.7g\n", handled[0], handled[1], handled[2]);
  for (int i = 0; i < 3; ++i) {
    if (handled[i] != plain[i] || after[i] != plain[i]) {
      printf("MISMATCH at %d: %.9g vs %.9g (after the scopes: %.9g)\n", i, handled[i],
             plain[i], after[i]);
      ++failures;
    }
  }
  const char* types[] = {"MatMul", "AddV2", "Tanh", "Sum"};
  for (int i = 0; i < 4; ++i) {
    long n = Count(counter, types[i], s);
    if (n != 1) {
      printf("COUNT: OpCounter counted %ld %s ops, expected 1\n", n, types[i]);
      ++failures;
    }
  }

  TFOH_C_DeleteHandler(timer);
  TFOH_C_DeleteHandler(counter);
  TFOH_C_DeleteDispatcher(d);
  TFE_DeleteContext(ctx);
  TF_DeleteStatus(s);

  int python = LibpythonLoaded();
  printf("libpython loaded: %s\n", python ? "yes" : "no");
  if (python) ++failures;
  printf("%s\n", failures ? "FAILED" : "OK: values equal plain execution");
  return failures ? 1 : 0;
}
