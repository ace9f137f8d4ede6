// tf-ophandlers: the handler-specific ops of oh.ParallelHandler, in the `_copy_ops` op
// library next to the copy ops (cc/kernels/copy_ops.cc).
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/errors.h"

namespace tf_ophandlers {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;

// Handler-specific ops of oh.ParallelHandler (RFC "Handler-specific operations").
// ParallelPack(inputs: N x T) -> output: one tensor of the parallel handler whose
//   component i is inputs[i]; ParallelUnpack(input) -> N outputs, its components.
// They only have a meaning on a parallel handler, which executes them itself; the CPU
// kernels exist so that TensorFlow accepts the ops, and fail with an explanation.
// Gradients (tf_ophandlers/handlers/parallel/handler.py): d Pack = Unpack, d Unpack = Pack.
REGISTER_OP("ParallelPack")
    .Input("inputs: N * T")
    .Output("output: T")
    .Attr("N: int >= 1")
    .Attr("T: type")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      return ::tensorflow::OkStatus();
    })
    .Doc("Packs N per-device tensors into one tensor of an oh.ParallelHandler.");

REGISTER_OP("ParallelUnpack")
    .Input("input: T")
    .Output("outputs: N * T")
    .Attr("N: int >= 1")
    .Attr("T: type")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->input(0));
      return ::tensorflow::OkStatus();
    })
    .Doc("The N per-device components of a tensor of an oh.ParallelHandler.");

class ParallelOnlyKernel : public OpKernel {
 public:
  explicit ParallelOnlyKernel(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    ctx->CtxFailure(::tensorflow::errors::FailedPrecondition(
        type_string(), " runs only on an oh.ParallelHandler stack (use parallel.pack / "
        "parallel.unpack, which place it there)"));
  }
};

REGISTER_KERNEL_BUILDER(Name("ParallelPack").Device(::tensorflow::DEVICE_CPU), ParallelOnlyKernel);
REGISTER_KERNEL_BUILDER(Name("ParallelUnpack").Device(::tensorflow::DEVICE_CPU), ParallelOnlyKernel);

}  // namespace
}  // namespace tf_ophandlers
