#include "gpu_inputs.h"

#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "xla/stream_executor/stream.h"
#include "xla/stream_executor/stream_executor.h"

#include "../../engine/engine.h"
#include "../../nccl/nccl_device.h"

namespace kerasdist {
namespace {

absl::Status CudaError(cudaError_t result, const char* what) {
  return absl::InternalError(std::string("kerasdist: ") + what + " failed in CUDA: " + cudaGetErrorString(result));
}

const bool kDeviceHooksRegistered = [] {
  Engine::Get().SetDeviceHooks(NcclDeviceHooks());
  return true;
}();

}  // namespace

absl::Status DescribeGpuInputs(::tensorflow::OpKernelContext* ctx, DeviceTensors* device) {
  ::stream_executor::Stream* stream = ctx->op_device_context() ? ctx->op_device_context()->stream() : nullptr;
  if (!stream) return absl::InternalError("kerasdist: a GPU kernel ran without a TensorFlow stream");
  // The stream executor's ordinal is the CUDA device's (TensorFlow's own GPU ids may be remapped).
  device->ordinal = stream->parent()->device_ordinal();
  auto tf_stream = static_cast<cudaStream_t>(stream->platform_specific_handle().stream);
  cudaError_t result = cudaSetDevice(device->ordinal);  // events belong to the current device
  if (result != cudaSuccess) return CudaError(result, "selecting the op's GPU");
  cudaEvent_t event = nullptr;
  result = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (result != cudaSuccess) return CudaError(result, "creating an event");
  // Destroyed with the collective, whether or not it ever ran.
  std::shared_ptr<CUevent_st> reached(event, [](cudaEvent_t e) { cudaEventDestroy(e); });
  // Recorded when the engine calls, not here: by then TensorFlow's stream also holds the last
  // users of any memory its allocator has since handed out for this op's outputs.
  device->wait_for_framework = [reached, tf_stream](void* engine_stream) {
    cudaError_t result = cudaEventRecord(reached.get(), tf_stream);
    if (result == cudaSuccess) result = cudaStreamWaitEvent(static_cast<cudaStream_t>(engine_stream), reached.get(), 0);
    if (result == cudaSuccess) return Status::OK();
    return Status::Internal(std::string("kerasdist: ordering after TensorFlow's stream failed in CUDA: ") +
                            cudaGetErrorString(result));
  };
  return absl::OkStatus();
}

}  // namespace kerasdist
