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

REGISTER_KERNEL_BUILDER(Name("CopyOn").Device(::tensorflow::DEVICE_CPU), IdentityCopyKernel);
REGISTER_KERNEL_BUILDER(Name("CopyOnGrad").Device(::tensorflow::DEVICE_CPU), IdentityCopyKernel);
REGISTER_KERNEL_BUILDER(Name("CopyOff").Device(::tensorflow::DEVICE_CPU), IdentityCopyKernel);
REGISTER_KERNEL_BUILDER(Name("CopyOffGrad").Device(::tensorflow::DEVICE_CPU), IdentityCopyKernel);

}  // namespace
}  // namespace tf_ophandlers
