#include "timeline.h"

namespace kerasdist {
namespace {

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
  file_ = std::fopen(path.c_str(), "w");
  if (!file_) return false;
  origin_ = Clock::now();
  std::fputs("[\n", file_);
  return true;
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
  if (!first_event_) std::fputs(",\n", file_);
  first_event_ = false;
  std::fputs(json.c_str(), file_);
}

void Timeline::Phase(const std::string& tensor, const char* phase, Clock::time_point start,
                     Clock::time_point end) {
  if (!file_) return;
  int track = TrackOf(tensor);
  char buf[256];
  std::snprintf(buf, sizeof(buf), "\"ph\": \"X\", \"pid\": 0, \"tid\": %d, \"ts\": %.3f, \"dur\": %.3f",
                track, Micros(start), Micros(end) - Micros(start));
  Emit(std::string("{\"name\": \"") + phase + "\", " + buf + ", \"args\": {\"tensor\": \"" +
       JsonEscaped(tensor) + "\"}}");
}

void Timeline::CycleMark(Clock::time_point when, int ready_count) {
  if (!file_) return;
  char buf[200];
  std::snprintf(buf, sizeof(buf),
                "{\"name\": \"cycle\", \"ph\": \"i\", \"s\": \"g\", \"pid\": 0, \"tid\": 0, "
                "\"ts\": %.3f, \"args\": {\"ready\": %d}}",
                Micros(when), ready_count);
  Emit(buf);
}

void Timeline::Close() {
  if (!file_) return;
  std::fputs("\n]\n", file_);
  std::fclose(file_);
  file_ = nullptr;
}

}  // namespace kerasdist
