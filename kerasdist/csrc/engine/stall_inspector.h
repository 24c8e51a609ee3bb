// Every rank's wait for its peers in a negotiation, and what it says when the wait is long:
// which ranks are in no collective at all and which do not answer. The questions travel as
// point-to-point messages that an idle rank's engine thread answers without joining a
// negotiation. (Rank 0's view, which names what is missing, is the Coordinator's.)
//
// A peer that computes (an evaluation on rank 0, a checkpoint) still answers within a fraction
// of a second, so one that leaves a question unanswered for KERASDIST_COLLECTIVE_TIMEOUT_S is
// gone, or so is the network to it: the rank then ends the job, as the Watchdog does for data
// movement that stops.
#pragma once

#include <mpi.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "watchdog.h"

namespace kerasdist {

class StallInspector {
 public:
  StallInspector(MPI_Comm comm, const EngineOptions& options);
  ~StallInspector();

  // Waits for the negotiation `request`, warning every stall_warning_s and failing after
  // stall_timeout_s; `pending_names` describes this rank's pending requests for the messages.
  // `watchdog` watches each of its MPI calls, which return at once while the peers are there.
  Status WaitForPeers(MPI_Request* request, const std::function<std::string()>& pending_names, Watchdog* watchdog);
  // Answers the other ranks' questions; an idle engine calls it now and then.
  void AnswerQueries();
  // "1 (host node2)", for messages.
  std::string RankAndHost(int rank) const;

 private:
  void AskWhoIsMissing(Clock::time_point now);
  // Sends `value` to `peer` without waiting, unless the last message in `outbox` to that peer is
  // still on its way (the peer or the link to it is gone): then nothing is sent.
  struct Outbox {
    std::vector<MPI_Request> requests;  // per rank, MPI_REQUEST_NULL once delivered
    std::unique_ptr<int64_t[]> values;  // per rank, the message in flight
  };
  void Post(Outbox* outbox, int peer, int64_t value, int tag);
  // The ranks this one waits for, as its peers' last answers describe them.
  std::string MissingRanks(Clock::time_point now) const;
  // Ends the job if a peer has left a question unanswered for the collective timeout.
  void CheckPeersAnswer(Clock::time_point now, double waited_s) const;

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  const EngineOptions options_;
  int64_t cycles_done_ = 0;  // negotiations completed, equal on every rank
  bool in_negotiation_ = false;
  int64_t asked_in_cycle_ = -1;      // the negotiation whose wait peer_cycle_ describes
  std::vector<int64_t> peer_cycle_;  // last reply per rank in that wait: the cycle it waits in, -1 if idle
  std::vector<Clock::time_point> unanswered_since_;  // per rank: its oldest unanswered question, or {}
  std::vector<std::string> hosts_;                   // per rank, for messages
  Outbox questions_, replies_;
};

}  // namespace kerasdist
