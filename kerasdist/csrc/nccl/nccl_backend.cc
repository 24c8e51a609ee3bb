#include "nccl_backend.h"

#include "../engine/half.h"

namespace kerasdist {
namespace {

ncclDataType_t ToNccl(DataType dtype) {
  switch (dtype) {
    case DataType::kUInt8: return ncclUint8;
    case DataType::kInt8: return ncclInt8;
    case DataType::kInt32: return ncclInt32;
    case DataType::kInt64: return ncclInt64;
    case DataType::kFloat16: return ncclFloat16;
    case DataType::kBFloat16: return ncclBfloat16;
    case DataType::kFloat32: return ncclFloat32;
    case DataType::kFloat64: return ncclFloat64;
    case DataType::kBool: return ncclUint8;  // only moved, never reduced
  }
  return ncclUint8;
}

ncclRedOp_t PlainReduction(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kProduct: return ncclProd;
    case ReduceOp::kSum: case ReduceOp::kAverage: return ncclSum;  // Average's division is the scale's
  }
  return ncclSum;
}

bool IsSumLike(ReduceOp op) { return op == ReduceOp::kSum || op == ReduceOp::kAverage; }

const char* At(const void* base, int64_t elements, DataType dtype) {
  return static_cast<const char*>(base) + elements * static_cast<int64_t>(DataTypeSize(dtype));
}
char* At(void* base, int64_t elements, DataType dtype) {
  return static_cast<char*>(base) + elements * static_cast<int64_t>(DataTypeSize(dtype));
}

bool AllEqual(const std::vector<int64_t>& counts) {
  for (int64_t c : counts) {
    if (c != counts[0]) return false;
  }
  return true;
}

}  // namespace

Status NcclStatus(ncclResult_t result, const char* what, const std::string& name) {
  if (result == ncclSuccess) return Status::OK();
  return Status::Internal(std::string("kerasdist: ") + what + " of '" + name + "' failed in NCCL: " +
                          ncclGetErrorString(result));
}

Status CudaStatus(cudaError_t result, const char* what, const std::string& name) {
  if (result == cudaSuccess) return Status::OK();
  return Status::Internal(std::string("kerasdist: ") + what + " of '" + name + "' failed in CUDA: " +
                          cudaGetErrorString(result));
}

NcclBackend::NcclBackend(ncclComm_t comm, cudaStream_t stream, int size)
    : comm_(comm), stream_(stream), size_(size) {}

std::string NcclBackend::UnsupportedScaling(ReduceOp op, double prescale, double postscale) {
  if (IsSumLike(op) || (prescale == 1.0 && postscale == 1.0)) return "";
  return std::string("prescale/postscale factors with ") + ReduceOpName(op) +
         " are not supported for GPU tensors (NCCL scales only sums); scale the tensor before or after";
}

Status NcclBackend::Reduction(DataType dtype, ReduceOp op, double scale, ncclRedOp_t* reduction, bool* created,
                              const std::string& name) {
  *created = false;
  const bool floating = IsFloatingPoint(dtype);
  // Integers take no scale factors (the engine refuses them), so their Average is NCCL's too.
  if (op == ReduceOp::kAverage && (!floating || scale == 1.0 / size_)) {
    *reduction = ncclAvg;
    return Status::OK();
  }
  if (scale == 1.0) {
    *reduction = PlainReduction(op);
    return Status::OK();
  }
  if (!IsSumLike(op) || !floating) {
    return Status::InvalidArgument(std::string("kerasdist: '") + name + "': a scaled " + ReduceOpName(op) + " of " +
                                   DataTypeName(dtype) + " is not supported for GPU tensors");
  }
  // NCCL reads the scalar in the data's own type.
  union {
    double f64;
    float f32;
    uint16_t f16;
  } scalar;
  switch (dtype) {
    case DataType::kFloat16: scalar.f16 = FloatToHalf(static_cast<float>(scale)); break;
    case DataType::kBFloat16: scalar.f16 = FloatToBFloat16(static_cast<float>(scale)); break;
    case DataType::kFloat32: scalar.f32 = static_cast<float>(scale); break;
    default: scalar.f64 = scale; break;
  }
  Status s = NcclStatus(ncclRedOpCreatePreMulSum(reduction, &scalar, ToNccl(dtype), ncclScalarHostImmediate, comm_),
                        "creating the scaled sum", name);
  *created = s.ok();
  return s;
}

