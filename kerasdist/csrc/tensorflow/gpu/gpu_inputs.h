// The GPU half of the TensorFlow binding (KERASDIST_WITH_NCCL=1 builds only).
#pragma once

#include "tensorflow/core/framework/op_kernel.h"

#include "../../engine/collective.h"

namespace kerasdist {

// Fills `device` for a GPU kernel's tensors: their CUDA device, and a wait on an event that
// is recorded now on TensorFlow's stream, after the work that produces the inputs, so the
// engine reads them only once they are written.
absl::Status DescribeGpuInputs(::tensorflow::OpKernelContext* ctx, DeviceTensors* device);

}  // namespace kerasdist
