// The backend for device memory: NCCL on a communicator of its own, on a CUDA stream of its
// own. Each call returns once its result is in device memory (the stream is synchronized), so
// the engine's watchdog sees a call that never finishes exactly as it does an MPI one.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <vector>

#include "../engine/backend.h"

namespace kerasdist {

class NcclBackend : public Backend {
 public:
  // `comm` and `stream` stay the caller's; `size` is the number of ranks in `comm`.
  NcclBackend(ncclComm_t comm, cudaStream_t stream, int size);

  // NCCL scales in its reduction (ncclAvg, or a pre-multiplied sum): no pass of the caller's.
  bool ScalesWhileCombining(DataType) const override { return true; }
  Status Allreduce(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op, double scale,
                   const std::string& name) override;
  Status Allgather(const void* in, void* out, const std::vector<int64_t>& counts, DataType dtype,
                   const std::string& name) override;
  Status Broadcast(void* data, int64_t count, DataType dtype, int root, const std::string& name) override;
  Status ReduceScatter(const void* in, void* out, const std::vector<int64_t>& counts, DataType dtype, ReduceOp op,
                       double scale, const std::string& name) override;
  Status Alltoall(const void* in, const std::vector<int64_t>& send_counts, void* out,
                  const std::vector<int64_t>& recv_counts, DataType dtype, const std::string& name) override;

  // Why NCCL cannot run a reduction with these scale factors, or "" when it can.
  static std::string UnsupportedScaling(ReduceOp op, double prescale, double postscale);

 private:
  // The NCCL reduction for (op, scale), `scale` as the engine passes it (a float Average's
  // division is in it): ncclAvg when that is exactly 1/size, a plain reduction when it is 1,
  // else a pre-multiplied sum, which `*created` says the caller must destroy.
  Status Reduction(DataType dtype, ReduceOp op, double scale, ncclRedOp_t* reduction, bool* created,
                   const std::string& name);
  // Waits for what the calls enqueued, and turns NCCL's or CUDA's failure into a status.
  Status Finish(ncclResult_t enqueued, const char* what, const std::string& name);

  ncclComm_t comm_;
  cudaStream_t stream_;
  int size_;
};

// OK, or an Internal error naming the call and the collective with NCCL's (or CUDA's) text.
Status NcclStatus(ncclResult_t result, const char* what, const std::string& name);
Status CudaStatus(cudaError_t result, const char* what, const std::string& name);

}  // namespace kerasdist
