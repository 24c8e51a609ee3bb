// Host memory, for every job's CPU tensors: copies and scaling by the engine's own kernels
// (kernels.h), and fused outputs that stay in pooled fusion buffers the front end lends
// (FusionBufferFactory), as views, so nothing is copied out.
#pragma once

#include <memory>
#include <vector>

#include "tensor_memory.h"

namespace kerasdist {

class HostMemory : public TensorMemory {
 public:
  // Pooled buffers have `threshold_bytes` (the fusion threshold), so every later group fits.
  HostMemory(int64_t threshold_bytes, FusionBufferFactory factory);

  size_t alignment() const override { return kFusedAlignment; }
  size_t largest_fused_bytes() const override;
  bool runs_kernels() const override { return true; }
  bool outputs_view_buffers() const override { return true; }
  Status OrderAfterFrontEnd(Collective*) override { return Status::OK(); }
  Status Copy(void* to, DataType to_type, const void* from, DataType from_type, int64_t count, double scale,
              const std::string& name) override;
  Status Zero(void* data, size_t bytes, const std::string& name) override;
  void PrepareLoneTensor(void* data, size_t bytes) override;
  FusionBuffer* BufferFor(size_t bytes, std::unique_ptr<FusionBuffer>* transient, size_t* tried) override;
  void* Scratch(size_t bytes, const std::string& name) override;
  Status Synchronize() override;

  // Fused tensors start at multiples of this, so the views handed out as outputs are as aligned
  // as TensorFlow's own allocations (its vectorized kernels rely on it).
  static constexpr size_t kFusedAlignment = 64;

 private:
  const int64_t threshold_bytes_;
  FusionBufferFactory factory_;
  std::vector<std::unique_ptr<FusionBuffer>> pool_;
  std::vector<std::vector<char>> scratch_;
};

}  // namespace kerasdist
