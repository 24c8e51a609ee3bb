// TensorFlow binding: op registrations and async kernels that hand tensors to the engine.
// Ops are stateful so TF never constant-folds, merges or prunes them (a collective must run on
// every rank even where its result is unused); kerasdist/ops.py lets tf.function run them in
// any order instead of serializing them like other stateful ops. `blocking` is true for eager
// calls, whose thread waits for that op alone: the engine uses it to tell ranks stuck in
// mismatched calls from ranks that are merely late.
#include <string>
#include <vector>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

#include "../engine/engine.h"
#ifdef KERASDIST_WITH_NCCL
#include "gpu/gpu_inputs.h"
#endif

namespace kerasdist {
namespace {

using ::tensorflow::AsyncOpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

absl::Status ToTf(const Status& s) {
  switch (s.code) {
    case StatusCode::kOk: return absl::OkStatus();
    case StatusCode::kInvalidArgument: return absl::InvalidArgumentError(s.message);
    case StatusCode::kFailedPrecondition: return absl::FailedPreconditionError(s.message);
    case StatusCode::kAborted: return absl::AbortedError(s.message);
    case StatusCode::kDeadlineExceeded: return absl::DeadlineExceededError(s.message);
    case StatusCode::kInternal: return absl::InternalError(s.message);
  }
  return absl::UnknownError(s.message);
}

bool ToEngineType(::tensorflow::DataType dtype, DataType* out) {
  switch (dtype) {
    case ::tensorflow::DT_UINT8: *out = DataType::kUInt8; return true;
    case ::tensorflow::DT_INT8: *out = DataType::kInt8; return true;
    case ::tensorflow::DT_INT32: *out = DataType::kInt32; return true;
    case ::tensorflow::DT_INT64: *out = DataType::kInt64; return true;
    case ::tensorflow::DT_HALF: *out = DataType::kFloat16; return true;
    case ::tensorflow::DT_BFLOAT16: *out = DataType::kBFloat16; return true;
    case ::tensorflow::DT_FLOAT: *out = DataType::kFloat32; return true;
    case ::tensorflow::DT_DOUBLE: *out = DataType::kFloat64; return true;
    case ::tensorflow::DT_BOOL: *out = DataType::kBool; return true;
    default: return false;
  }
}

Shape ToShape(const TensorShape& shape) {
  Shape out;
  for (int i = 0; i < shape.dims(); ++i) out.push_back(shape.dim_size(i));
  return out;
}

const void* DataOf(const Tensor& t) { return t.tensor_data().data(); }

TensorShape ToTensorShape(const Shape& shape) {
  TensorShape out;
  for (int64_t d : shape) out.AddDim(d);
  return out;
}

// A uint8 tensor lent to the engine. Fused allreduce outputs are bitcast slices of it, which
// hold references to it: it is free again once TensorFlow has dropped all of them.
class TensorFusionBuffer : public FusionBuffer {
 public:
  explicit TensorFusionBuffer(Tensor tensor) : tensor_(std::move(tensor)) {}
  char* data() override { return const_cast<char*>(tensor_.tensor_data().data()); }
  size_t size() const override { return tensor_.tensor_data().size(); }
  bool InUse() const override { return !tensor_.RefCountIsOne(); }
  const Tensor& tensor() const { return tensor_; }

