// The C entry points Python reaches through ctypes (the TF ops reach the engine directly).
#include <cstring>

#include "engine.h"

extern "C" {

// Returns 0 on success; otherwise writes a message into `error`.
int kerasdist_start(int64_t fusion_threshold_bytes, double cycle_time_ms, double stall_warning_s,
                    double stall_timeout_s, double mismatch_timeout_s, int cache_capacity,
                    const char* timeline_path, int log_level, char* error, int error_size) {
  kerasdist::EngineOptions options;
  options.fusion_threshold_bytes = fusion_threshold_bytes;
  options.cycle_time_ms = cycle_time_ms;
  options.stall_warning_s = stall_warning_s;
  options.stall_timeout_s = stall_timeout_s;
  options.mismatch_timeout_s = mismatch_timeout_s;
  options.cache_capacity = cache_capacity;
  options.timeline_path = timeline_path ? timeline_path : "";
  options.log_level = log_level;
  kerasdist::Status status = kerasdist::Engine::Get().Start(options);
  if (status.ok()) return 0;
  std::strncpy(error, status.message.c_str(), error_size - 1);
  error[error_size - 1] = '\0';
  return 1;
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

// 1 when the engine gave up waiting for other ranks: its communicator is then unusable.
int kerasdist_stalled() { return kerasdist::Engine::Get().stalled() ? 1 : 0; }

}  // extern "C"
