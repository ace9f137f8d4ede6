/* tf-ophandlers: the flat output dtypes TensorFlow's OpDef implies for an op (internal
   header). Implementation: op_outputs.cc. No Python: shared by the Python extension
   (_C.so: output validation, op.h) and the C API's runtime (libtf_ophandlers_c.so).
*/
#ifndef TF_OPHANDLERS_OP_OUTPUTS_H_
#define TF_OPHANDLERS_OP_OUTPUTS_H_

#include <vector>

#include "absl/container/inlined_vector.h"
#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/tf_datatype.h"

namespace tf_ophandlers {

// Appends to `dtypes` the flat output dtypes TensorFlow's OpDef implies for `op` with its
// attributes, or returns false when they cannot be known (function call ops, attributes
// missing). `op` is borrowed. GIL: not needed. Never sets a Python exception.
bool ExpectedOutputs(const TFE_Op* op, std::vector<TF_DataType>* dtypes);
// The same into an inline vector (no heap allocation for up to 4 outputs: the native
// per-op path).
bool ExpectedOutputs(const TFE_Op* op, absl::InlinedVector<TF_DataType, 4>* dtypes);

// Whether `type` is an op registered with TensorFlow (it has an OpDef); false for a
// function call op (named after its function). GIL: not needed. Never fails.
bool IsRegisteredOpType(const char* type);

}  // namespace tf_ophandlers

#endif  // TF_OPHANDLERS_OP_OUTPUTS_H_