 private:
  Tensor tensor_;
};

std::unique_ptr<FusionBuffer> NewFusionBuffer(size_t bytes) {
  Tensor tensor(::tensorflow::DT_UINT8, TensorShape({static_cast<int64_t>(bytes)}));
  if (!tensor.IsInitialized()) return nullptr;
  return std::make_unique<TensorFusionBuffer>(std::move(tensor));
}

const bool kFusionBuffersRegistered = [] {
  Engine::Get().SetFusionBufferFactory(NewFusionBuffer);
  return true;
}();

// Shared by every collective kernel: name resolution, request building, completion.
class CollectiveKernel : public AsyncOpKernel {
 public:
  CollectiveKernel(OpKernelConstruction* ctx, OpKind kind) : AsyncOpKernel(ctx), kind_(kind) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("blocking", &blocking_));
#ifdef KERASDIST_WITH_NCCL
    on_gpu_ = ctx->device_type() == ::tensorflow::DEVICE_GPU;
#endif
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    Request request;
    request.kind = kind_;
    // kerasdist.ops names every call; the node name serves graphs built without it.
    const std::string given(ctx->input(ctx->num_inputs() - 2).scalar<::tensorflow::tstring>()());
    request.name = given.empty() ? name() : given;
    request.execution = ctx->input(ctx->num_inputs() - 1).scalar<int64_t>()();
    request.blocking = blocking_;
    std::vector<const void*> inputs;
    std::vector<void*> outputs;
    absl::Status status = Prepare(ctx, &request, &inputs, &outputs);
    if (!status.ok()) {
      ctx->SetStatus(status);
      done();
      return;
    }
    DeviceTensors device;
#ifdef KERASDIST_WITH_NCCL
    // TensorFlow keeps int32 tensors of a GPU kernel in host memory: those go over MPI.
    if (on_gpu_ && InDeviceMemory(ctx, request.tensors.size(), &status)) {
      request.device = Device::kGpu;
      status = DescribeGpuInputs(ctx, &device);
    }
    if (!status.ok()) {
      request.error = std::string(status.message());
      Engine::Get().SubmitFailure(std::move(request));  // the other ranks fail this call too
      ctx->SetStatus(status);
      done();
      return;
    }
#endif
    // An allreduce output may take over its input's memory when nothing else reads the input.
    AllocateFn allocate = [ctx, reuse_input = kind_ == OpKind::kAllreduce](int index, const Shape& shape,
                                                                           void** data) {
      Tensor* out = nullptr;
      absl::Status s = reuse_input ? ctx->forward_input_or_allocate_output({index}, index, ToTensorShape(shape), &out)
                                   : ctx->allocate_output(index, ToTensorShape(shape), &out);
      if (!s.ok()) return Status::Internal("kerasdist: cannot allocate output: " + std::string(s.message()));
      *data = const_cast<char*>(out->tensor_data().data());
      return Status::OK();
    };
    AliasFn alias = [ctx](int index, FusionBuffer* buffer, size_t offset, const Shape& shape) {
      const Tensor& whole = static_cast<TensorFusionBuffer*>(buffer)->tensor();
      const TensorShape tf_shape = ToTensorShape(shape);
      const ::tensorflow::DataType dtype = ctx->expected_output_dtype(index);
      const int64_t bytes = tf_shape.num_elements() * ::tensorflow::DataTypeSize(dtype);
      Tensor view;
      absl::Status s = view.BitcastFrom(whole.Slice(offset, offset + bytes), dtype, tf_shape);
      if (!s.ok()) return Status::Internal("kerasdist: cannot view the fusion buffer: " + std::string(s.message()));
      ctx->set_output(index, view);
      return Status::OK();
    };
    DoneFn on_done = [ctx, done](const Status& s) {
      if (!s.ok()) ctx->SetStatus(ToTf(s));
      done();
    };
    Status enqueued = Engine::Get().Enqueue(std::move(request), std::move(inputs), std::move(outputs),
                                            std::move(allocate), std::move(alias), std::move(on_done),
                                            std::move(device));
    if (!enqueued.ok()) {
      ctx->SetStatus(ToTf(enqueued));
      done();
    }
  }

 protected:
  // Fills the request's op-specific fields and the buffers known before negotiation.
  virtual absl::Status Prepare(OpKernelContext* ctx, Request* request, std::vector<const void*>* inputs,
                               std::vector<void*>* outputs) = 0;

  absl::Status AddTensor(OpKernelContext* ctx, int index, Request* request, std::vector<const void*>* inputs) {
    const Tensor& t = ctx->input(index);
    TensorSpec spec;
    if (!ToEngineType(t.dtype(), &spec.dtype)) {
      return absl::InvalidArgumentError("kerasdist: unsupported dtype " + ::tensorflow::DataTypeString(t.dtype()));
    }
    spec.shape = ToShape(t.shape());
    spec.wire = spec.dtype;
    request->tensors.push_back(spec);
    inputs->push_back(DataOf(t));
    return absl::OkStatus();
  }

#ifdef KERASDIST_WITH_NCCL
  // True when the first `count` inputs are all in device memory, false when all are in host
  // memory; a group that mixes the two is an error in `*status`.
  static bool InDeviceMemory(OpKernelContext* ctx, size_t count, absl::Status* status) {
    size_t on_host = 0;
    for (size_t i = 0; i < count; ++i) on_host += ctx->input_memory_type(i) == ::tensorflow::HOST_MEMORY;
    if (on_host > 0 && on_host < count) {
      *status = absl::InvalidArgumentError(
          "kerasdist: a group of GPU tensors mixes int32 ones, which TensorFlow keeps in host memory, with "
          "tensors in device memory; reduce the int32 tensors in a group of their own");
    }
    return on_host == 0;
  }
#endif

