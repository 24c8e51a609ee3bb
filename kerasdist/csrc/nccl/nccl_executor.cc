#include "nccl_executor.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <tuple>
#include <vector>

#include "nccl_backend.h"

namespace kerasdist {
namespace {

// Fused tensors start at multiples of this: NCCL and device copies are fastest on such starts.
constexpr size_t kDeviceAlignment = 256;
size_t DeviceAligned(size_t bytes) { return (bytes + kDeviceAlignment - 1) / kDeviceAlignment * kDeviceAlignment; }

// The CUDA device of this process's first device collective, which all later ones must share:
// one NCCL communicator serves one device. Set by the enqueueing threads, read by the engine's.
std::atomic<int> first_ordinal{-1};

int64_t RowElements(const Shape& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

size_t Bytes(const TensorSpec& spec) { return NumElements(spec.shape) * DataTypeSize(spec.dtype); }

// Device memory that frees itself.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() {
    if (data_) cudaFree(data_);
  }
  cudaError_t Allocate(size_t bytes) { return cudaMalloc(&data_, std::max<size_t>(bytes, 1)); }
  char* data() const { return static_cast<char*>(data_); }

 private:
  void* data_ = nullptr;
};

class NcclExecutor : public DeviceExecutor {
 public:
  NcclExecutor(ControlPlane* control_plane, Watchdog* watchdog, Timeline* timeline, const EngineOptions& options)
      : control_plane_(control_plane),
        rank_(control_plane->rank()),
        size_(control_plane->size()),
        watchdog_(watchdog),
        timeline_(timeline),
        threshold_bytes_(options.fusion_threshold_bytes) {}

  ~NcclExecutor() override {
    if (comm_) ncclCommDestroy(comm_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  // Collective: every rank's local setup is checked by all, so either all create the NCCL
  // communicator (from an id rank 0 broadcasts over the control plane) or none does and all fail
  // alike.
  Status Start(int ordinal) {
    const std::string what = "device setup";
    Status local = CudaStatus(cudaSetDevice(ordinal), "selecting the GPU", what);
    if (local.ok()) local = CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "a stream", what);
    if (local.ok() && threshold_bytes_ > 0) {
      // Allocated once, so a fused group never needs memory that one rank might not get.
      local = CudaStatus(fusion_buffer_.Allocate(threshold_bytes_ + kDeviceAlignment), "the fusion buffer", what);
    }
    ncclUniqueId id{};
    if (local.ok() && rank_ == 0) local = NcclStatus(ncclGetUniqueId(&id), "creating the NCCL id", what);
    watchdog_->Arm("NCCL setup");
    std::vector<char> id_bytes(reinterpret_cast<const char*>(&id), reinterpret_cast<const char*>(&id) + sizeof(id));
    bool all_ok = false;
    Status exchanged = control_plane_->BroadcastFromRoot(&id_bytes);
    if (exchanged.ok()) exchanged = AllRanksAgree(control_plane_, local.ok(), &all_ok);
    if (exchanged.ok()) std::memcpy(&id, id_bytes.data(), sizeof(id));
    Status started = local;
    if (!exchanged.ok()) {
      started = exchanged;
    } else if (all_ok) {
      started = NcclStatus(ncclCommInitRank(&comm_, size_, id, rank_), "creating the NCCL communicator", what);
    } else if (local.ok()) {
      started = Status::Internal("kerasdist: another rank could not set up its GPU for NCCL (its log says why)");
    }
    watchdog_->Disarm();
    if (!started.ok()) return started;
    backend_ = std::make_unique<WatchedBackend>(std::make_unique<NcclBackend>(comm_, stream_, size_), watchdog_);
    return Status::OK();
  }

  void Run(const std::vector<std::pair<Collective*, const Response*>>& ready) override {
    // The engine's stream waits for each producer on the device; this thread does not block.
    for (auto& [c, r] : ready) WaitForFramework(c);
    std::vector<Collective*> allreduces;
    for (auto& [c, r] : ready) {
      if (c->request.kind == OpKind::kAllreduce) allreduces.push_back(c);
    }
    RunAllreduces(allreduces);
    for (auto& [c, r] : ready) {
      if (c->request.kind == OpKind::kAllreduce) continue;
      auto start = Clock::now();
      c->Fail(RunOther(c, *r));
      if (timeline_->enabled()) timeline_->Phase(c->request.name, OpKindName(c->request.kind), start, Clock::now());
    }
    // Backend calls synchronize themselves; what may still run is the copies out of the buffer.
    watchdog_->Arm("copies out of the device fusion buffer");
    const Status copied = CudaStatus(cudaStreamSynchronize(stream_), "copying out", "device collectives");
    watchdog_->Disarm();
    for (auto& [c, r] : ready) c->Fail(copied);
    stand_ins_.clear();
  }

 private:
  using Item = std::pair<Collective*, int>;  // a collective and the index of one of its tensors

  // Sum and Average that scale alike share a fused call: NCCL's reduction carries the scale.
  double ScaleOf(const Item& item) const {
    const Collective* c = item.first;
    return c->request.prescale * c->FinishScale(c->request.tensors[item.second].dtype);
  }

  void RunAllreduces(const std::vector<Collective*>& collectives) {
    using Key = std::tuple<DataType, ReduceOp, double>;
    std::vector<std::pair<Key, std::vector<Item>>> groups;  // in negotiated order, as on every rank
    for (Collective* c : collectives) {
      for (int t = 0; t < static_cast<int>(c->request.tensors.size()); ++t) {
        Key key{c->request.tensors[t].dtype, c->request.reduce_op, ScaleOf({c, t})};
        auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == key; });
        if (it == groups.end()) it = groups.insert(groups.end(), {key, {}});
        it->second.push_back({c, t});
      }
    }
    const size_t threshold = static_cast<size_t>(std::max<int64_t>(threshold_bytes_, 0));
    for (auto& [key, items] : groups) {
      std::vector<Item> fused;
      size_t fused_bytes = 0;
      auto flush = [&] {
        if (fused.size() == 1) RunAlone(fused[0]);
        if (fused.size() > 1) RunFused(fused);
        fused.clear();
        fused_bytes = 0;
      };
      for (const Item& item : items) {
        const size_t bytes = DeviceAligned(Bytes(item.first->request.tensors[item.second]));
        if (bytes > threshold) {  // alone, in its own memory: nothing to copy
          RunAlone(item);
          continue;
        }
        if (fused_bytes + bytes > threshold) flush();
        fused.push_back(item);
        fused_bytes += bytes;
      }
      flush();
    }
  }

