// Ends the job when a collective that every rank agreed to run makes no progress, or when an MPI
// call of the negotiation that returns at once does not return: a rank or the network between
// ranks is gone, and the blocked MPI call would otherwise wait for TCP's own timeouts (many
// minutes) or for ever (MPICH's TCP transport retries connecting to a dead peer's port inside
// MPI_Iallreduce). The wait for ranks that have not submitted yet (one evaluating or
// checkpointing) is not watched: it is the stall timeout's, so a slow rank never trips this.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "backend.h"

namespace kerasdist {

// Logs `message` with how the job ends, then ends the whole job with status 1 (through the abort
// SetJobAbort chose: MPI_Abort on the world in an MPI job); this rank is gone within 5 s whatever
// the launcher does.
[[noreturn]] void EndJob(const std::string& message);
// How EndJob asks the launcher to end every rank; the transport that starts the engine sets it
// (MakeMpiTransport). Until then, or if it returns, the rank exits alone.
void SetJobAbort(void (*abort_job)());

// Why a watched call that has not finished means a rank or the network is gone.
inline constexpr char kAgreedToRun[] = "although every rank had agreed to run it";

class Watchdog {
 public:
  // 0 seconds: never fires (and starts no thread).
  Watchdog(double timeout_s, std::string rank_and_host);
  ~Watchdog();

  // `what` ("allreduce") of the collective `name` (or of nothing named, when null) runs from now
  // on; re-arming counts as progress. Every backend call arms it, so nothing is copied here:
  // all three must stay alive until Disarm, which the message is formatted before.
  void Arm(const char* what, const std::string* name = nullptr, const char* why = kAgreedToRun);
  // One MPI call of the negotiation (starting it, testing it, the stall questions) runs from now
  // on: MPI returns from these at once unless it cannot reach a peer.
  void ArmForNegotiationCall() {
    Arm("an MPI call of the negotiation", nullptr, "although MPI returns from it at once unless it cannot reach a peer");
  }
  void Disarm();

 private:
  void Watch();

  const double timeout_s_;
  const std::string rank_and_host_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool armed_ = false;         // guarded by mu_
  bool stopping_ = false;      // guarded by mu_
  Clock::time_point since_;    // guarded by mu_
  const char* what_ = "";      // guarded by mu_
  const std::string* name_ = nullptr;  // guarded by mu_
  const char* why_ = kAgreedToRun;     // guarded by mu_
  std::thread thread_;
};

// A backend whose every call the watchdog watches.
class WatchedBackend : public Backend {
 public:
  WatchedBackend(std::unique_ptr<Backend> inner, Watchdog* watchdog)
      : inner_(std::move(inner)), watchdog_(watchdog) {}

  bool ScalesWhileCombining(DataType dtype) const override { return inner_->ScalesWhileCombining(dtype); }
  Status Allreduce(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op, double scale,
                   const std::string& name) override;
  Status Allgather(const void* in, void* out, const std::vector<int64_t>& counts, DataType dtype,
                   const std::string& name) override;
  Status Broadcast(void* data, int64_t count, DataType dtype, int root, const std::string& name) override;
  Status ReduceScatter(const void* in, void* out, const std::vector<int64_t>& counts, DataType dtype, ReduceOp op,
                       double scale, const std::string& name) override;
  Status Alltoall(const void* in, const std::vector<int64_t>& send_counts, void* out,
                  const std::vector<int64_t>& recv_counts, DataType dtype, const std::string& name) override;
  std::vector<AllreduceChoice> AllreduceChoices() const override { return inner_->AllreduceChoices(); }
  void UseAllreduceChoice(AllreduceChoice choice) override { inner_->UseAllreduceChoice(choice); }
  std::string Layout() const override { return inner_->Layout(); }
  int64_t HierarchicalCalls() const override { return inner_->HierarchicalCalls(); }

 private:
  template <typename Call>
  Status Watched(const char* what, const std::string& name, Call call) {
    watchdog_->Arm(what, &name);
    Status status = call();
    watchdog_->Disarm();
    return status;
  }

  std::unique_ptr<Backend> inner_;
  Watchdog* watchdog_;
};

}  // namespace kerasdist
