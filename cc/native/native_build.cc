// tf-ophandlers: ABI version 3's op building (TFOH_RuntimeApi op_new .. op_set_attr_tensor):
// ops a native handler's hook makes and runs on the next stack with execute_next.
// Contracts: native_internal.h and include/tf_ophandlers/handler.h.
#define PY_SSIZE_T_CLEAN
#include "native/native_internal.h"

#include <string>

#include "boundary/op.h"
#include "boundary/runtime.h"

namespace tf_ophandlers {
namespace native_internal {

TFOH_Op* ApiOpNew(TFOH_Context* ctx, const char* type, TF_Status* status) {
  if (ctx == nullptr || type == nullptr || !IsRegisteredOpType(type)) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 (std::string("tf_ophandlers: op_new: ") +
                  (type == nullptr ? "no op type"
                   : ctx == nullptr ? "no context"
                                    : std::string("unknown op type ") + type +
                                          " (not a registered TensorFlow op)"))
                     .c_str());
    return nullptr;
  }
  TFE_Op* tfe = TFE_NewOp(g_ctx, type, status);
  if (TF_GetCode(status) != TF_OK) {
    if (tfe != nullptr) TFE_DeleteOp(tfe);
    return nullptr;
  }
  const char* name = TFE_OpGetName(tfe, status);  // valid while `tfe` lives
  if (TF_GetCode(status) != TF_OK) {
    TFE_DeleteOp(tfe);
    return nullptr;
  }
  auto* op = new TFOH_Op{tfe, nullptr, name, "", -1};
  op->built = tfe;
  return op;
}

void ApiOpDelete(TFOH_Op* op) {
  if (op == nullptr || op->built == nullptr) return;  // not a built op: not the handler's
  TFE_DeleteOp(op->built);
  delete op;
}

// The setters write only into built ops (a hook's own op is borrowed and read-only).
void ApiOpSetAttrType(TFOH_Op* op, const char* name, TF_DataType value) {
  if (op != nullptr && op->built != nullptr) TFE_OpSetAttrType(op->built, name, value);
}

void ApiOpSetAttrInt(TFOH_Op* op, const char* name, int64_t value) {
  if (op != nullptr && op->built != nullptr) TFE_OpSetAttrInt(op->built, name, value);
}

void ApiOpSetAttrFloat(TFOH_Op* op, const char* name, float value) {
  if (op != nullptr && op->built != nullptr) TFE_OpSetAttrFloat(op->built, name, value);
}

void ApiOpSetAttrBool(TFOH_Op* op, const char* name, unsigned char value) {
  if (op != nullptr && op->built != nullptr) TFE_OpSetAttrBool(op->built, name, value);
}

void ApiOpSetAttrTensor(TFOH_Op* op, const char* name, TF_Tensor* value, TF_Status* status) {
  if (op == nullptr || op->built == nullptr || value == nullptr) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 "tf_ophandlers: op_set_attr_tensor: needs an op from op_new and a tensor");
    return;
  }
  TFE_OpSetAttrTensor(op->built, name, value, status);  // TensorFlow copies the tensor
}

bool ResolveBuiltOp(const TFOH_Op* op, TFOH_Op* resolved, TF_Status* status) {
  *resolved = *op;
  if (op->built == nullptr) return true;
  absl::InlinedVector<TF_DataType, 4> want;
  if (!ExpectedOutputs(op->tfe, &want)) {
    TF_SetStatus(status, TF_INVALID_ARGUMENT,
                 (std::string("tf_ophandlers: execute_next: the outputs of the built op ") +
                  op->type +
                  " are not known: set every attribute its OpDef has without a default, "
                  "type attributes (e.g. \"T\") too")
                     .c_str());
    return false;
  }
  resolved->num_outputs = static_cast<int>(want.size());
  return true;
}

}  // namespace native_internal
}  // namespace tf_ophandlers
