#include "stall_inspector.h"

#include <algorithm>
#include <sstream>
#include <thread>

#include "watchdog.h"

namespace kerasdist {
namespace {

// While the collective timeout is on, a waiting rank asks its peers this often whether they are
// there, so that one gone is noticed within the timeout and this.
constexpr double kAskEveryS = 5.0;
constexpr int64_t kNoAnswer = -2;  // a peer's entry in peer_cycle_ before it replies
// An idle engine answers within its 200 ms idle wake-up, a busy machine's scheduler allowing: a
// question older than this is unanswered.
constexpr double kSilentAfterS = 2.0;

}  // namespace

StallInspector::StallInspector(ControlPlane* control_plane, const EngineOptions& options)
    : control_plane_(control_plane),
      rank_(control_plane->rank()),
      size_(control_plane->size()),
      options_(options),
      // Every rank's host name, once, so that a message about a peer can say where it runs.
      hosts_(control_plane->HostNames()) {
  unanswered_since_.assign(size_, Clock::time_point{});
  peer_cycle_.assign(size_, kNoAnswer);
}

Status StallInspector::WaitForPeers(const std::function<std::string()>& pending_names, Watchdog* watchdog) {
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
    bool done = false;
    const Status tested = control_plane_->TestBitwiseAnd(&done);
    if (!tested.ok()) return tested;
    if (done) {
      in_negotiation_ = false;
      ++cycles_done_;
      return Status::OK();
    }
    // Peers usually arrive within microseconds: yield first, then poll gently, since a blocking
    // wait (MPI's) spins a core and on small machines that core trains the model.
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
  int peer = 0;
  StallMessage kind;
  int64_t message = 0;
  while (control_plane_->Receive(&peer, &kind, &message)) {
    if (kind == StallMessage::kQuestion) {
      control_plane_->Post(peer, StallMessage::kReply, in_negotiation_ ? cycles_done_ : -1);
    } else {
      peer_cycle_[peer] = message;
      unanswered_since_[peer] = Clock::time_point{};
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
  // Never a blocking send: one to a peer whose process died while its host stays up may never
  // return, and the collective timeout below would never fire. A peer that has not taken the
  // last question gets no new one.
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    control_plane_->Post(r, StallMessage::kQuestion, cycles_done_);
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
