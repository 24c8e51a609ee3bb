#include "timeline.h"

#include <fcntl.h>
#include <unistd.h>

#include "common.h"

namespace kerasdist {
namespace {

constexpr char kClosing[] = "\n]\n";

// One pwrite per event: unbuffered, so nothing is lost when the process is ended without exit
// handlers, and the event and the closing bracket after it land together.
bool WriteAt(int fd, const std::string& bytes, off_t offset) {
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = pwrite(fd, bytes.data() + done, bytes.size() - done, offset + static_cast<off_t>(done));
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

std::string JsonEscaped(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out;
}

}  // namespace

bool Timeline::Open(const std::string& path) {
  fd_ = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) return false;
  origin_ = Clock::now();
  end_ = 1;
  if (!WriteAt(fd_, std::string("[") + kClosing, 0)) Close();
  return enabled();
}

double Timeline::Micros(Clock::time_point t) const {
  return std::chrono::duration<double, std::micro>(t - origin_).count();
}

int Timeline::TrackOf(const std::string& tensor) {
  auto it = tracks_.find(tensor);
  if (it != tracks_.end()) return it->second;
  int track = static_cast<int>(tracks_.size()) + 1;
  tracks_[tensor] = track;
  Emit("{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": " + std::to_string(track) +
       ", \"args\": {\"name\": \"" + JsonEscaped(tensor) + "\"}}");
  return track;
}

void Timeline::Emit(const std::string& json) {
  const std::string record = (first_event_ ? "\n" : ",\n") + json;
  first_event_ = false;
  if (!WriteAt(fd_, record + kClosing, end_)) {
    Log(2, "cannot write the timeline any more; it ends here");
    Close();
    return;
  }
  end_ += static_cast<off_t>(record.size());
}

void Timeline::Phase(const std::string& tensor, const char* phase, Clock::time_point start,
                     Clock::time_point end) {
  if (!enabled()) return;
  int track = TrackOf(tensor);
  char buf[256];
  std::snprintf(buf, sizeof(buf), "\"ph\": \"X\", \"pid\": 0, \"tid\": %d, \"ts\": %.3f, \"dur\": %.3f",
                track, Micros(start), Micros(end) - Micros(start));
  Emit(std::string("{\"name\": \"") + phase + "\", " + buf + ", \"args\": {\"tensor\": \"" +
       JsonEscaped(tensor) + "\"}}");
}

void Timeline::CycleMark(Clock::time_point when, int ready_count) {
  if (!enabled()) return;
  char buf[200];
  std::snprintf(buf, sizeof(buf),
                "{\"name\": \"cycle\", \"ph\": \"i\", \"s\": \"g\", \"pid\": 0, \"tid\": 0, "
                "\"ts\": %.3f, \"args\": {\"ready\": %d}}",
                Micros(when), ready_count);
  Emit(buf);
}

void Timeline::Close() {
  if (!enabled()) return;
  close(fd_);
  fd_ = -1;
}

}  // namespace kerasdist
