#include "tuner.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <sstream>

#include "common.h"

namespace kerasdist {
namespace {

double Median(std::vector<double> values) {
  std::nth_element(values.begin(), values.begin() + values.size() / 2, values.end());
  return values[values.size() / 2];
}

constexpr char kFileHeader[] =
    "# kerasdist tuning: one line per job layout (layout, allreduce algorithm, fusion threshold in bytes), "
    "tab-separated; a job of a listed layout runs its line's choice without tuning. Delete a line to tune again.";

}  // namespace

Tuner::Tuner(std::vector<std::string> algorithms, bool tune_algorithm, int64_t threshold_bytes, bool tune_fusion,
             std::string file, std::string layout)
    : algorithms_(std::move(algorithms)),
      threshold_bytes_(threshold_bytes),
      tune_fusion_(tune_fusion && threshold_bytes > 2 * kSmallThresholdBytes),
      file_(std::move(file)),
      layout_(std::move(layout)),
      random_(20261207) {
  const bool tune_algorithms = tune_algorithm && algorithms_.size() > 1;
  stage_ = tune_algorithms ? Stage::kAlgorithm : Stage::kFusion;
  if (!tune_algorithms && !tune_fusion_) {
    stage_ = Stage::kDone;
    return;
  }
  if (!file_.empty() && ReadFile()) {
    stage_ = Stage::kDone;
    Log(1, "tuning: %s, read from %s for this layout (%s)", Describe().c_str(), file_.c_str(), layout_.c_str());
    return;
  }
  StartRound();
}

void Tuner::StartRound() {
  const int candidates = stage_ == Stage::kAlgorithm ? static_cast<int>(algorithms_.size()) : 2;
  seconds_per_byte_.resize(candidates);
  order_.resize(candidates);
  std::iota(order_.begin(), order_.end(), 0);
  std::shuffle(order_.begin(), order_.end(), random_);
  // The last of the order runs first: the next candidate is always order_.back().
  if (stage_ == Stage::kAlgorithm) algorithm_ = order_.back();
  else small_ = order_.back() == 1;
}

void Tuner::Record(int setting, int64_t allreduce_bytes, int64_t fused_bytes, double seconds) {
  if (stage_ == Stage::kDone || setting != this->setting()) return;
  int candidate;
  int64_t bytes;
  if (stage_ == Stage::kAlgorithm) {
    if (allreduce_bytes < kTimedFromBytes) return;
    candidate = algorithm_;
    bytes = allreduce_bytes;
  } else {
    // Only what fuses differs between the thresholds; cycles that fuse no more than the small
    // one fuse alike with both.
    if (fused_bytes <= kSmallThresholdBytes) return;
    candidate = small_ ? 1 : 0;
    bytes = fused_bytes;
  }
  seconds_per_byte_[candidate].push_back(seconds / static_cast<double>(bytes));
  order_.pop_back();
  if (!order_.empty()) {
    if (stage_ == Stage::kAlgorithm) algorithm_ = order_.back();
    else small_ = order_.back() == 1;
    return;
  }
  if (seconds_per_byte_[0].size() < kRounds) return StartRound();
  Decide();
}

void Tuner::Decide() {
  std::vector<double> medians, ratios = {1.0};
  for (const auto& samples : seconds_per_byte_) medians.push_back(Median(samples));
  // Each candidate against the configured one (0) round by round: the cycles of one round ran
  // close together, so a slow spell of the machine slows all of a round's alike and its ratios
  // less than the times themselves.
  for (size_t c = 1; c < seconds_per_byte_.size(); ++c) {
    std::vector<double> per_round;
    for (int r = 0; r < kRounds; ++r) per_round.push_back(seconds_per_byte_[c][r] / seconds_per_byte_[0][r]);
    ratios.push_back(Median(per_round));
  }
  // The configured candidate stays unless another is clearly faster.
  int best = 0;
  for (int c = 1; c < static_cast<int>(ratios.size()); ++c) {
    if (ratios[c] < 0.97 && ratios[c] < ratios[best]) best = c;
  }
  std::string timed;
  char text[160];
  for (int c = 0; c < static_cast<int>(medians.size()); ++c) {
    const std::string name = stage_ == Stage::kAlgorithm ? algorithms_[c]
                                                         : "calls of up to " +
                                                               std::to_string(c == 1 ? kSmallThresholdBytes
                                                                                     : threshold_bytes_) +
                                                               " bytes";
    std::snprintf(text, sizeof(text), "%s%s %.3f GB/s (%.2f of the time)", c ? ", " : "", name.c_str(),
                  1e-9 / medians[c], ratios[c]);
    timed += text;
  }
  if (stage_ == Stage::kAlgorithm) {
    algorithm_ = best;
    Log(1, "tuning: allreduce algorithms timed over %d cycles each: %s; keeping %s", kRounds, timed.c_str(),
        algorithms_[best].c_str());
  } else {
    small_ = best == 1;
    Log(1, "tuning: fused allreduces timed over %d cycles each: %s; keeping calls of up to %lld bytes", kRounds,
        timed.c_str(), static_cast<long long>(small_ ? kSmallThresholdBytes : threshold_bytes_));
  }
  // Saved now: a job whose cycles never fuse enough to time the thresholds still keeps this.
  if (!file_.empty()) WriteFile();
  NextStage();
}

void Tuner::NextStage() {
  seconds_per_byte_.clear();
  if (stage_ == Stage::kAlgorithm && tune_fusion_) {
    stage_ = Stage::kFusion;
    return StartRound();
  }
  stage_ = Stage::kDone;
  order_.clear();
}

std::string Tuner::Describe() const {
  return "allreduce algorithm " + algorithms_[algorithm_] + ", fused calls of up to " +
         std::to_string(small_ ? kSmallThresholdBytes : threshold_bytes_) + " bytes";
}

bool Tuner::ReadFile() {
  std::ifstream in(file_);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string layout, algorithm, threshold;
    if (!std::getline(fields, layout, '\t') || layout != layout_) continue;
    std::getline(fields, algorithm, '\t');
    std::getline(fields, threshold, '\t');
    const auto known = std::find(algorithms_.begin(), algorithms_.end(), algorithm);
    const bool small = threshold == std::to_string(kSmallThresholdBytes);
    if (known == algorithms_.end() || !(small || threshold == std::to_string(threshold_bytes_))) {
      Log(2, "tuning: %s holds a line for this layout that names no choice it has (%s, %s); tuning again",
          file_.c_str(), algorithm.c_str(), threshold.c_str());
      return false;
    }
    algorithm_ = static_cast<int>(known - algorithms_.begin());
    small_ = small && tune_fusion_;
    return true;
  }
  return false;
}

