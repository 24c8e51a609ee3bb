#include "nccl_device.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "nccl_backend.h"

namespace kerasdist {
namespace {

// Fused tensors start at multiples of this: NCCL and device copies are fastest on such starts.
constexpr size_t kDeviceAlignment = 256;

// The CUDA device of this process's first device collective, which all later ones must share:
// one NCCL communicator serves one device. Set by the enqueueing threads, read by the engine's.
std::atomic<int> first_ordinal{-1};

// Device memory that frees itself.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() {
    if (data_) cudaFree(data_);
  }
  cudaError_t Allocate(size_t bytes) {
    bytes_ = std::max<size_t>(bytes, 1);
    return cudaMalloc(&data_, bytes_);
  }
  char* data() const { return static_cast<char*>(data_); }
  size_t size() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// The one device fusion buffer, lent for a group at a time: its outputs are copied out at once.
class DeviceFusionBuffer : public FusionBuffer {
 public:
  explicit DeviceFusionBuffer(const DeviceMemory* memory) : memory_(memory) {}
  char* data() override { return memory_->data(); }
  size_t size() const override { return memory_->size(); }
  bool InUse() const override { return false; }

 private:
  const DeviceMemory* memory_;
};

// CUDA memory of one device, worked on a stream of its own, which NCCL's calls share. No
// kernels: NCCL carries every scale, and compression is refused before negotiation.
class CudaMemory : public TensorMemory {
 public:
  ~CudaMemory() override {
    if (stream_) cudaStreamDestroy(stream_);
  }

  // Selects the device and creates the stream and (for a positive threshold) the fusion buffer,
  // allocated once, so that a fused group never needs memory one rank might not get.
  Status Start(int ordinal, int64_t threshold_bytes) {
    const std::string what = "device setup";
    Status s = CudaStatus(cudaSetDevice(ordinal), "selecting the GPU", what);
    if (s.ok()) s = CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "a stream", what);
    if (s.ok() && threshold_bytes > 0) {
      s = CudaStatus(fusion_memory_.Allocate(threshold_bytes + kDeviceAlignment), "the fusion buffer", what);
    }
    return s;
  }
  cudaStream_t stream() const { return stream_; }

  size_t alignment() const override { return kDeviceAlignment; }
  // A device copy costs far less than a backend call: every tensor under the threshold fuses.
  size_t largest_fused_bytes() const override { return SIZE_MAX; }
  bool runs_kernels() const override { return false; }
  bool outputs_view_buffers() const override { return false; }

  Status OrderAfterFrontEnd(Collective* c) override {
    return c->device.wait_for_framework ? c->device.wait_for_framework(stream_) : Status::OK();
  }

  Status Copy(void* to, DataType to_type, const void* from, DataType from_type, int64_t count, double scale,
              const std::string& name) override {
    if (to_type != from_type || scale != 1.0) {
      return Status::Internal("kerasdist: '" + name + "': a GPU copy cannot convert or scale");
    }
    return CudaStatus(cudaMemcpyAsync(to, from, count * DataTypeSize(to_type), cudaMemcpyDeviceToDevice, stream_),
                      "a device copy", name);
  }

  Status Zero(void* data, size_t bytes, const std::string& name) override {
    return CudaStatus(cudaMemsetAsync(data, 0, bytes, stream_), "zeroing padding", name);
  }

  FusionBuffer* BufferFor(size_t bytes, std::unique_ptr<FusionBuffer>*, size_t* tried) override {
    *tried = bytes;
    return bytes <= fusion_buffer_.size() ? &fusion_buffer_ : nullptr;
  }

  // Device memory that NCCL then writes: without it, the others would wait inside NCCL.
  void* Scratch(size_t bytes, const std::string& name) override {
    scratch_.emplace_back(std::make_unique<DeviceMemory>());
    if (scratch_.back()->Allocate(bytes) != cudaSuccess) {
      EndJob("rank could not allocate " + std::to_string(bytes) + " bytes of GPU memory for '" + name +
             "', which every rank had agreed to run, so the other ranks would wait in it for ever");
    }
    return scratch_.back()->data();
  }