  void RunAlone(const Item& item) {
    auto [c, t] = item;
    const TensorSpec& spec = c->request.tensors[t];
    void* out = nullptr;
    const Status allocated = AllocateOutput(c, t, spec.shape, Bytes(spec), &out);
    auto start = Clock::now();
    Status s = backend_->Allreduce(c->inputs[t], out, NumElements(spec.shape), spec.dtype, c->request.reduce_op,
                                   ScaleOf(item), c->request.name);
    c->Fail(allocated);
    c->Fail(s);
    if (timeline_->enabled()) timeline_->Phase(c->request.name, "nccl_allreduce", start, Clock::now());
  }

  // Copies into the fusion buffer, one allreduce over it in place, copies out into each output.
  void RunFused(const std::vector<Item>& items) {
    const DataType dtype = items[0].first->request.tensors[items[0].second].dtype;
    char* buffer = fusion_buffer_.data();
    std::vector<size_t> offsets{0};
    for (auto& [c, t] : items) offsets.push_back(offsets.back() + DeviceAligned(Bytes(c->request.tensors[t])));
    auto start = Clock::now();
    for (size_t i = 0; i < items.size(); ++i) {
      auto& [c, t] = items[i];
      c->Fail(CudaStatus(cudaMemcpyAsync(buffer + offsets[i], c->inputs[t], Bytes(c->request.tensors[t]),
                                         cudaMemcpyDeviceToDevice, stream_),
                         "copying into the fusion buffer", c->request.name));
    }
    auto reduce_start = Clock::now();
    const Status reduced =
        backend_->Allreduce(buffer, buffer, static_cast<int64_t>(offsets.back() / DataTypeSize(dtype)), dtype,
                            items[0].first->request.reduce_op, ScaleOf(items[0]), items[0].first->request.name);
    auto copy_out_start = Clock::now();
    for (size_t i = 0; i < items.size(); ++i) {
      auto& [c, t] = items[i];
      const TensorSpec& spec = c->request.tensors[t];
      c->Fail(reduced);
      void* out = nullptr;
      Status s = c->allocate(t, spec.shape, &out);
      if (s.ok()) {
        WaitForFramework(c);
        s = CudaStatus(cudaMemcpyAsync(out, buffer + offsets[i], Bytes(spec), cudaMemcpyDeviceToDevice, stream_),
                       "copying out of the fusion buffer", c->request.name);
      }
      c->Fail(s);
    }
    if (timeline_->enabled()) {
      for (auto& [c, t] : items) {
        timeline_->Phase(c->request.name, "copy_in", start, reduce_start);
        timeline_->Phase(c->request.name, "nccl_allreduce", reduce_start, copy_out_start);
      }
    }
  }

