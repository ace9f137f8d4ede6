/* Bad input through tf_ophandlers/c_api.h: each case must fail with a TF_Status error of
   the stated code whose message names what went wrong, and never crash. Also the edges
   that must work: tensors of a scope used after it closed, under the same handlers pushed
   again or pushed on another thread. Prints one line per case ("ok <case>: <message>" or
   "FAIL <case>: ..."); exit status 1 on any failure.
   Usage: c_api_errors bad_abi_handler.so failing_handler.so c_api_bad_handler.so
   (the Makefile's c-api-example; tests/native/test_c_api.py). */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensorflow/c/eager/c_api.h"
#include "tf_ophandlers/c_api.h"

static int failures = 0;

/* Checks that `s` failed with `code` and that its message contains `needle`; resets it. */
static void Expect(const char* name, TF_Status* s, TF_Code code, const char* needle) {
  if (TF_GetCode(s) == code && strstr(TF_Message(s), needle) != NULL) {
    printf("ok %s: %s\n", name, TF_Message(s));
  } else {
    printf("FAIL %s: code %d (want %d), message \"%s\" (want it to contain \"%s\")\n", name,
           (int)TF_GetCode(s), (int)code, TF_Message(s), needle);
    ++failures;
  }
  TF_SetStatus(s, TF_OK, "");
}

static void MustBeOk(const char* what, TF_Status* s) {
  if (TF_GetCode(s) != TF_OK) {
    printf("FAIL setup %s: %s\n", what, TF_Message(s));
    exit(1);
  }
}

static TFE_Context* NewContext(TF_Status* s) {
  TFE_ContextOptions* opts = TFE_NewContextOptions();
  TFE_Context* ctx = TFE_NewContext(opts, s);
  TFE_DeleteContextOptions(opts);
  MustBeOk("context", s);
  return ctx;
}

static TFE_TensorHandle* Scalar(float v, TF_Status* s) {
  TF_Tensor* t = TF_AllocateTensor(TF_FLOAT, NULL, 0, sizeof(float));
  memcpy(TF_TensorData(t), &v, sizeof v);
  TFE_TensorHandle* h = TFE_NewTensorHandle(t, s);
  TF_DeleteTensor(t);
  return h;
}

/* `type`(x) (a float op of one input and output) placed on `device` (NULL: not placed);
   NULL with `s` set on failure. */
static TFE_TensorHandle* Unary(TFE_Context* ctx, const char* type, TFE_TensorHandle* x,
                               const char* device, TF_Status* s) {
  TFE_Op* op = TFE_NewOp(ctx, type, s);
  MustBeOk(type, s);
  TFE_OpAddInput(op, x, s);
  TFE_OpSetAttrType(op, "T", TF_FLOAT);
  if (device != NULL) TFE_OpSetDevice(op, device, s);
  TFE_TensorHandle* out = NULL;
  int n = 1;
  if (TF_GetCode(s) == TF_OK) TFE_Execute(op, &out, &n, s);
  TFE_DeleteOp(op);
  return TF_GetCode(s) == TF_OK ? out : NULL;
}

static TFE_TensorHandle* Neg(TFE_Context* ctx, TFE_TensorHandle* x, const char* device,
                             TF_Status* s) {
  return Unary(ctx, "Neg", x, device, s);
}

/* The value of scalar `h` (a handler tensor is copied to the CPU first); NAN with `s` set
   on failure. */
static float ValueOf(TFE_Context* ctx, TFE_TensorHandle* h, TF_Status* s) {
  TFE_TensorHandle* cpu =
      TFE_TensorHandleCopyToDevice(h, ctx, "/job:localhost/replica:0/task:0/device:CPU:0", s);
  if (TF_GetCode(s) != TF_OK) return 0.0f / 0.0f;
  TF_Tensor* t = TFE_TensorHandleResolve(cpu, s);
  TFE_DeleteTensorHandle(cpu);
  if (TF_GetCode(s) != TF_OK) return 0.0f / 0.0f;
  float v;
  memcpy(&v, TF_TensorData(t), sizeof v);
  TF_DeleteTensor(t);
  return v;
}

