#include "stall_inspector.h"

#include <thread>

#include "mpi_backend.h"

namespace kerasdist {
namespace {

constexpr int kTagStallQuery = 17;  // point-to-point tags on the engine's communicator
constexpr int kTagStallReply = 18;

}  // namespace

StallInspector::StallInspector(MPI_Comm comm, const EngineOptions& options) : comm_(comm), options_(options) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

Status StallInspector::WaitForPeers(MPI_Request* request, const std::function<std::string()>& pending_names) {
  const auto start = Clock::now();
  auto next_warning = start + std::chrono::duration<double>(options_.stall_warning_s);
  bool asked = false;
  in_negotiation_ = true;
  while (true) {
    int done = 0;
    int code = MPI_Test(request, &done, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS) return MpiStatus(code, "negotiation", "(cycle)");
    if (done) {
      in_negotiation_ = false;
      ++cycles_done_;
      return Status::OK();
    }
    // Peers usually arrive within microseconds: yield first, then poll gently, since MPI's
    // own wait spins a core and on small machines that core trains the model.
    const double waited = Seconds(Clock::now() - start);
    if (waited < 1e-3) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(waited < 0.05 ? std::chrono::microseconds(20) : std::chrono::microseconds(500));
    if (waited < 0.05) continue;
    AnswerQueries();
    auto now = Clock::now();
    if (options_.stall_warning_s > 0 && !asked && Seconds(now - start) > options_.stall_warning_s / 2) {
      AskWhoIsMissing();
      asked = true;
    }
    if (options_.stall_warning_s > 0 && now >= next_warning) {
      Log(2, "stall: waited %.0f s for %s to submit collectives; pending on this rank: %s. "
             "Every rank must run the same collectives.",
          Seconds(now - start), MissingRanks().c_str(), pending_names().c_str());
      next_warning = now + std::chrono::duration<double>(options_.stall_warning_s);
      asked = false;
    }
    if (options_.stall_timeout_s > 0 && Seconds(now - start) > options_.stall_timeout_s) {
      return Status::DeadlineExceeded(
          "kerasdist: stalled for more than " + std::to_string(static_cast<int>(options_.stall_timeout_s)) +
          " s (KERASDIST_STALL_TIMEOUT_S) waiting for " + MissingRanks() + "; pending on rank " +
          std::to_string(rank_) + ": " + pending_names());
    }
  }
}

void StallInspector::AnswerQueries() {
  int flag = 1;
  while (flag) {
    MPI_Status status;
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &flag, &status);
    if (!flag) break;
    int64_t message = 0;
    MPI_Recv(&message, 1, MPI_INT64_T, status.MPI_SOURCE, status.MPI_TAG, comm_, MPI_STATUS_IGNORE);
    if (status.MPI_TAG == kTagStallQuery) {
      int64_t reply = in_negotiation_ ? cycles_done_ : -1;
      MPI_Send(&reply, 1, MPI_INT64_T, status.MPI_SOURCE, kTagStallReply, comm_);
    } else {
      peer_cycle_[status.MPI_SOURCE] = message;
    }
  }
}

void StallInspector::AskWhoIsMissing() {
  peer_cycle_.assign(size_, -2);  // -2: no answer yet
  int64_t query = cycles_done_;
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) MPI_Send(&query, 1, MPI_INT64_T, r, kTagStallQuery, comm_);
  }
}

std::string StallInspector::MissingRanks() const {
  std::string idle, silent;
  for (int r = 0; r < static_cast<int>(peer_cycle_.size()); ++r) {
    if (r == rank_ || peer_cycle_[r] == cycles_done_) continue;  // waiting in this same negotiation
    std::string& list = peer_cycle_[r] == -2 ? silent : idle;
    list += (list.empty() ? "" : ", ") + std::to_string(r);
  }
  if (idle.empty() && silent.empty()) return "other ranks";
  std::string out;
  if (!idle.empty()) out = "rank(s) " + idle + " (not in any collective)";
  if (!silent.empty()) out += (out.empty() ? "" : " and ") + std::string("rank(s) ") + silent + " (not answering)";
  return out;
}

}  // namespace kerasdist