  Status RunOther(Collective* c, const Response& r) {
    const TensorSpec& spec = c->request.tensors[0];
    const std::string& name = c->request.name;
    const int64_t row = spec.shape.empty() ? 1 : RowElements(spec.shape);
    switch (c->request.kind) {
      case OpKind::kAllgather: {
        std::vector<int64_t> counts(size_);
        Shape out_shape = spec.shape;
        out_shape[0] = 0;
        for (int i = 0; i < size_; ++i) {
          out_shape[0] += r.rank_rows[i];
          counts[i] = r.rank_rows[i] * row;
        }
        void* out = nullptr;
        const Status allocated =
            AllocateOutput(c, 0, out_shape, NumElements(out_shape) * DataTypeSize(spec.dtype), &out);
        const Status s = backend_->Allgather(c->inputs[0], out, counts, spec.dtype, name);
        return allocated.ok() ? s : allocated;
      }
      case OpKind::kBroadcast: {
        const int64_t count = NumElements(spec.shape);
        if (rank_ == c->request.root_rank && c->inputs[0] != c->outputs[0]) {
          Status s = CudaStatus(cudaMemcpyAsync(c->outputs[0], c->inputs[0], Bytes(spec), cudaMemcpyDeviceToDevice,
                                                stream_),
                                "copying the root's tensor", name);
          c->Fail(s);  // the root still sends, or the others would wait in the broadcast
        }
        return backend_->Broadcast(c->outputs[0], count, spec.dtype, c->request.root_rank, name);
      }
      case OpKind::kReducescatter: {
        const int64_t rows = spec.shape[0];
        std::vector<int64_t> counts(size_);
        for (int i = 0; i < size_; ++i) counts[i] = (rows / size_ + (i < rows % size_ ? 1 : 0)) * row;
        return backend_->ReduceScatter(c->inputs[0], c->outputs[0], counts, spec.dtype, c->request.reduce_op,
                                       ScaleOf({c, 0}), name);
      }
      case OpKind::kAlltoall: {
        std::vector<int64_t> send(size_), recv(size_);
        Shape out_shape = spec.shape;
        out_shape[0] = 0;
        for (int i = 0; i < size_; ++i) {
          send[i] = r.alltoall_rows[rank_ * size_ + i] * row;
          recv[i] = r.alltoall_rows[i * size_ + rank_] * row;
          out_shape[0] += r.alltoall_rows[i * size_ + rank_];
        }
        void* out = nullptr;
        void* splits_out = nullptr;  // host memory: the kernel registers that output so
        Status allocated = c->allocate(1, Shape{size_}, &splits_out);
        if (allocated.ok()) {
          allocated = AllocateOutput(c, 0, out_shape, NumElements(out_shape) * DataTypeSize(spec.dtype), &out);
        } else {
          out = StandIn(NumElements(out_shape) * DataTypeSize(spec.dtype), name);
        }
        if (allocated.ok()) {
          for (int i = 0; i < size_; ++i) {
            static_cast<int32_t*>(splits_out)[i] = static_cast<int32_t>(r.alltoall_rows[i * size_ + rank_]);
          }
        }
        const Status s = backend_->Alltoall(c->inputs[0], send, out, recv, spec.dtype, name);
        return allocated.ok() ? s : allocated;
      }
      case OpKind::kAllreduce: case OpKind::kJoin: break;
    }
    return Status::Internal("kerasdist: " + std::string(OpKindName(c->request.kind)) + " '" + name +
                            "' cannot run on a GPU");
  }

  // Orders this stream's next work after what TensorFlow has enqueued so far (see DeviceTensors).
  void WaitForFramework(Collective* c) {
    if (c->device.wait_for_framework) c->Fail(c->device.wait_for_framework(stream_));
  }

  // An output's memory, ordered after its previous users on TensorFlow's stream; device memory
  // of this executor standing in for it when it cannot be allocated.
  Status AllocateOutput(Collective* c, int index, const Shape& shape, size_t bytes, void** out) {
    const Status allocated = c->allocate(index, shape, out);
    if (allocated.ok()) {
      WaitForFramework(c);
    } else {
      *out = StandIn(bytes, c->request.name);
    }
    return allocated;
  }

  // Device memory standing in for an output that could not be allocated: this rank still takes
  // part, or the others would wait for it inside NCCL. Freed at the end of the cycle.
  void* StandIn(size_t bytes, const std::string& name) {
    stand_ins_.emplace_back(std::make_unique<DeviceMemory>());
    if (stand_ins_.back()->Allocate(bytes) != cudaSuccess) {
      EndJob("rank could not allocate " + std::to_string(bytes) + " bytes of GPU memory for the output of '" +
             name + "', which every rank had agreed to run, so the other ranks would wait in it for ever");
    }
    return stand_ins_.back()->data();
  }

  ControlPlane* control_plane_;
  const int rank_;
  const int size_;
  Watchdog* watchdog_;
  Timeline* timeline_;
  const int64_t threshold_bytes_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<Backend> backend_;  // NCCL, watched
  DeviceMemory fusion_buffer_;
  std::vector<std::unique_ptr<DeviceMemory>> stand_ins_;
};

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
  hooks.create = [](ControlPlane* control_plane, Watchdog* watchdog, Timeline* timeline,
                    const EngineOptions& options, std::unique_ptr<DeviceExecutor>* executor) {
    auto nccl = std::make_unique<NcclExecutor>(control_plane, watchdog, timeline, options);
    Status s = nccl->Start(first_ordinal.load());
    if (s.ok()) *executor = std::move(nccl);
    return s;
  };
  return hooks;
}

}  // namespace kerasdist