  // NCCL's calls synchronize themselves; what may still run is the copies out of the buffer.
  Status Synchronize() override {
    const Status s = CudaStatus(cudaStreamSynchronize(stream_), "copying out", "device collectives");
    scratch_.clear();
    return s;
  }

 private:
  cudaStream_t stream_ = nullptr;
  DeviceMemory fusion_memory_;
  DeviceFusionBuffer fusion_buffer_{&fusion_memory_};
  std::vector<std::unique_ptr<DeviceMemory>> scratch_;
};

// NcclBackend that destroys its communicator with it (before the memory's stream goes).
class OwningNcclBackend : public NcclBackend {
 public:
  OwningNcclBackend(ncclComm_t comm, cudaStream_t stream, int size) : NcclBackend(comm, stream, size), comm_(comm) {}
  ~OwningNcclBackend() override { ncclCommDestroy(comm_); }

 private:
  ncclComm_t comm_;
};

// Collective: every rank's local setup is checked by all, so either all create the NCCL
// communicator (from an id rank 0 broadcasts over the control plane) or none does and all fail
// alike.
Status CreateNcclDevice(ControlPlane* control_plane, Watchdog* watchdog, const EngineOptions& options,
                        std::unique_ptr<Backend>* backend, std::unique_ptr<TensorMemory>* memory) {
  const std::string what = "device setup";
  auto cuda = std::make_unique<CudaMemory>();
  Status local = cuda->Start(first_ordinal.load(), options.fusion_threshold_bytes);
  ncclUniqueId id{};
  if (local.ok() && control_plane->rank() == 0) local = NcclStatus(ncclGetUniqueId(&id), "creating the NCCL id", what);
  watchdog->Arm("NCCL setup");
  std::vector<char> id_bytes(reinterpret_cast<const char*>(&id), reinterpret_cast<const char*>(&id) + sizeof(id));
  bool all_ok = false;
  Status exchanged = control_plane->BroadcastFromRoot(&id_bytes);
  if (exchanged.ok()) exchanged = AllRanksAgree(control_plane, local.ok(), &all_ok);
  if (exchanged.ok()) std::memcpy(&id, id_bytes.data(), sizeof(id));
  ncclComm_t comm = nullptr;
  Status started = local;
  if (!exchanged.ok()) {
    started = exchanged;
  } else if (all_ok) {
    started = NcclStatus(ncclCommInitRank(&comm, control_plane->size(), id, control_plane->rank()),
                         "creating the NCCL communicator", what);
  } else if (local.ok()) {
    started = Status::Internal("kerasdist: another rank could not set up its GPU for NCCL (its log says why)");
  }
  watchdog->Disarm();
  if (!started.ok()) return started;
  *backend = std::make_unique<OwningNcclBackend>(comm, cuda->stream(), control_plane->size());
  *memory = std::move(cuda);
  return Status::OK();
}

Status CheckDeviceRequest(const Request& request, const DeviceTensors& device) {
  const std::string& name = request.name;
  for (const TensorSpec& t : request.tensors) {
    if (t.compressed()) {
      return Status::InvalidArgument("kerasdist: compression is not supported for GPU tensors ('" + name +
                                     "'); drop compression= or place the tensor on the CPU");
    }
  }
  const std::string unsupported = NcclBackend::UnsupportedScaling(request.reduce_op, request.prescale, request.postscale);
  if (!unsupported.empty()) return Status::InvalidArgument("kerasdist: '" + name + "': " + unsupported);
  int expected = -1;
  if (!first_ordinal.compare_exchange_strong(expected, device.ordinal) && expected != device.ordinal) {
    return Status::InvalidArgument("kerasdist: '" + name + "' is on GPU " + std::to_string(device.ordinal) +
                                   ", but this process runs its GPU collectives on GPU " + std::to_string(expected) +
                                   " (one NCCL communicator per process); call kerasdist.pin_gpu() so that each "
                                   "process sees its own GPU");
  }
  return Status::OK();
}

}  // namespace

DeviceHooks NcclDeviceHooks() {
  DeviceHooks hooks;
  hooks.check = CheckDeviceRequest;
  hooks.create = CreateNcclDevice;
  return hooks;
}

}  // namespace kerasdist