  absl::Status OutputLikeInput(OpKernelContext* ctx, int index, std::vector<void*>* outputs) {
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->forward_input_or_allocate_output({index}, index, ctx->input(index).shape(), &out));
    outputs->push_back(const_cast<char*>(out->tensor_data().data()));
    return absl::OkStatus();
  }

 private:
  OpKind kind_;
  bool blocking_ = false;
#ifdef KERASDIST_WITH_NCCL
  bool on_gpu_ = false;
#endif
};

// Inputs end with (..., prescale_factor, postscale_factor, tensor_name, execution). The factors
// are float64 tensors, not float attrs, so float64 data is scaled exactly.
class ReducingKernel : public CollectiveKernel {
 public:
  static constexpr int kTrailingInputs = 4;

  ReducingKernel(OpKernelConstruction* ctx, OpKind kind) : CollectiveKernel(ctx, kind) {
    int op = 0;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("reduce_op", &op));
    OP_REQUIRES(ctx, op >= 0 && op <= static_cast<int>(ReduceOp::kProduct),
                absl::InvalidArgumentError("kerasdist: unknown reduce_op " + std::to_string(op)));
    reduce_op_ = static_cast<ReduceOp>(op);
  }

 protected:
  void SetReduction(OpKernelContext* ctx, Request* request) const {
    request->reduce_op = reduce_op_;
    request->prescale = ctx->input(ctx->num_inputs() - 4).scalar<double>()();
    request->postscale = ctx->input(ctx->num_inputs() - 3).scalar<double>()();
  }

 private:
  ReduceOp reduce_op_;
};

class AllreduceKernel : public ReducingKernel {
 public:
  explicit AllreduceKernel(OpKernelConstruction* ctx) : ReducingKernel(ctx, OpKind::kAllreduce) {
    std::vector<int> wire;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("wire_dtypes", &wire));
    for (int w : wire) {
      OP_REQUIRES(ctx, w == static_cast<int>(DataType::kFloat16) || w == static_cast<int>(DataType::kBFloat16),
                  absl::InvalidArgumentError("kerasdist: a wire dtype must be float16 or bfloat16"));
      wire_.push_back(static_cast<DataType>(w));
    }
  }

 protected:
  absl::Status Prepare(OpKernelContext* ctx, Request* request, std::vector<const void*>* inputs,
                       std::vector<void*>* outputs) override {
    SetReduction(ctx, request);
    for (int i = 0; i < ctx->num_inputs() - kTrailingInputs; ++i) {
      TF_RETURN_IF_ERROR(AddTensor(ctx, i, request, inputs));
      TensorSpec& spec = request->tensors.back();
      // Compression applies to float32 and float64; a 16-bit or integer tensor goes as it is.
      if (i < static_cast<int>(wire_.size()) && (spec.dtype == DataType::kFloat32 || spec.dtype == DataType::kFloat64)) {
        spec.wire = wire_[i];
      }
    }
    return absl::OkStatus();  // outputs come when the engine runs it: own memory or a fused view
  }

 private:
  std::vector<DataType> wire_;  // per tensor: the 16-bit type it travels in; empty: uncompressed
};

class AllgatherKernel : public CollectiveKernel {
 public:
  explicit AllgatherKernel(OpKernelConstruction* ctx) : CollectiveKernel(ctx, OpKind::kAllgather) {}

 protected:
  absl::Status Prepare(OpKernelContext* ctx, Request* request, std::vector<const void*>* inputs,
                       std::vector<void*>*) override {
    return AddTensor(ctx, 0, request, inputs);
  }
};

