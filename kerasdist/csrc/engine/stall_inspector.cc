#include "stall_inspector.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <thread>

#include "mpi_backend.h"
#include "watchdog.h"

namespace kerasdist {
namespace {

constexpr int kTagStallQuery = 17;  // point-to-point tags on the engine's communicator
constexpr int kTagStallReply = 18;
// While the collective timeout is on, a waiting rank asks its peers this often whether they are
// there, so that one gone is noticed within the timeout and this.
constexpr double kAskEveryS = 5.0;
constexpr int64_t kNoAnswer = -2;  // a peer's entry in peer_cycle_ before it replies
// An idle engine answers within its 200 ms idle wake-up, a busy machine's scheduler allowing: a
// question older than this is unanswered.
constexpr double kSilentAfterS = 2.0;

}  // namespace

StallInspector::StallInspector(MPI_Comm comm, const EngineOptions& options) : comm_(comm), options_(options) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  unanswered_since_.assign(size_, Clock::time_point{});
  peer_cycle_.assign(size_, kNoAnswer);
  // Every rank's host name, once, so that a message about a peer can say where it runs.
  char mine[MPI_MAX_PROCESSOR_NAME] = {};
  int length = 0;
  MPI_Get_processor_name(mine, &length);
  std::vector<char> all(static_cast<size_t>(MPI_MAX_PROCESSOR_NAME) * size_);
  MPI_Allgather(mine, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, comm_);
  for (int r = 0; r < size_; ++r) {
    const char* name = all.data() + static_cast<size_t>(r) * MPI_MAX_PROCESSOR_NAME;
    hosts_.emplace_back(name, strnlen(name, MPI_MAX_PROCESSOR_NAME));
  }
  for (Outbox* outbox : {&questions_, &replies_}) {
    outbox->requests.assign(size_, MPI_REQUEST_NULL);
    outbox->values = std::make_unique<int64_t[]>(size_);
  }
}

StallInspector::~StallInspector() {
  for (Outbox* outbox : {&questions_, &replies_}) {
    bool undelivered = false;
    for (MPI_Request& request : outbox->requests) {
      if (request == MPI_REQUEST_NULL) continue;
      int done = 0;
      MPI_Test(&request, &done, MPI_STATUS_IGNORE);
      if (done) continue;
      MPI_Request_free(&request);
      undelivered = true;
    }
    // MPI may still read a freed send's buffer: a message to a gone peer keeps its 8 bytes.
    if (undelivered) outbox->values.release();
  }
}

void StallInspector::Post(Outbox* outbox, int peer, int64_t value, int tag) {
  MPI_Request& request = outbox->requests[peer];
  if (request != MPI_REQUEST_NULL) {
    int done = 0;
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (!done) return;
  }
  outbox->values[peer] = value;
  MPI_Isend(&outbox->values[peer], 1, MPI_INT64_T, peer, tag, comm_, &request);
}

