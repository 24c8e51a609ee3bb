// Every rank's wait for its peers in a negotiation, and what it says when the wait is long:
// which ranks are in no collective at all and which do not answer. The questions travel as the
// control plane's point-to-point messages, which an idle rank's engine thread answers without
// joining a negotiation. (Rank 0's view, which names what is missing, is the Coordinator's.)
//
// A peer that computes (an evaluation on rank 0, a checkpoint) still answers within a fraction
// of a second, so one that leaves a question unanswered for KERASDIST_COLLECTIVE_TIMEOUT_S is
// gone, or so is the network to it: the rank then ends the job, as the Watchdog does for data
// movement that stops.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "common.h"
#include "control_plane.h"
#include "watchdog.h"

namespace kerasdist {

class StallInspector {
 public:
  // `control_plane` outlives the inspector. Collective: every rank makes one while starting.
  StallInspector(ControlPlane* control_plane, const EngineOptions& options);

  // Waits for the control plane's bitwise AND started last, warning every stall_warning_s and
  // failing after stall_timeout_s; `pending_names` describes this rank's pending requests for the
  // messages. `watchdog` watches each of its calls, which return at once while the peers are there.
  Status WaitForPeers(const std::function<std::string()>& pending_names, Watchdog* watchdog);
  // Answers the other ranks' questions; an idle engine calls it now and then.
  void AnswerQueries();
  // "1 (host node2)", for messages.
  std::string RankAndHost(int rank) const;

 private:
  void AskWhoIsMissing(Clock::time_point now);
  // The ranks this one waits for, as its peers' last answers describe them.
  std::string MissingRanks(Clock::time_point now) const;
  // Ends the job if a peer has left a question unanswered for the collective timeout.
  void CheckPeersAnswer(Clock::time_point now, double waited_s) const;

  ControlPlane* control_plane_;
  int rank_ = 0;
  int size_ = 1;
  const EngineOptions options_;
  int64_t cycles_done_ = 0;  // negotiations completed, equal on every rank
  bool in_negotiation_ = false;
  int64_t asked_in_cycle_ = -1;      // the negotiation whose wait peer_cycle_ describes
  std::vector<int64_t> peer_cycle_;  // last reply per rank in that wait: the cycle it waits in, -1 if idle
  std::vector<Clock::time_point> unanswered_since_;  // per rank: its oldest unanswered question, or {}
  std::vector<std::string> hosts_;                   // per rank, for messages
};

}  // namespace kerasdist