Status NcclBackend::Finish(ncclResult_t enqueued, const char* what, const std::string& name) {
  Status s = NcclStatus(enqueued, what, name);
  if (!s.ok()) return s;
  s = CudaStatus(cudaStreamSynchronize(stream_), what, name);
  if (!s.ok()) return s;
  // A failure of a peer or the network surfaces here, not in the call's own result.
  ncclResult_t async = ncclSuccess;
  ncclCommGetAsyncError(comm_, &async);
  return NcclStatus(async, what, name);
}

Status NcclBackend::Allreduce(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op, double scale,
                              const std::string& name) {
  ncclRedOp_t reduction;
  bool created = false;
  Status s = Reduction(dtype, op, scale, &reduction, &created, name);
  if (!s.ok()) return s;
  s = Finish(ncclAllReduce(in, out, count, ToNccl(dtype), reduction, comm_, stream_), "allreduce", name);
  if (created) ncclRedOpDestroy(reduction, comm_);
  return s;
}

Status NcclBackend::Allgather(const void* in, void* out, const std::vector<int64_t>& counts, DataType dtype,
                              const std::string& name) {
  if (AllEqual(counts)) {
    return Finish(ncclAllGather(in, out, counts[0], ToNccl(dtype), comm_, stream_), "allgather", name);
  }
  // Uneven rows: every rank broadcasts its block into its place, all in one group.
  ncclResult_t result = ncclGroupStart();
  int64_t offset = 0;
  for (int r = 0; r < size_ && result == ncclSuccess; ++r) {
    if (counts[r] > 0) {
      result = ncclBroadcast(in, At(out, offset, dtype), counts[r], ToNccl(dtype), r, comm_, stream_);
    }
    offset += counts[r];
  }
  const ncclResult_t ended = ncclGroupEnd();
  return Finish(result != ncclSuccess ? result : ended, "allgather", name);
}

Status NcclBackend::Broadcast(void* data, int64_t count, DataType dtype, int root, const std::string& name) {
  return Finish(ncclBroadcast(data, data, count, ToNccl(dtype), root, comm_, stream_), "broadcast", name);
}

Status NcclBackend::ReduceScatter(const void* in, void* out, const std::vector<int64_t>& counts, DataType dtype,
                                  ReduceOp op, double scale, const std::string& name) {
  ncclRedOp_t reduction;
  bool created = false;
  Status s = Reduction(dtype, op, scale, &reduction, &created, name);
  if (!s.ok()) return s;
  ncclResult_t result;
  if (AllEqual(counts)) {
    result = ncclReduceScatter(in, out, counts[0], ToNccl(dtype), reduction, comm_, stream_);
  } else {
    // Uneven blocks (lower ranks take the remainder): one reduce to each block's owner, grouped.
    result = ncclGroupStart();
    int64_t offset = 0;
    for (int r = 0; r < size_ && result == ncclSuccess; ++r) {
      if (counts[r] > 0) {
        result = ncclReduce(At(in, offset, dtype), out, counts[r], ToNccl(dtype), reduction, r, comm_, stream_);
      }
      offset += counts[r];
    }
    const ncclResult_t ended = ncclGroupEnd();
    if (result == ncclSuccess) result = ended;
  }
  s = Finish(result, "reducescatter", name);
  if (created) ncclRedOpDestroy(reduction, comm_);
  return s;
}

Status NcclBackend::Alltoall(const void* in, const std::vector<int64_t>& send_counts, void* out,
                             const std::vector<int64_t>& recv_counts, DataType dtype, const std::string& name) {
  ncclResult_t result = ncclGroupStart();
  int64_t send_offset = 0, recv_offset = 0;
  for (int r = 0; r < size_ && result == ncclSuccess; ++r) {
    if (send_counts[r] > 0) {
      result = ncclSend(At(in, send_offset, dtype), send_counts[r], ToNccl(dtype), r, comm_, stream_);
    }
    if (result == ncclSuccess && recv_counts[r] > 0) {
      result = ncclRecv(At(out, recv_offset, dtype), recv_counts[r], ToNccl(dtype), r, comm_, stream_);
    }
    send_offset += send_counts[r];
    recv_offset += recv_counts[r];
  }
  const ncclResult_t ended = ncclGroupEnd();
  return Finish(result != ncclSuccess ? result : ended, "alltoall", name);
}

}  // namespace kerasdist
