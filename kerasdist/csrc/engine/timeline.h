// Chrome-trace (chrome://tracing, Perfetto) record of each tensor's phases, written by the
// engine thread only, so it needs no lock. The file is a complete JSON array after every event,
// so a job that ends by MPI_Abort or a kill (when a timeline is needed most) leaves it loadable.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <unordered_map>

namespace kerasdist {

class Timeline {
 public:
  using Clock = std::chrono::steady_clock;

  bool Open(const std::string& path);  // false (and stays disabled) when the file can't be made
  bool enabled() const { return fd_ >= 0; }
  // A finished phase of one tensor: [start, end).
  void Phase(const std::string& tensor, const char* phase, Clock::time_point start,
             Clock::time_point end);
  void CycleMark(Clock::time_point when, int ready_count);
  void Close();
  ~Timeline() { Close(); }

 private:
  int TrackOf(const std::string& tensor);
  void Emit(const std::string& json);
  double Micros(Clock::time_point t) const;

  int fd_ = -1;
  off_t end_ = 0;  // where the closing "\n]\n" starts: the next event overwrites it
  Clock::time_point origin_;
  std::unordered_map<std::string, int> tracks_;
  bool first_event_ = true;
};

}  // namespace kerasdist