class BroadcastKernel : public CollectiveKernel {
 public:
  explicit BroadcastKernel(OpKernelConstruction* ctx) : CollectiveKernel(ctx, OpKind::kBroadcast) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("root_rank", &root_rank_));
  }

 protected:
  absl::Status Prepare(OpKernelContext* ctx, Request* request, std::vector<const void*>* inputs,
                       std::vector<void*>* outputs) override {
    request->root_rank = root_rank_;
    TF_RETURN_IF_ERROR(AddTensor(ctx, 0, request, inputs));
    return OutputLikeInput(ctx, 0, outputs);
  }

 private:
  int root_rank_ = 0;
};

class ReducescatterKernel : public ReducingKernel {
 public:
  explicit ReducescatterKernel(OpKernelConstruction* ctx) : ReducingKernel(ctx, OpKind::kReducescatter) {}

 protected:
  absl::Status Prepare(OpKernelContext* ctx, Request* request, std::vector<const void*>* inputs,
                       std::vector<void*>* outputs) override {
    SetReduction(ctx, request);
    TF_RETURN_IF_ERROR(AddTensor(ctx, 0, request, inputs));
    TensorShape shape = ctx->input(0).shape();
    if (shape.dims() == 0) return absl::OkStatus();  // the engine names the error
    const int64_t rows = shape.dim_size(0), size = Engine::Get().size(), rank = Engine::Get().rank();
    shape.set_dim(0, rows / size + (rank < rows % size ? 1 : 0));  // lower ranks take the remainder
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, shape, &out));
    outputs->push_back(const_cast<char*>(out->tensor_data().data()));
    return absl::OkStatus();
  }
};

class AlltoallKernel : public CollectiveKernel {
 public:
  explicit AlltoallKernel(OpKernelConstruction* ctx) : CollectiveKernel(ctx, OpKind::kAlltoall) {}

 protected:
  absl::Status Prepare(OpKernelContext* ctx, Request* request, std::vector<const void*>* inputs,
                       std::vector<void*>*) override {
    TF_RETURN_IF_ERROR(AddTensor(ctx, 0, request, inputs));
    const Tensor& splits = ctx->input(1);
    auto values = splits.flat<int32_t>();
    for (int64_t i = 0; i < values.size(); ++i) request->splits.push_back(values(i));
    return absl::OkStatus();
  }
};

// Counts the calls of one tf.function on this rank (the `function` attr names it): the front end
// adds one to every traced function that holds a collective, and its collectives carry the
// count, so the engine can tell one call's requests from the next call's.
class ExecutionCountKernel : public ::tensorflow::OpKernel {
 public:
  explicit ExecutionCountKernel(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("function", &function_));
  }

  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = Engine::Get().NextExecution(function_);
  }

 private:
  std::string function_;
};

absl::Status SameShape(InferenceContext* c) {
  for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->input(i));
  return absl::OkStatus();
}

absl::Status UnknownFirstDim(InferenceContext* c) {
  ShapeHandle out;
  TF_RETURN_IF_ERROR(c->ReplaceDim(c->input(0), 0, c->UnknownDim(), &out));
  c->set_output(0, out);
  return absl::OkStatus();
}

}  // namespace
}  // namespace kerasdist

#define KD_NUMERIC "{uint8, int8, int32, int64, half, bfloat16, float, double}"
#define KD_ANY "{uint8, int8, int32, int64, half, bfloat16, float, double, bool}"

REGISTER_OP("KerasdistAllreduce")
    .Attr("blocking: bool = false")
    .Attr("wire_dtypes: list(int) = []")
    .Attr("T: list(" KD_NUMERIC ")")
    .Attr("reduce_op: int")
    .Input("tensors: T")
    .Input("prescale_factor: double")
    .Input("postscale_factor: double")
    .Input("tensor_name: string")
    .Input("execution: int64")
    .Output("outputs: T")
    .SetIsStateful()
    .SetShapeFn(kerasdist::SameShape)
    .Doc("Reduces each tensor across ranks as one negotiation and fusion unit.");

REGISTER_OP("KerasdistAllgather")
    .Attr("blocking: bool = false")
    .Attr("T: " KD_ANY)
    .Input("tensor: T")
    .Input("tensor_name: string")
    .Input("execution: int64")
    .Output("output: T")
    .SetIsStateful()
    .SetShapeFn(kerasdist::UnknownFirstDim)
    .Doc("Concatenates every rank's tensor along dim 0, in rank order.");

