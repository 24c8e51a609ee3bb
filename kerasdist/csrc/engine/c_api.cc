// The C entry points Python reaches through ctypes (the TF ops reach the engine directly).
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <set>
#include <string>

#include "engine.h"

namespace {

bool ParseInteger(const std::string& text, int64_t low, int64_t high, int64_t* value) {
  char* end = nullptr;
  errno = 0;
  long long parsed = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0 || parsed < low || parsed > high) return false;
  *value = parsed;
  return true;
}

bool ParseNumber(const std::string& text, double* value) {
  char* end = nullptr;
  errno = 0;
  double parsed = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || errno != 0 || !(parsed >= 0)) return false;
  *value = parsed;
  return true;
}

// The engine's knobs by their names in kerasdist/knobs.py. Python checked the values already;
// these parsers only refuse text that is not the field's type.
using Setter = std::function<bool(kerasdist::EngineOptions&, const std::string&)>;

const std::map<std::string, Setter>& Setters() {
  static const auto* setters = new std::map<std::string, Setter>{
      {"fusion_threshold_bytes",
       [](kerasdist::EngineOptions& o, const std::string& t) {
         return ParseInteger(t, 0, INT64_MAX, &o.fusion_threshold_bytes);
       }},
      {"cycle_time_ms", [](kerasdist::EngineOptions& o, const std::string& t) { return ParseNumber(t, &o.cycle_time_ms); }},
      {"stall_warning_s",
       [](kerasdist::EngineOptions& o, const std::string& t) { return ParseNumber(t, &o.stall_warning_s); }},
      {"stall_timeout_s",
       [](kerasdist::EngineOptions& o, const std::string& t) { return ParseNumber(t, &o.stall_timeout_s); }},
      {"mismatch_timeout_s",
       [](kerasdist::EngineOptions& o, const std::string& t) { return ParseNumber(t, &o.mismatch_timeout_s); }},
      {"collective_timeout_s",
       [](kerasdist::EngineOptions& o, const std::string& t) { return ParseNumber(t, &o.collective_timeout_s); }},
      {"cache_capacity",
       [](kerasdist::EngineOptions& o, const std::string& t) {
         int64_t value = 0;
         if (!ParseInteger(t, 1, INT32_MAX, &value)) return false;
         o.cache_capacity = static_cast<int>(value);
         return true;
       }},
      {"timeline_path",
       [](kerasdist::EngineOptions& o, const std::string& t) {
         o.timeline_path = t;
         return true;
       }},
      {"log_level",
       [](kerasdist::EngineOptions& o, const std::string& t) {
         int64_t value = 0;
         if (!ParseInteger(t, 0, 3, &value)) return false;
         o.log_level = static_cast<int>(value);
         return true;
       }},
  };
  return *setters;
}

int Fail(const std::string& message, char* error, int error_size) {
  std::strncpy(error, message.c_str(), error_size - 1);
  error[error_size - 1] = '\0';
  return 1;
}

}  // namespace

extern "C" {

// Starts the engine with its knobs given as `count` name/value texts, every one exactly once.
// Returns 0 on success; otherwise writes a message into `error`.
int kerasdist_start(int count, const char* const* names, const char* const* values, char* error,
                    int error_size) {
  kerasdist::EngineOptions options;
  std::set<std::string> given;
  for (int i = 0; i < count; ++i) {
    const std::string name = names[i];
    auto setter = Setters().find(name);
    if (setter == Setters().end()) return Fail("kerasdist: the engine has no setting " + name, error, error_size);
    if (!given.insert(name).second) return Fail("kerasdist: engine setting " + name + " given twice", error, error_size);
    if (!setter->second(options, values[i])) {
      return Fail("kerasdist: engine setting " + name + "=" + values[i] + " is not valid", error, error_size);
    }
  }
  for (const auto& entry : Setters()) {
    if (!given.count(entry.first)) {
      return Fail("kerasdist: engine setting " + entry.first + " was not given", error, error_size);
    }
  }
  kerasdist::Status status = kerasdist::Engine::Get().Start(options);
  return status.ok() ? 0 : Fail(status.message, error, error_size);
}

void kerasdist_shutdown() { kerasdist::Engine::Get().Shutdown(); }

// Tells the other ranks that this rank could not run the collective `name` (bad input found
// before it reached the engine), so that they fail it too instead of waiting for this rank.
void kerasdist_submit_failure(const char* name, int op_kind, const char* message) {
  kerasdist::Request request;
  request.name = name;
  request.kind = static_cast<kerasdist::OpKind>(op_kind);
  request.error = message;
  kerasdist::Engine::Get().SubmitFailure(std::move(request));
}

// Blocks until every rank has joined (see Engine: joined ranks take part in the others'
// allreduces with zeros meanwhile); writes the rank that joined last. Returns 0, or the failing
// StatusCode with a message in `error`. Python calls it with the GIL released (ctypes).
int kerasdist_join(int* last_joined_rank, char* error, int error_size) {
  kerasdist::Request request;
  request.name = "kerasdist.join";
  request.kind = kerasdist::OpKind::kJoin;
  request.blocking = true;  // the caller waits for it alone
  int32_t last = -1;
  std::promise<kerasdist::Status> finished;
  std::future<kerasdist::Status> result = finished.get_future();
  kerasdist::Status status = kerasdist::Engine::Get().Enqueue(
      std::move(request), {}, {&last}, nullptr, nullptr,
      [&finished](const kerasdist::Status& s) { finished.set_value(s); });
  if (status.ok()) status = result.get();
  if (!status.ok()) {
    Fail(status.message, error, error_size);
    return static_cast<int>(status.code);
  }
  *last_joined_rank = last;
  return 0;
}

// 1 when the engine gave up waiting for other ranks: its communicator is then unusable.
int kerasdist_stalled() { return kerasdist::Engine::Get().stalled() ? 1 : 0; }

}  // extern "C"
