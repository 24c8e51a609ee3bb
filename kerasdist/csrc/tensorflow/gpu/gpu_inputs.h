// The GPU half of the TensorFlow binding (KERASDIST_WITH_NCCL=1 builds only).
#pragma once

#include "tensorflow/core/framework/op_kernel.h"

#include "../../engine/collective.h"

namespace kerasdist {

// Fills `device` for a GPU kernel's tensors: their CUDA device, and a wait on an event that is
// recorded on TensorFlow's stream each time the engine calls it, so the engine reads inputs only
// once their producers have written them, and writes outputs only once memory that TensorFlow's
// allocator reused is no longer read by kernels queued before.
absl::Status DescribeGpuInputs(::tensorflow::OpKernelContext* ctx, DeviceTensors* device);

}  // namespace kerasdist