REGISTER_OP("KerasdistBroadcast")
    .Attr("blocking: bool = false")
    .Attr("T: " KD_ANY)
    .Attr("root_rank: int")
    .Input("tensor: T")
    .Input("tensor_name: string")
    .Input("execution: int64")
    .Output("output: T")
    .SetIsStateful()
    .SetShapeFn(kerasdist::SameShape)
    .Doc("Every rank receives root_rank's tensor.");

REGISTER_OP("KerasdistReducescatter")
    .Attr("blocking: bool = false")
    .Attr("T: " KD_NUMERIC)
    .Attr("reduce_op: int")
    .Input("tensor: T")
    .Input("prescale_factor: double")
    .Input("postscale_factor: double")
    .Input("tensor_name: string")
    .Input("execution: int64")
    .Output("output: T")
    .SetIsStateful()
    .SetShapeFn(kerasdist::UnknownFirstDim)
    .Doc("Reduces across ranks; each rank keeps its dim-0 shard (lower ranks take the remainder).");

REGISTER_OP("KerasdistAlltoall")
    .Attr("blocking: bool = false")
    .Attr("T: " KD_ANY)
    .Input("tensor: T")
    .Input("splits: int32")
    .Input("tensor_name: string")
    .Input("execution: int64")
    .Output("output: T")
    .Output("received_splits: int32")
    .SetIsStateful()
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      TF_RETURN_IF_ERROR(kerasdist::UnknownFirstDim(c));
      c->set_output(1, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc("Sends splits[j] rows to rank j; returns the rows received, in source-rank order.");

REGISTER_OP("KerasdistExecutionCount")
    .Attr("function: string")
    .Output("count: int64")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc("How many calls of the named tf.function this rank made before this one.");

REGISTER_KERNEL_BUILDER(Name("KerasdistExecutionCount").Device(::tensorflow::DEVICE_CPU),
                        kerasdist::ExecutionCountKernel);
REGISTER_KERNEL_BUILDER(Name("KerasdistAllreduce").Device(::tensorflow::DEVICE_CPU), kerasdist::AllreduceKernel);
REGISTER_KERNEL_BUILDER(Name("KerasdistAllgather").Device(::tensorflow::DEVICE_CPU), kerasdist::AllgatherKernel);
REGISTER_KERNEL_BUILDER(Name("KerasdistBroadcast").Device(::tensorflow::DEVICE_CPU), kerasdist::BroadcastKernel);
REGISTER_KERNEL_BUILDER(Name("KerasdistReducescatter").Device(::tensorflow::DEVICE_CPU), kerasdist::ReducescatterKernel);
REGISTER_KERNEL_BUILDER(Name("KerasdistAlltoall").Device(::tensorflow::DEVICE_CPU), kerasdist::AlltoallKernel);

#ifdef KERASDIST_WITH_NCCL
// The same kernels on GPU tensors; names, scale factors and splits stay in host memory.
REGISTER_KERNEL_BUILDER(Name("KerasdistAllreduce")
                            .Device(::tensorflow::DEVICE_GPU)
                            .HostMemory("prescale_factor")
                            .HostMemory("postscale_factor")
                            .HostMemory("tensor_name").HostMemory("execution"),
                        kerasdist::AllreduceKernel);
REGISTER_KERNEL_BUILDER(Name("KerasdistAllgather").Device(::tensorflow::DEVICE_GPU).HostMemory("tensor_name").HostMemory("execution"),
                        kerasdist::AllgatherKernel);
REGISTER_KERNEL_BUILDER(Name("KerasdistBroadcast").Device(::tensorflow::DEVICE_GPU).HostMemory("tensor_name").HostMemory("execution"),
                        kerasdist::BroadcastKernel);
REGISTER_KERNEL_BUILDER(Name("KerasdistReducescatter")
                            .Device(::tensorflow::DEVICE_GPU)
                            .HostMemory("prescale_factor")
                            .HostMemory("postscale_factor")
                            .HostMemory("tensor_name").HostMemory("execution"),
                        kerasdist::ReducescatterKernel);
REGISTER_KERNEL_BUILDER(Name("KerasdistAlltoall")
                            .Device(::tensorflow::DEVICE_GPU)
                            .HostMemory("splits")
                            .HostMemory("tensor_name").HostMemory("execution")
                            .HostMemory("received_splits"),
                        kerasdist::AlltoallKernel);
#endif
