/* tf-ophandlers C++ boundary: what native_library.cc and native_type.cc need for the
   hooks ABI version 2 added (include/tf_ophandlers/handler.h); internal header.
   Implementation: native_hooks.cc.

   - Versioning: which abi_versions the runtime accepts, and how many bytes of a
     library's TFOH_HandlerType it reads (fields of later versions stay NULL).
   - StaticValue: turning the TF_Tensor a static_value hook returned into the
     EagerTensor Python reads (`_oh_static_value`), with its checks.
*/
#ifndef TF_OPHANDLERS_NATIVE_HOOKS_H_
#define TF_OPHANDLERS_NATIVE_HOOKS_H_

#include <Python.h>

#include <cstddef>
#include <string>

#include "tf_ophandlers/handler.h"

namespace tf_ophandlers {

// Whether the runtime knows `abi_version` (1 .. TFOH_ABI_VERSION). Never fails.
bool KnownAbiVersion(int abi_version);

// The text of register_type's error for an unknown abi_version.
std::string UnknownAbiVersionMessage(int abi_version);

// How many leading bytes of `type` the runtime copies: its struct_size, at most the size
// its abi_version defines and at most sizeof(TFOH_HandlerType). `abi_version` must be
// known. Never fails.
size_t HandlerTypeBytes(const TFOH_HandlerType* type);

// Calls `hook` (a type's static_value) on `value` and returns what `_oh_static_value`
// returns: None when the hook says unknown, else a new EagerTensor holding its TF_Tensor
// (whose dtype must be `dtype`). On failure returns null with a Python exception set
// whose message starts with "tf_ophandlers: <handler>.static_value failed: " (the hook's
// status keeps its code). GIL: held; the hook runs with it (handler.h).
PyObject* CallStaticValueHook(int (*hook)(void*, const TFOH_Tensor*, TF_Tensor**, TF_Status*),
                              void* state, const TFOH_Tensor* value, TF_DataType dtype,
                              const std::string& handler);

}  // namespace tf_ophandlers

#endif  // TF_OPHANDLERS_NATIVE_HOOKS_H_