/* Neg(x) with no placement under the calling thread's scopes: a handler tensor whose
   value is `want`, or a FAIL line for `name`. */
static void ExpectNeg(const char* name, TFOH_C_Dispatcher* d, TFE_Context* ctx,
                      TFE_TensorHandle* x, float want, TF_Status* s) {
  TFE_TensorHandle* y = Neg(ctx, x, NULL, s);
  float got = y != NULL ? ValueOf(ctx, y, s) : 0.0f;
  if (TF_GetCode(s) != TF_OK || !TFOH_C_IsHandlerTensor(d, y) || got != want) {
    printf("FAIL %s: status %d \"%s\", handler tensor %d, value %g (want %g)\n", name,
           (int)TF_GetCode(s), TF_Message(s), y != NULL && TFOH_C_IsHandlerTensor(d, y),
           (double)got, (double)want);
    ++failures;
  } else {
    printf("ok %s: %g\n", name, (double)got);
  }
  if (y != NULL) TFE_DeleteTensorHandle(y);
  TF_SetStatus(s, TF_OK, "");
}

/* Runs `type`(x) on the dispatcher under a scope of a new `handler_type` of `lib`; expects
   the op to fail with `code` and a message containing `needle`. */
static void ExpectOpFails(const char* name, TFOH_C_Dispatcher* d, TFE_Context* ctx,
                          const TFOH_C_Library* lib, const char* handler_type,
                          const char* config, const char* type, TFE_TensorHandle* x,
                          TF_Code code, const char* needle, TF_Status* s) {
  TFOH_C_Handler* h = TFOH_C_NewHandler(d, lib, handler_type, config, s);
  MustBeOk(handler_type, s);
  TFOH_C_PushHandler(h, s);
  MustBeOk("push", s);
  TFE_TensorHandle* y = Unary(ctx, type, x, TFOH_C_DispatcherDeviceName(d), s);
  if (y != NULL) {
    TFE_DeleteTensorHandle(y);
    TF_SetStatus(s, TF_OK, "the op ran");
  }
  TF_Code got = TF_GetCode(s);
  char message[2048];
  snprintf(message, sizeof message, "%s", TF_Message(s));
  TF_SetStatus(s, TF_OK, "");
  TFOH_C_PopHandler(h, s);
  MustBeOk("pop", s);
  TFOH_C_DeleteHandler(h);
  TF_SetStatus(s, got, message);
  Expect(name, s, code, needle);
}

/* Scopes are per thread: an op another thread places on the dispatcher while this thread
   has a scope open runs physically (and is not counted). */
typedef struct {
  TFE_Context* ctx;
  TFE_TensorHandle* x;
  const char* device;
  int handler_tensor; /* out: whether the output was a handler tensor */
  TFOH_C_Dispatcher* d;
  TF_Code code;
} OtherThread;

/* Another thread pushes the handlers of tensors made on the main thread (outer first)
   and uses those tensors under them. */
typedef struct {
  TFOH_C_Dispatcher* d;
  TFE_Context* ctx;
  TFOH_C_Handler* outer;
  TFOH_C_Handler* inner;
  TFE_TensorHandle* of_outer; /* a tensor of [outer] */
  TFE_TensorHandle* of_both;  /* a tensor of [inner > outer] */
  float want_outer, want_both;
} ScopeOnOtherThread;

static void* UseUnderScopesOnOtherThread(void* arg) {
  ScopeOnOtherThread* o = (ScopeOnOtherThread*)arg;
  TF_Status* s = TF_NewStatus();
  TFOH_C_PushHandler(o->outer, s);
  MustBeOk("push on the other thread", s);
  ExpectNeg("a handler's tensor under its scope on another thread", o->d, o->ctx, o->of_outer,
            o->want_outer, s);
  TFOH_C_PushHandler(o->inner, s);
  MustBeOk("push on the other thread", s);
  ExpectNeg("a stack's tensor under the same stack on another thread", o->d, o->ctx,
            o->of_both, o->want_both, s);
  TFOH_C_PopHandler(o->inner, s);
  TFOH_C_PopHandler(o->outer, s);
  MustBeOk("pop on the other thread", s);
  TF_DeleteStatus(s);
  return NULL;
}

