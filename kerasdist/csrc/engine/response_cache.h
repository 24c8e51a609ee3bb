// The responses that may take the fast path: one slot per name that every rank once sent
// alike. Every rank holds the same slots (rank 0 assigns them, and every rank applies the
// same changes in the same cycle), so a bit position of the fast path means one name
// everywhere.
#pragma once

#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

#include "common.h"

namespace kerasdist {

class ResponseCache {
 public:
  void Reset(int capacity);
  int capacity() const { return static_cast<int>(slots_.size()); }

  // The slot holding `name`, or -1.
  int32_t Find(const std::string& name) const;
  const std::string& name(int32_t id) const { return slots_[id].name; }
  const Response& response(int32_t id) const { return slots_[id].response; }
  // True when this rank sends what it sent when the slot was filled.
  bool Matches(int32_t id, const std::string& signature) const { return slots_[id].signature == signature; }
  // True when a request of `execution` may take the fast path: an eager one (-1), one from the
  // call of its tf.function that last ran this slot (a loop inside the function runs it again),
  // or from the call right after. Any other call (a rank skipped one) goes to rank 0, which
  // compares every rank's call number.
  bool Follows(int32_t id, int64_t execution) const {
    const int64_t last = slots_[id].execution;
    return execution < 0 || execution == last || execution == last + 1;
  }
  // The slot ran for a request of `execution` (every rank records the same number).
  void Ran(int32_t id, int64_t execution) { slots_[id].execution = execution; }

  // Every rank, each cycle, evictions first: a freed slot may be refilled in the same cycle.
  void Evict(const std::vector<int32_t>& ids);
  // `response.cache_id` names the slot; `request` is this rank's own, with its `signature`.
  void Insert(const Response& response, const Request& request, const std::string& signature);

  // Rank 0, which assigns the slots.
  bool used(int32_t id) const { return slots_[id].used; }
  // A free slot, or else the oldest filled one, which is appended to `evicted`.
  int32_t Assign(std::vector<int32_t>* evicted);
  // A slot some rank invalidated (its request changed) is free again at once.
  void Release(int32_t id);

 private:
  struct Slot {
    bool used = false;
    std::string name;
    std::string signature;
    Response response;
    int64_t execution = -1;  // the tf.function call that last ran it (-1: eager)
  };
  std::vector<Slot> slots_;
  std::unordered_map<std::string, int32_t> ids_;
  std::deque<int32_t> fifo_;         // rank 0: filled slots, oldest first
  std::vector<int32_t> free_slots_;  // rank 0
};

}  // namespace kerasdist
