// Two kernels that do nothing but hand their input on, for benchmarks/op_floor.py: what
// TensorFlow itself costs per op in a chain, for a synchronous kernel and for an asynchronous
// one that completes at once (the kind kerasdist's collectives are), before any communication.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace {

using ::tensorflow::AsyncOpKernel;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelContext;

class ForwardKernel : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override { ctx->set_output(0, ctx->input(0)); }
};

class ForwardAsyncKernel : public AsyncOpKernel {
 public:
  using AsyncOpKernel::AsyncOpKernel;
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    ctx->set_output(0, ctx->input(0));
    done();
  }
};

}  // namespace

// Stateful, as kerasdist's ops are, so that TensorFlow neither folds nor merges them.
REGISTER_OP("KerasdistFloorForward")
    .Input("x: float")
    .Output("y: float")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape);
REGISTER_OP("KerasdistFloorForwardAsync")
    .Input("x: float")
    .Output("y: float")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape);
REGISTER_KERNEL_BUILDER(Name("KerasdistFloorForward").Device(::tensorflow::DEVICE_CPU), ForwardKernel);
REGISTER_KERNEL_BUILDER(Name("KerasdistFloorForwardAsync").Device(::tensorflow::DEVICE_CPU), ForwardAsyncKernel);
