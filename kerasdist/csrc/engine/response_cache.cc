#include "response_cache.h"

#include <algorithm>

namespace kerasdist {

void ResponseCache::Reset(int capacity) {
  slots_.assign(capacity, Slot());
  ids_.clear();
  fifo_.clear();
  free_slots_.clear();
  for (int32_t id = capacity - 1; id >= 0; --id) free_slots_.push_back(id);
}

int32_t ResponseCache::Find(const std::string& name) const {
  auto it = ids_.find(name);
  return it == ids_.end() ? -1 : it->second;
}

void ResponseCache::Evict(const std::vector<int32_t>& ids) {
  for (int32_t id : ids) {
    if (!slots_[id].used) continue;
    ids_.erase(slots_[id].name);
    slots_[id] = Slot();
  }
}

void ResponseCache::Insert(const Response& response, const Request& request, const std::string& signature) {
  Slot& slot = slots_[response.cache_id];
  if (slot.used) ids_.erase(slot.name);
  slot.used = true;
  slot.name = response.name;
  slot.signature = signature;
  slot.response = response;
  slot.execution = request.execution;
  ids_[response.name] = response.cache_id;
}

int32_t ResponseCache::Assign(std::vector<int32_t>* evicted) {
  int32_t id;
  if (!free_slots_.empty()) {
    id = free_slots_.back();
    free_slots_.pop_back();
  } else {  // full: reuse the oldest slot
    id = fifo_.front();
    fifo_.pop_front();
    evicted->push_back(id);
  }
  fifo_.push_back(id);
  return id;
}

void ResponseCache::Release(int32_t id) {
  fifo_.erase(std::remove(fifo_.begin(), fifo_.end(), id), fifo_.end());
  free_slots_.push_back(id);
}

}  // namespace kerasdist