static void* RunOnOtherThread(void* arg) {
  OtherThread* o = (OtherThread*)arg;
  TF_Status* s = TF_NewStatus();
  TFE_TensorHandle* y = Unary(o->ctx, "Neg", o->x, o->device, s);
  o->code = TF_GetCode(s);
  if (y != NULL) {
    o->handler_tensor = TFOH_C_IsHandlerTensor(o->d, y);
    TFE_DeleteTensorHandle(y);
  }
  TF_DeleteStatus(s);
  return NULL;
}

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s bad_abi_handler.so failing_handler.so c_api_bad_handler.so\n",
            argv[0]);
    return 2;
  }
  TF_Status* s = TF_NewStatus();
  TFE_Context* ctx = NewContext(s);

  /* The C API version of the caller. */
  TFOH_C_DispatcherOptions options;
  memset(&options, 0, sizeof options);
  options.api_version = TFOH_C_API_VERSION + 1;
  options.struct_size = sizeof options;
  if (TFOH_C_RegisterDispatcher(ctx, &options, s) != NULL) ++failures;
  Expect("future C API version", s, TF_FAILED_PRECONDITION, "C API version 2 is unknown");
  options.api_version = TFOH_C_API_VERSION;
  options.struct_size = 4;
  if (TFOH_C_RegisterDispatcher(ctx, &options, s) != NULL) ++failures;
  Expect("short options struct", s, TF_INVALID_ARGUMENT, "struct_size");

  TFOH_C_Dispatcher* d = TFOH_C_RegisterDispatcher(ctx, NULL, s);
  MustBeOk("register", s);
  if (TFOH_C_RegisterDispatcher(ctx, NULL, s) != NULL) ++failures;
  Expect("device registered twice", s, TF_GetCode(s) == TF_OK ? TF_ALREADY_EXISTS : TF_GetCode(s),
         "cannot register the dispatcher device");

  /* Libraries. */
  if (TFOH_C_LoadHandlerLibrary("/nonexistent/no_such_handlers.so", s) != NULL) ++failures;
  Expect("missing library", s, TF_NOT_FOUND, "/nonexistent/no_such_handlers.so");
  if (TFOH_C_LoadHandlerLibrary("libm.so.6", s) != NULL) ++failures;
  Expect("not a handler library", s, TF_INVALID_ARGUMENT, "does not export TFOH_InitHandlerLibrary");
  if (TFOH_C_LoadHandlerLibrary(argv[1], s) != NULL) ++failures;
  Expect("wrong handler ABI version", s, TF_INVALID_ARGUMENT, "handler ABI version 5 is unknown");

  /* Handlers. */
  const TFOH_C_Library* native = TFOH_C_NativeHandlers(s);
  MustBeOk("native handlers", s);
  if (TFOH_C_NewHandler(d, native, "NoSuchHandler", "", s) != NULL) ++failures;
  Expect("unknown type", s, TF_NOT_FOUND, "has no type NoSuchHandler (it has: PassThrough, OpCounter)");
  if (TFOH_C_NewHandler(d, native, "OpCounter", "verbose", s) != NULL) ++failures;
  Expect("create hook fails", s, TF_INVALID_ARGUMENT, "OpCounter takes no configuration");
  TFOH_C_Handler* a = TFOH_C_NewHandler(d, native, "OpCounter", NULL, s);
  TFOH_C_Handler* b = TFOH_C_NewHandler(d, native, "PassThrough", "", s);
  MustBeOk("handlers", s);
  TF_Buffer* buf = TF_NewBuffer();
  TFOH_C_HandlerQuery(a, "colour", buf, s);
  Expect("unknown query key", s, TF_INVALID_ARGUMENT, "OpCounter has no query 'colour'");
  TFOH_C_HandlerQuery(b, "counts", buf, s);
  Expect("query without a hook", s, TF_UNIMPLEMENTED, "PassThrough() has no query hook");

  /* Scopes: popping one that is not the innermost. */
  TFOH_C_PopHandler(a, s);
  Expect("pop with no scope open", s, TF_FAILED_PRECONDITION, "no scope is open on this thread");
  TFOH_C_PushHandler(a, s);
  TFOH_C_PushHandler(b, s);
  MustBeOk("push", s);
  TFOH_C_PopHandler(a, s);
  Expect("pop not on top", s, TF_FAILED_PRECONDITION,
         "it is not the innermost scope of this thread (the innermost scope is PassThrough()'s)");
  /* Nothing changed: both pop in the right order, and ops still run through both. */
  TFE_TensorHandle* x = Scalar(2.0f, s);
  TFE_TensorHandle* y = Neg(ctx, x, TFOH_C_DispatcherDeviceName(d), s);
  MustBeOk("Neg under the scopes", s);
  TFOH_C_PopHandler(b, s);
  MustBeOk("pop PassThrough", s);
  TFOH_C_PopHandler(a, s);
  MustBeOk("pop OpCounter", s);
  TFOH_C_HandlerQuery(a, "total", buf, s);
  MustBeOk("total", s);
  if (buf->length != 1 || ((const char*)buf->data)[0] != '1') {
    printf("FAIL pop not on top: the counter counted %.*s ops, want 1\n", (int)buf->length,
           (const char*)buf->data);
    ++failures;
  } else {
    printf("ok scopes intact after a refused pop\n");
  }

  /* Another thread does not see this thread's scope. */
  {
    TF_Buffer* before = TF_NewBuffer();
    TFOH_C_PushHandler(a, s);
    TFOH_C_HandlerQuery(a, "total", before, s);
    MustBeOk("scope for the thread check", s);
    OtherThread o = {ctx, x, TFOH_C_DispatcherDeviceName(d), -1, d, TF_OK};
    pthread_t thread;
    pthread_create(&thread, NULL, RunOnOtherThread, &o);
    pthread_join(thread, NULL);
    TFOH_C_HandlerQuery(a, "total", buf, s);
    MustBeOk("total after the other thread", s);
    TFOH_C_PopHandler(a, s);
    MustBeOk("pop after the thread check", s);
    if (o.code != TF_OK || o.handler_tensor != 0 || buf->length != before->length ||
        memcmp(buf->data, before->data, buf->length) != 0) {
      printf("FAIL scopes are per thread: status %d, handler tensor %d, counts %.*s -> %.*s\n",
             (int)o.code, o.handler_tensor, (int)before->length, (const char*)before->data,
             (int)buf->length, (const char*)buf->data);
      ++failures;
    } else {
      printf("ok scopes are per thread\n");
    }
    TF_DeleteBuffer(before);
  }

  /* Tensors outlive their scopes: y (of [PassThrough > OpCounter], both popped) under the
     same handlers pushed again, and a tensor of [OpCounter] lifted onto a new
     [PassThrough > OpCounter]; the values are those of plain execution. */
  {
    TFE_TensorHandle* plain_y = Neg(ctx, x, NULL, s);
    MustBeOk("plain Neg", s);
    TFE_TensorHandle* plain_z = Neg(ctx, plain_y, NULL, s);
    MustBeOk("plain Neg Neg", s);
    const float want = ValueOf(ctx, plain_z, s); /* -(-2) */
    MustBeOk("plain value", s);
    TFE_DeleteTensorHandle(plain_z);
    TFOH_C_PushHandler(a, s);
    TFOH_C_PushHandler(b, s);
    MustBeOk("push again", s);
    ExpectNeg("re-pushed scopes take a tensor of the popped ones", d, ctx, y, want, s);
    TFOH_C_PopHandler(b, s);
    MustBeOk("pop", s);
    TFE_TensorHandle* of_a = Neg(ctx, x, TFOH_C_DispatcherDeviceName(d), s); /* of [OpCounter] */
    TFOH_C_PopHandler(a, s);
    MustBeOk("Neg under OpCounter", s);
    if (!TFOH_C_IsHandlerTensor(d, of_a)) {
      printf("FAIL setup: Neg placed on the dispatcher under OpCounter is no handler tensor\n");
      exit(1);
    }
    TFOH_C_PushHandler(a, s);
    TFOH_C_PushHandler(b, s);
    MustBeOk("push again", s);
    ExpectNeg("an earlier scope's tensor lifted onto re-pushed scopes", d, ctx, of_a, want, s);
    TFOH_C_PopHandler(b, s);
    /* Structure, not just handler types: y's stack is above [OpCounter], not below it. */
    if (Neg(ctx, y, NULL, s) != NULL) ++failures;
    Expect("a tensor of a higher stack under a lower one", s, TF_INVALID_ARGUMENT,
           "which is not below the op's stack [OpCounter(");
    TFOH_C_PopHandler(a, s);
    MustBeOk("pop", s);

    ScopeOnOtherThread o = {d, ctx, a, b, of_a, y, want, want};
    pthread_t thread;
    pthread_create(&thread, NULL, UseUnderScopesOnOtherThread, &o);
    pthread_join(thread, NULL);
    TFE_DeleteTensorHandle(of_a);
    TFE_DeleteTensorHandle(plain_y);
  }

  /* A tensor of one stack used under an unrelated one. */
  TFOH_C_Handler* c = TFOH_C_NewHandler(d, native, "PassThrough", "", s);
  MustBeOk("third handler", s);
  TFOH_C_PushHandler(c, s);
  MustBeOk("push", s);
  if (Neg(ctx, y, NULL, s) != NULL) ++failures;
  Expect("input of an unrelated stack", s, TF_INVALID_ARGUMENT, "which is not below the op's stack");
  TFOH_C_PopHandler(c, s);
  MustBeOk("pop", s);

  /* A kernel error under a handler reaches the caller with the handler named. */
  TFOH_C_PushHandler(a, s);
  TFE_Op* bad = TFE_NewOp(ctx, "Reshape", s);
  TFE_OpAddInput(bad, x, s);
  TFE_OpAddInput(bad, x, s); /* a float shape: refused by the kernel */
  TFE_OpSetDevice(bad, TFOH_C_DispatcherDeviceName(d), s);
  MustBeOk("Reshape", s);
  TFE_TensorHandle* none = NULL;
  int n = 1;
  TFE_Execute(bad, &none, &n, s);
  TFE_DeleteOp(bad);
  TF_Code code = TF_GetCode(s);
  if (code == TF_OK) {
    printf("FAIL kernel error under a handler: Reshape ran\n");
    ++failures;
  } else {
    Expect("kernel error under a handler", s, code, "OpCounter");
  }
  TFOH_C_PopHandler(a, s);
  MustBeOk("pop", s);
  TFE_DeleteTensorHandle(y);

  /* Handlers that fail, or break handler.h's contract. */
  const TFOH_C_Library* failing = TFOH_C_LoadHandlerLibrary(argv[2], s);
  const TFOH_C_Library* broken = TFOH_C_LoadHandlerLibrary(argv[3], s);
  MustBeOk("test handler libraries", s);
  {
    /* A create hook that sets an error and returns a state anyway: the state is freed. */
    void* self = dlopen(argv[3], RTLD_NOW);
    int (*live)(void) = self ? (int (*)(void))dlsym(self, "c_api_bad_handler_live_states") : NULL;
    if (live == NULL) {
      printf("FAIL setup c_api_bad_handler_live_states: %s\n", dlerror());
      exit(1);
    }
    int before = live();
    if (TFOH_C_NewHandler(d, broken, "CreateFails", "", s) != NULL) ++failures;
    Expect("create hook fails with a state", s, TF_INVALID_ARGUMENT,
           "cannot create handler CreateFails: CreateFails refuses every configuration");
    if (live() != before) {
      printf("FAIL create hook fails with a state: %d states leaked\n", live() - before);
      ++failures;
    } else {
      printf("ok the failed create's state was deleted\n");
    }
    dlclose(self);
  }
  ExpectOpFails("execute hook fails", d, ctx, failing, "FailOn", "Neg", "Neg", x,
                TF_INVALID_ARGUMENT, "handler FailOn(): execute (op Neg): FailOn refuses op Neg", s);
  ExpectOpFails("wrong output dtype", d, ctx, broken, "WrongDtype", "", "IsFinite", x,
                TF_INVALID_ARGUMENT,
                "handler WrongDtype(): execute (op IsFinite): the execute hook returned output 0 "
                "of dtype enum 1; the op's is 10", s);
  ExpectOpFails("too few outputs", d, ctx, broken, "TooFew", "", "Neg", x, TF_INVALID_ARGUMENT,
                "the execute hook returned 0 outputs; the op has 1", s);
  ExpectOpFails("hook throws", d, ctx, broken, "Throws", "", "Neg", x, TF_INTERNAL,
                "handler Throws(): execute (op Neg): hook execute threw a C++ exception: Throws() "
                "always throws", s);
  {
    TFOH_C_Handler* keeper = TFOH_C_NewHandler(d, failing, "NoCopyOff", "", s);
    MustBeOk("NoCopyOff", s);
    TFOH_C_PushHandler(keeper, s);
    TFE_TensorHandle* kept = Neg(ctx, x, TFOH_C_DispatcherDeviceName(d), s);
    TFOH_C_PopHandler(keeper, s);
    MustBeOk("Neg under NoCopyOff", s);
    if (!TFOH_C_IsHandlerTensor(d, kept)) ++failures;
    TFE_TensorHandle* off = TFE_TensorHandleCopyToDevice(
        kept, ctx, "/job:localhost/replica:0/task:0/device:CPU:0", s);
    if (off != NULL) TFE_DeleteTensorHandle(off);
    Expect("copy_off refused", s, TF_FAILED_PRECONDITION,
           "handler NoCopyOff(strict): copy_off: NoCopyOff keeps its tensors");
    TFE_DeleteTensorHandle(kept);
    TFOH_C_DeleteHandler(keeper);
  }

  /* Handlers whose context is gone. */
  TFE_Context* ctx2 = NewContext(s);
  TFOH_C_Dispatcher* d2 = TFOH_C_RegisterDispatcher(ctx2, NULL, s);
  TFOH_C_Handler* late = TFOH_C_NewHandler(d2, native, "OpCounter", "", s);
  MustBeOk("second context", s);
  TFE_DeleteContext(ctx2);
  TFOH_C_PushHandler(late, s);
  Expect("push after the context is gone", s, TF_FAILED_PRECONDITION, "was deleted");
  TFOH_C_PopHandler(late, s);
  Expect("pop after the context is gone", s, TF_FAILED_PRECONDITION, "was deleted");
  if (TFOH_C_NewHandler(d2, native, "OpCounter", "", s) != NULL) ++failures;
  Expect("new handler after the context is gone", s, TF_FAILED_PRECONDITION, "was deleted");
  TFOH_C_HandlerQuery(late, "total", buf, s);
  MustBeOk("query after the context is gone (allowed: the state is the handler's)", s);
  printf("ok query after the context is gone: %.*s\n", (int)buf->length, (const char*)buf->data);
  TFOH_C_DeleteHandler(late);
  TFOH_C_DeleteDispatcher(d2);

  TFE_DeleteTensorHandle(x);
  TF_DeleteBuffer(buf);
  TFOH_C_DeleteHandler(c);
  TFOH_C_DeleteHandler(b);
  TFOH_C_DeleteHandler(a);
  TFOH_C_DeleteDispatcher(d);
  TFE_DeleteContext(ctx);
  TF_DeleteStatus(s);
  printf("%s\n", failures ? "FAILED" : "OK: every bad input failed with a status");
  return failures ? 1 : 0;
}
