// A cycle's allreduces, fused: tensors that share a wire dtype and a way of combining travel
// together through a pooled buffer, in negotiated order, so a step's many small gradients cost
// a few backend calls; large tensors are reduced alone, in their own memory.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "backend.h"
#include "collective.h"
#include "phase_clock.h"
#include "timeline.h"

namespace kerasdist {

// Fused tensors start at multiples of this, so the views handed out as outputs are as aligned
// as TensorFlow's own allocations (its vectorized kernels rely on it).
constexpr size_t kFusedAlignment = 64;
inline size_t AlignedBytes(size_t bytes) { return (bytes + kFusedAlignment - 1) / kFusedAlignment * kFusedAlignment; }

class Fusion {
 public:
  Fusion(const EngineOptions& options, Backend* backend, Timeline* timeline, PhaseClock* phases,
         FusionBufferFactory factory);

  // Runs every allreduce of `collectives`, which every rank passes in the same order; a
  // failure goes to the status of each collective it touched.
  void Run(const std::vector<Collective*>& collectives);

 private:
  using Item = std::pair<Collective*, int>;  // a collective and the index of one of its tensors

  void RunGroup(const std::vector<Item>& items);
  void RunAlone(Collective* c, int index);
  void RunAloneCompressed(Collective* c, int index);
  // A free pooled buffer, a new pooled one, or (pool full and busy) one of exactly `bytes`
  // that `transient` owns. Null if it cannot be allocated; `tried` is the size asked for.
  FusionBuffer* BufferFor(size_t bytes, std::unique_ptr<FusionBuffer>* transient, size_t* tried);

  const int64_t threshold_bytes_;
  Backend* backend_;
  Timeline* timeline_;
  PhaseClock* phases_;
  FusionBufferFactory factory_;
  std::vector<std::unique_ptr<FusionBuffer>> pool_;
  std::vector<uint16_t> compressed_scratch_;  // a large compressed tensor, as it travels
};

}  // namespace kerasdist
