#include "fusion_tuner.h"

#include <algorithm>

#include "common.h"

namespace kerasdist {
namespace {

double Median(std::vector<double> values) {
  std::nth_element(values.begin(), values.begin() + values.size() / 2, values.end());
  return values[values.size() / 2];
}

}  // namespace

FusionTuner::FusionTuner(int64_t threshold_bytes, bool enabled)
    : threshold_bytes_(threshold_bytes), tuning_(enabled && threshold_bytes > 2 * kSmallThresholdBytes) {}

void FusionTuner::Record(bool small, int64_t fused_bytes, double seconds) {
  if (!tuning_ || fused_bytes <= kSmallThresholdBytes) return;
  seconds_per_byte_[small].push_back(seconds / static_cast<double>(fused_bytes));
  small_ = !small;  // alternate, so that a slow spell of the machine hits both
  if (seconds_per_byte_[0].size() < kSamples || seconds_per_byte_[1].size() < kSamples) return;
  const double small_rate = Median(seconds_per_byte_[1]), large_rate = Median(seconds_per_byte_[0]);
  // The configured threshold stays unless the small one is clearly faster.
  small_ = small_rate < 0.97 * large_rate;
  tuning_ = false;
  Log(1, "fusion tuning: fused allreduces in calls of up to %lld bytes ran at %.2f GB/s, of up to %lld bytes at "
         "%.2f GB/s (medians of %d cycles each); keeping %lld bytes",
      static_cast<long long>(kSmallThresholdBytes), 1e-9 / small_rate, static_cast<long long>(threshold_bytes_),
      1e-9 / large_rate, kSamples, static_cast<long long>(small_ ? kSmallThresholdBytes : threshold_bytes_));
}

}  // namespace kerasdist
