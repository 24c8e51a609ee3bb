// Rank 0's choice of the settings whose best value depends on the machine and the model: which
// allreduce algorithm the backend runs, and how many bytes one fused call may hold. No fixed
// choice wins everywhere. Across 3 hosts MPICH's ring moved 12 MiB 2.6x as fast as MPICH's own
// choice, and at 4 hosts its own choice was 1.5x as fast from 1 to 4 MiB; over a 1 Gbit/s link
// fused calls of at most 1 MiB were faster, over shared memory one call of 16 MiB was
// (docs/network.md). So rank 0 times the first cycles that move data with each setting and keeps
// the fastest.
//
// Two stages, each over rounds in which every candidate runs one timed cycle, in an order drawn
// anew each round (so that neither a slow spell of the machine nor a step's repeating pattern of
// cycles falls on one candidate): first the backend's algorithms at the configured threshold,
// timed on cycles that reduce at least kTimedFromBytes; then, with the algorithm kept, the
// configured threshold against kSmallThresholdBytes, timed on cycles that fuse more than
// kSmallThresholdBytes. A candidate is kept over the configured one only when the median, over
// rounds, of its time per byte over the configured one's in the same round is below 0.97: cycles
// of one round run close together, so a slow spell of the machine moves those ratios less than
// the times. Every rank learns the cycle's setting from the cycle's bitwise AND, so each
// runs every cycle with the same algorithm and the same groups.
//
// The choice can be written to a file and read back by a later job of the same layout, which
// then runs it from its first cycle without timing anything.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace kerasdist {

class Tuner {
 public:
  static constexpr int64_t kSmallThresholdBytes = int64_t{1} << 20;
  static constexpr int64_t kTimedFromBytes = int64_t{64} << 10;  // below, a call's latency is the time
  static constexpr int kRounds = 8;                               // timed cycles per candidate

  // A cycle's setting, as every rank decodes it from the cycle's AND (setting = algorithm * 2 + small).
  static constexpr int kSettingBits = 3;  // up to 4 algorithms x 2 thresholds
  static int Setting(int algorithm, bool small_fusion) { return algorithm * 2 + (small_fusion ? 1 : 0); }
  static int Algorithm(int setting) { return setting / 2; }
  static bool SmallFusion(int setting) { return setting % 2 == 1; }

  // `algorithms` names the backend's algorithms, the configured one first (one name: nothing to
  // choose). `tune_algorithm` and `tune_fusion` say which stages run; fusion is tuned only with a
  // threshold over twice the small one. `file`, when not empty, holds a choice for `layout` to reuse,
  // or receives this job's once it is made.
  Tuner(std::vector<std::string> algorithms, bool tune_algorithm, int64_t threshold_bytes, bool tune_fusion,
        std::string file, std::string layout);

  // The setting the next cycle runs with.
  int setting() const { return Setting(algorithm_, small_); }
  // A cycle ran with `setting`: `allreduce_bytes` in `seconds` of allreduces, of which `fused_bytes`
  // were of tensors small enough to fuse.
  void Record(int setting, int64_t allreduce_bytes, int64_t fused_bytes, double seconds);
  bool tuning() const { return stage_ != Stage::kDone; }

 private:
  enum class Stage { kAlgorithm, kFusion, kDone };

  void StartRound();
  void Decide();
  void NextStage();
  bool ReadFile();
  void WriteFile() const;
  std::string Describe() const;

  const std::vector<std::string> algorithms_;
  const int64_t threshold_bytes_;
  const bool tune_fusion_;
  const std::string file_;
  const std::string layout_;
  Stage stage_;
  int algorithm_ = 0;
  bool small_ = false;
  std::vector<int> order_;  // this round's candidates still to run
  std::vector<std::vector<double>> seconds_per_byte_;  // [candidate]: the stage's timed cycles
  std::mt19937 random_;
};

}  // namespace kerasdist
