// Every rank's wait for its peers in a negotiation, and what it says when the wait is long:
// which ranks are in no collective at all and which do not answer. The questions travel as
// point-to-point messages that an idle rank's engine thread answers without joining a
// negotiation. (Rank 0's view, which names what is missing, is the Coordinator's.)
#pragma once

#include <mpi.h>

#include <functional>
#include <string>
#include <vector>

#include "common.h"

namespace kerasdist {

class StallInspector {
 public:
  StallInspector(MPI_Comm comm, const EngineOptions& options);

  // Waits for the negotiation `request`, warning every stall_warning_s and failing after
  // stall_timeout_s; `pending_names` describes this rank's pending requests for the messages.
  Status WaitForPeers(MPI_Request* request, const std::function<std::string()>& pending_names);
  // Answers the other ranks' questions; an idle engine calls it now and then.
  void AnswerQueries();

 private:
  void AskWhoIsMissing();
  std::string MissingRanks() const;

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  const EngineOptions options_;
  int64_t cycles_done_ = 0;  // negotiations completed, equal on every rank
  bool in_negotiation_ = false;
  std::vector<int64_t> peer_cycle_;  // last reply per rank: the cycle it waits in, or -1 if idle
};

}  // namespace kerasdist
