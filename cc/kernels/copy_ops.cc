// tf-ophandlers: the copy ops of the RFC ("Copies and their gradients").
//
// CopyOn(input) -> output             moves a tensor onto a handler stack.
// CopyOnGrad(dcopied) -> output       its gradient; attr original_device names where the
//                                     forward input lived.
// CopyOff(input) -> output            moves a tensor off a handler stack to new_device.
// CopyOffGrad(dcopied) -> output      its gradient.
//
// Gradients (registered in tf_ophandlers/core/copies.py): d CopyOn = CopyOnGrad,
// d CopyOnGrad = CopyOn, d CopyOff = CopyOffGrad, d CopyOffGrad = CopyOff. On a physical
// device every copy op is the identity, which is what these kernels compute; a handler
// gives them their meaning (a parallel handler's CopyOn broadcasts, its CopyOnGrad sums).
// The shape of every output equals the shape of its input: copies are linear maps that
// do not change the logical tensor.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/errors.h"

namespace tf_ophandlers {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;

class IdentityCopyKernel : public OpKernel {
 public:
  explicit IdentityCopyKernel(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    ctx->set_output(0, ctx->input(0));
  }
  bool IsExpensive() override { return false; }
};

REGISTER_OP("CopyOn")
    .Input("input: T")
    .Output("output: T")
    .Attr("T: type")
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("Copies `input` onto the handler stack the op runs on (tf-ophandlers).");

REGISTER_OP("CopyOnGrad")
    .Input("dcopied: T")
    .Output("output: T")
    .Attr("T: type")
    .Attr("original_device: string = ''")
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("Gradient of CopyOn: maps a gradient back to `original_device` (tf-ophandlers).");

REGISTER_OP("CopyOff")
    .Input("input: T")
    .Output("output: T")
    .Attr("T: type")
    .Attr("new_device: string = ''")
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("Copies a handler tensor off its stack to `new_device` (tf-ophandlers).");

REGISTER_OP("CopyOffGrad")
    .Input("dcopied: T")
    .Output("output: T")
    .Attr("T: type")
    .Attr("original_device: string = ''")
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("Gradient of CopyOff (tf-ophandlers).");

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

REGISTER_KERNEL_BUILDER(Name("CopyOn").Device(::tensorflow::DEVICE_CPU), IdentityCopyKernel);
REGISTER_KERNEL_BUILDER(Name("CopyOnGrad").Device(::tensorflow::DEVICE_CPU), IdentityCopyKernel);
REGISTER_KERNEL_BUILDER(Name("CopyOff").Device(::tensorflow::DEVICE_CPU), IdentityCopyKernel);
REGISTER_KERNEL_BUILDER(Name("CopyOffGrad").Device(::tensorflow::DEVICE_CPU), IdentityCopyKernel);

}  // namespace
}  // namespace tf_ophandlers