Status StallInspector::WaitForPeers(MPI_Request* request, const std::function<std::string()>& pending_names,
                                    Watchdog* watchdog) {
  struct DisarmOnReturn {
    Watchdog* watchdog;
    ~DisarmOnReturn() { watchdog->Disarm(); }
  } disarm_on_return{watchdog};
  const auto start = Clock::now();
  auto next_warning = start + std::chrono::duration<double>(options_.stall_warning_s);
  // Questions to the peers: for the stall warning (half-way to it) and to see that they are there.
  double ask_every_s = options_.stall_warning_s > 0 ? options_.stall_warning_s / 2 : 0;
  if (options_.collective_timeout_s > 0) ask_every_s = ask_every_s > 0 ? std::min(ask_every_s, kAskEveryS) : kAskEveryS;
  auto next_ask = start + std::chrono::duration<double>(ask_every_s);
  in_negotiation_ = true;
  while (true) {
    watchdog->ArmForNegotiationCall();
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
    watchdog->ArmForNegotiationCall();
    AnswerQueries();
    auto now = Clock::now();
    if (ask_every_s > 0 && now >= next_ask) {
      AskWhoIsMissing(now);
      next_ask = now + std::chrono::duration<double>(ask_every_s);
    }
    CheckPeersAnswer(now, Seconds(now - start));
    if (options_.stall_warning_s > 0 && now >= next_warning) {
      Log(2, "stall: waited %.0f s for %s to submit collectives; pending on this rank: %s. "
             "Every rank must run the same collectives.",
          Seconds(now - start), MissingRanks(now).c_str(), pending_names().c_str());
      next_warning = now + std::chrono::duration<double>(options_.stall_warning_s);
    }
    if (options_.stall_timeout_s > 0 && Seconds(now - start) > options_.stall_timeout_s) {
      return Status::DeadlineExceeded(
          "kerasdist: stalled for more than " + std::to_string(static_cast<int>(options_.stall_timeout_s)) +
          " s (KERASDIST_STALL_TIMEOUT_S) waiting for " + MissingRanks(now) + "; pending on rank " +
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
      Post(&replies_, status.MPI_SOURCE, in_negotiation_ ? cycles_done_ : -1, kTagStallReply);
    } else {
      peer_cycle_[status.MPI_SOURCE] = message;
      unanswered_since_[status.MPI_SOURCE] = Clock::time_point{};
    }
  }
}

void StallInspector::AskWhoIsMissing(Clock::time_point now) {
  // Answers from an earlier wait describe an earlier negotiation; within one wait the last answers
  // stay until new ones come, so that a warning right after a question does not take a peer that
  // answered the previous one for silent.
  if (asked_in_cycle_ != cycles_done_) {
    peer_cycle_.assign(size_, kNoAnswer);
    asked_in_cycle_ = cycles_done_;
  }
  // Not a blocking send: one to a peer whose process died while its host stays up never returned
  // (MPICH over TCP, under srun, which leaves the other tasks running), and the collective timeout
  // below never fired. A peer that has not taken the last question gets no new one.
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    Post(&questions_, r, cycles_done_, kTagStallQuery);
    if (unanswered_since_[r] == Clock::time_point{}) unanswered_since_[r] = now;
  }
}

void StallInspector::CheckPeersAnswer(Clock::time_point now, double waited_s) const {
  if (options_.collective_timeout_s <= 0) return;
  std::string gone;
  for (int r = 0; r < size_; ++r) {
    const Clock::time_point asked = unanswered_since_[r];
    if (asked == Clock::time_point{} || Seconds(now - asked) < options_.collective_timeout_s) continue;
    gone += (gone.empty() ? "" : ", ") + RankAndHost(r);
  }
  if (gone.empty()) return;
  std::ostringstream message;
  message.precision(1);
  message << std::fixed << "rank(s) " << gone << " left this rank's questions unanswered for "
          << options_.collective_timeout_s << " s (KERASDIST_COLLECTIVE_TIMEOUT_S) while rank " << RankAndHost(rank_)
          << " waited " << waited_s
          << " s for them in a negotiation; a rank that computes still answers, so the rank or the network to it "
             "is gone";
  EndJob(message.str());
}

std::string StallInspector::RankAndHost(int rank) const {
  return std::to_string(rank) + " (host " + hosts_[rank] + ")";
}

std::string StallInspector::MissingRanks(Clock::time_point now) const {
  std::string idle, silent;
  const bool answers_are_current = asked_in_cycle_ == cycles_done_;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const Clock::time_point asked = unanswered_since_[r];
    if (asked != Clock::time_point{} && Seconds(now - asked) >= kSilentAfterS) {
      silent += (silent.empty() ? "" : ", ") + RankAndHost(r);
    } else if (answers_are_current && peer_cycle_[r] != kNoAnswer && peer_cycle_[r] != cycles_done_) {
      idle += (idle.empty() ? "" : ", ") + RankAndHost(r);
    }  // otherwise it waits in this same negotiation, or has not answered yet
  }
  if (idle.empty() && silent.empty()) return "other ranks";
  std::string out;
  if (!idle.empty()) out = "rank(s) " + idle + " (not in any collective)";
  if (!silent.empty()) out += (out.empty() ? "" : " and ") + std::string("rank(s) ") + silent + " (not answering)";
  return out;
}

}  // namespace kerasdist
