// A cycle's allreduces, fused: tensors that share a wire dtype and a way of combining travel
// together through a fusion buffer, in negotiated order, so a step's many small gradients cost
// a few backend calls; large tensors are reduced alone, in their own memory. The same for host
// and device tensors: what differs is the TensorMemory's.
#pragma once

#include <utility>
#include <vector>

#include "backend.h"
#include "collective.h"
#include "phase_clock.h"
#include "tensor_memory.h"
#include "timeline.h"

namespace kerasdist {

class Fusion {
 public:
  Fusion(int64_t threshold_bytes, Backend* backend, TensorMemory* memory, Timeline* timeline, PhaseClock* phases);

  // Runs every allreduce of `collectives`, which every rank passes in the same order; a
  // failure goes to the status of each collective it touched.
  void Run(const std::vector<Collective*>& collectives);
  // The most bytes one fused call reduces from the next Run on; the same on every rank.
  void set_threshold_bytes(int64_t bytes) { threshold_bytes_ = bytes; }
  // What the last Run reduced: the bytes of all its tensors, of those small enough to fuse, and
  // its seconds.
  int64_t last_bytes() const { return last_bytes_; }
  int64_t last_fused_bytes() const { return last_fused_bytes_; }
  double last_seconds() const { return last_seconds_; }
  void ForgetLastRun() {
    last_bytes_ = 0;
    last_fused_bytes_ = 0;
    last_seconds_ = 0;
  }

 private:
  using Item = std::pair<Collective*, int>;  // a collective and the index of one of its tensors

  void RunGroup(const std::vector<Item>& items);
  void RunAlone(Collective* c, int index);
  void RunAloneCompressed(Collective* c, int index);
  size_t FusedBytes(const TensorSpec& spec) const;  // in the fusion buffer, as it travels
  double ScaleIn(const Collective* c) const { return kerasdist::ScaleIn(*memory_, *c); }
  double ScaleAfter(const Item& item) const {
    return kerasdist::ScaleAfter(*memory_, *item.first, item.first->request.tensors[item.second].dtype);
  }

  int64_t threshold_bytes_;
  Backend* backend_;
  TensorMemory* memory_;
  Timeline* timeline_;
  PhaseClock* phases_;
  int64_t last_bytes_ = 0;
  int64_t last_fused_bytes_ = 0;
  double last_seconds_ = 0;
  std::vector<uint16_t> compressed_scratch_;  // a large compressed tensor, as it travels (host only)
};

}  // namespace kerasdist
