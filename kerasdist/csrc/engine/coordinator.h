// Rank 0's part of negotiation: it collects the requests every rank sends through the slow
// path, checks that the ranks agree, and answers with one ordered list of responses (errors
// included) that every rank applies alike. It also decides who has joined, assigns response
// cache slots, and turns requests that wait too long into warnings, timeouts and mismatch
// errors, since only it sees every rank's requests.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "response_cache.h"

namespace kerasdist {

class Coordinator {
 public:
  Coordinator(int size, const EngineOptions& options, ResponseCache* cache);

  // Before a cycle: true when rank 0 must run the slow path although no rank sent anything
  // new, because a request has outlived the stall timeout or the mismatch check is due.
  bool ReportDue(Clock::time_point now);
  // After the cycle's bitwise AND: whether every rank said it is blocked with nothing else to
  // submit (the kAllWaiting flag), which starts or stops the mismatch clock.
  void NoteAllWaiting(bool all_waiting, Clock::time_point when);
  void NoteProgress() { all_waiting_ = false; }

  // One slow-path step: `messages[r]` is what rank r sent (cache invalidations, then
  // requests). Appends the slots to evict and the responses for every rank.
  void Step(const std::vector<std::vector<char>>& messages, std::vector<int32_t>* evicted,
            std::vector<Response>* responses);
  // The ranks that have joined, sent with every answer.
  std::vector<int64_t> JoinedRanks() const;
  // Warns about names some ranks have sent and others not, naming what the others wait in.
  void WarnAboutStalls(Clock::time_point now);

 private:
  struct Negotiation {  // a name some ranks have sent
    std::vector<std::unique_ptr<Request>> by_rank;
    int count = 0;
    Clock::time_point first_seen;   // when rank 0 first heard of it: the stall timeout counts from here
    Clock::time_point first_called;  // when the earliest rank called it: what stall warnings say
    Clock::time_point last_warning;
  };

  // The response for a name every rank that has not joined has sent.
  Response Complete(const std::string& name, std::vector<int32_t>* evicted);
  Response Validate(const std::string& name, const std::vector<const Request*>& by_rank) const;
  // The names rank `r` has sent that are still incomplete, for messages.
  std::string WaitsOf(int r, size_t limit) const;
  // True when every rank has sent at least one incomplete request.
  bool EveryRankReported() const;
  // Every rank has been blocked in collectives that pair with nothing for the mismatch
  // timeout: fails all of them with one message naming what each rank waits in.
  void FailMismatchedWaits(std::vector<Response>* responses);
  // Names older than the stall timeout fail with the ranks that never sent them.
  void FailTimedOut(Clock::time_point now, std::vector<Response>* responses);

  const int size_;
  const EngineOptions options_;
  ResponseCache* cache_;
  std::map<std::string, Negotiation> table_;
  // Join (kerasdist.join): who has joined since every rank last did, and the name they used.
  std::vector<bool> joined_;
  int32_t last_joined_ = -1;
  std::string join_name_;
  // Since when every rank has been blocked (kAllWaiting) with no progress.
  Clock::time_point all_waiting_since_{};
  bool all_waiting_ = false;
  bool mismatch_check_due_ = false;  // this cycle's step fails the mismatched waits
};

}  // namespace kerasdist
