// Which fusion threshold moves a job's fused allreduces fastest. One MPI call per group of up to
// 16 MiB is fastest over shared memory and a fast link; over a 1 Gbit/s link calls of at most
// 1 MiB are (160 x 64 KiB per step, 2 hosts: 16 MiB groups 94-99 ms, 1 MiB groups 90 ms,
// unfused 90 ms; unshaped link 7.7 ms against 8.9-9.6 ms; one host 3.4-3.8 ms against 3.7-4.7 ms).
// No one default serves both, so rank 0 tries the two on alternate cycles that fuse more than
// the smaller one, compares the median time per byte of each over kSamples cycles, and keeps the
// faster. Every rank learns rank 0's choice from the cycle's bitwise AND, so fused groups stay
// the same on every rank.
#pragma once

#include <cstdint>
#include <vector>

namespace kerasdist {

class FusionTuner {
 public:
  static constexpr int64_t kSmallThresholdBytes = int64_t{1} << 20;
  static constexpr int kSamples = 15;  // cycles timed with each threshold

  // Tunes only when `enabled` and `threshold_bytes` is more than twice the small threshold.
  FusionTuner(int64_t threshold_bytes, bool enabled);

  // Rank 0: whether the next cycle should fuse at kSmallThresholdBytes.
  bool UseSmall() const { return small_; }
  // Rank 0: a cycle fused `fused_bytes` (tensors small enough to fuse) in `seconds`, with the
  // small threshold or not. Cycles that fuse no more than the small threshold fuse alike with
  // both and are not counted.
  void Record(bool small, int64_t fused_bytes, double seconds);

 private:
  const int64_t threshold_bytes_;
  bool tuning_;
  bool small_ = false;
  std::vector<double> seconds_per_byte_[2];  // [small]
};

}  // namespace kerasdist