void Tuner::WriteFile() const {
  // Every other layout's line is kept; the new file replaces the old one whole (rename), so a
  // crash leaves the old file or the new one, never half of one.
  std::vector<std::string> kept;
  {
    std::ifstream in(file_);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty() || line[0] == '#' || line.compare(0, layout_.size() + 1, layout_ + "\t") == 0) continue;
      kept.push_back(line);
    }
  }
  const std::string temporary = file_ + ".tmp." + std::to_string(getpid());
  {
    std::ofstream out(temporary);
    out << kFileHeader << "\n";
    for (const auto& line : kept) out << line << "\n";
    out << layout_ << "\t" << algorithms_[algorithm_] << "\t" << (small_ ? kSmallThresholdBytes : threshold_bytes_)
        << "\n";
    out.flush();
    if (!out) {
      Log(2, "tuning: cannot write %s; the choice (%s) is not saved", temporary.c_str(), Describe().c_str());
      std::remove(temporary.c_str());
      return;
    }
  }
  if (std::rename(temporary.c_str(), file_.c_str()) != 0) {
    Log(2, "tuning: cannot replace %s; the choice (%s) is not saved", file_.c_str(), Describe().c_str());
    std::remove(temporary.c_str());
    return;
  }
  Log(1, "tuning: %s saved to %s for this layout (%s)", Describe().c_str(), file_.c_str(), layout_.c_str());
}

}  // namespace kerasdist
