// Where the engine thread's time goes, summed since start: every stretch of the thread's wall
// time is charged to exactly one phase, so the phases add up to the time the engine ran and a
// benchmark can divide them by the collectives it ran. Written by the engine thread only; read
// from any thread (kerasdist.engine_times()).
#pragma once

#include <atomic>
#include <cstdint>

#include "common.h"

namespace kerasdist {

enum class Phase : int {
  kIdle,         // nothing pending: waiting for the framework's next request
  kNegotiation,  // the fast path's bit vector allreduce, waiting for slower ranks there included,
                 // and the pause after a cycle in which nothing was ready everywhere
  kSlowPath,     // requests gathered to rank 0 and its answer broadcast
  kCopyIn,       // packing a fused group (or a prescale / 16-bit conversion)
  kTransfer,     // the backend's call that moves the data (MPI, NCCL)
  kOutputs,      // allocating outputs, the finishing scale, viewing or converting results out
  kHandBack,     // the framework's completion callbacks
  kOther,        // the cycle's own bookkeeping
  kCount,
};

inline const char* PhaseName(Phase phase) {
  static const char* const kNames[] = {"idle",     "negotiation", "slow_path", "copy_in",
                                       "transfer", "outputs",     "hand_back", "other"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == static_cast<size_t>(Phase::kCount));
  return kNames[static_cast<int>(phase)];
}

class PhaseClock {
 public:
  // Charges the time since the previous charge (or Start) to `phase`.
  void Charge(Phase phase) {
    const auto now = Clock::now();
    Add(phase, now - last_);
    last_ = now;
  }
  void Start() { last_ = Clock::now(); }
  // A collective a cycle took up, `waited` after the framework enqueued it.
  void CountTakenUp(Clock::duration waited) {
    collectives_.fetch_add(1, std::memory_order_relaxed);
    pickup_ns_.fetch_add(std::chrono::nanoseconds(waited).count(), std::memory_order_relaxed);
  }
  void CountCycle() { cycles_.fetch_add(1, std::memory_order_relaxed); }
  // Collectives whose sums travelled with negotiation (Engine::RunCycle).
  void CountRiders(int64_t count) { riders_.fetch_add(count, std::memory_order_relaxed); }

  double seconds(Phase phase) const { return Nanos(totals_[static_cast<int>(phase)]) * 1e-9; }
  double pickup_seconds() const { return Nanos(pickup_ns_) * 1e-9; }
  int64_t cycles() const { return cycles_.load(std::memory_order_relaxed); }
  int64_t collectives() const { return collectives_.load(std::memory_order_relaxed); }
  int64_t riders() const { return riders_.load(std::memory_order_relaxed); }

 private:
  void Add(Phase phase, Clock::duration d) {
    totals_[static_cast<int>(phase)].fetch_add(std::chrono::nanoseconds(d).count(), std::memory_order_relaxed);
  }
  static int64_t Nanos(const std::atomic<int64_t>& a) { return a.load(std::memory_order_relaxed); }

  Clock::time_point last_ = Clock::now();
  std::atomic<int64_t> totals_[static_cast<int>(Phase::kCount)] = {};
  std::atomic<int64_t> pickup_ns_{0}, cycles_{0}, collectives_{0}, riders_{0};
};

}  // namespace kerasdist
