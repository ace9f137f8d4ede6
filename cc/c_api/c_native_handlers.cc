// tf-ophandlers: the package's own handlers (native_handlers.cc: PassThrough, OpCounter)
// built into libtf_ophandlers_c.so, so a C program gets them without locating the Python
// package's _native_handlers*.so (whose name carries the interpreter's extension suffix).
// The entry point is renamed: this library is not itself a handler library.
#define TFOH_InitHandlerLibrary TFOH_C_InitNativeHandlers
#include "native/native_handlers.cc"
