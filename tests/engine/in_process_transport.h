// A second transport for the engine, for tests: a job's ranks as threads of one process, each
// with its own Engine, exchanging through one InProcessWorld instead of MPI. It implements the
// engine's two seams (control_plane.h, backend.h) and nothing else, so the engine runs over it
// unchanged: what tests/engine/in_process_test.cc checks.
//
// Every exchange is a rendezvous: each rank deposits its bytes for its next step and, once every
// rank has deposited for that step, reads all of them. Ranks take steps in the same order (the
// engine guarantees it), and a step whose kinds differ between ranks fails on every rank instead
// of pairing wrong data. Close() fails every waiting and later exchange, as a transport whose
// peers are gone would.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "control_plane.h"
#include "kernels.h"

namespace in_process {

namespace kd = kerasdist;
using Bytes = std::vector<char>;

class World {
 public:
  explicit World(int size) : size_(size), next_step_(size, 0), mailboxes_(size) {}

  int size() const { return size_; }

  // Rank `rank`'s transport; the world outlives it.
  kd::Transport TransportFor(int rank);

  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    cv_.notify_all();
  }

  // Starts rank `rank`'s next step, of `kind`, with `mine`; returns the step's number.
  int64_t Deposit(int rank, const std::string& kind, Bytes mine) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t number = next_step_[rank]++;
    Step& step = steps_[number];
    if (step.deposits.empty()) {  // the first rank to take this step
      step.deposits.resize(size_);
      step.kinds.resize(size_);
    }
    step.deposits[rank] = std::move(mine);
    step.kinds[rank] = kind;
    if (++step.deposited == size_) cv_.notify_all();
    return number;
  }

  // Every rank's deposit for step `number`, once all have made theirs; `wait` false: returns
  // false at once if they have not.
  kd::Status Collect(int64_t number, bool wait, std::vector<Bytes>* all, bool* collected) {
    std::unique_lock<std::mutex> lock(mu_);
    *collected = false;
    auto complete = [&] { return closed_ || steps_[number].deposited == size_; };
    if (wait) cv_.wait(lock, complete);
    if (closed_) return kd::Status::Aborted("in-process world: closed while waiting in a step");
    if (!complete()) return kd::Status::OK();
    Step& step = steps_[number];
    for (const std::string& kind : step.kinds) {
      if (kind != step.kinds[0]) {
        return kd::Status::Internal("in-process world: step " + std::to_string(number) + " was '" + step.kinds[0] +
                                    "' on rank 0 but '" + kind + "' on another rank");
      }
    }
    *all = step.deposits;
    *collected = true;
    if (++step.collections == size_) steps_.erase(number);
    return kd::Status::OK();
  }

  // A blocking step: deposit, then every rank's deposits.
  kd::Status Exchange(int rank, const std::string& kind, Bytes mine, std::vector<Bytes>* all) {
    bool collected = false;
    return Collect(Deposit(rank, kind, std::move(mine)), /*wait=*/true, all, &collected);
  }

  // Point-to-point messages, dropped while an earlier one of the same kind to the same peer is
  // still unread (as MpiControlPlane does with an undelivered send).
  void Post(int from, int to, kd::StallMessage kind, int64_t value) {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_ || !unread_.insert({from, to, kind}).second) return;
    mailboxes_[to].push_back({from, kind, value});
  }
  bool Receive(int rank, int* from, kd::StallMessage* kind, int64_t* value) {
    std::lock_guard<std::mutex> lock(mu_);
    if (mailboxes_[rank].empty()) return false;
    const Message message = mailboxes_[rank].front();
    mailboxes_[rank].pop_front();
    unread_.erase({message.from, rank, message.kind});
    *from = message.from;
    *kind = message.kind;
    *value = message.value;
    return true;
  }

 private:
  struct Step {
    std::vector<Bytes> deposits;
    std::vector<std::string> kinds;
    int deposited = 0;
    int collections = 0;
  };
  struct Message {
    int from;
    kd::StallMessage kind;
    int64_t value;
  };

  const int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool closed_ = false;
  std::vector<int64_t> next_step_;  // per rank
  std::map<int64_t, Step> steps_;
  std::vector<std::deque<Message>> mailboxes_;
  std::set<std::tuple<int, int, kd::StallMessage>> unread_;  // (from, to, kind)
};

class ControlPlane : public kd::ControlPlane {
 public:
  ControlPlane(World* world, int rank) : world_(world), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return world_->size(); }

  std::vector<std::string> HostNames() override {
    std::vector<std::string> hosts;
    for (int r = 0; r < size(); ++r) hosts.push_back("thread" + std::to_string(r));
    return hosts;
  }

  kd::Status StartBitwiseAnd(uint64_t* words, size_t count, float* sums, size_t sum_count) override {
    words_ = words;
    count_ = count;
    sums_ = sums;
    sum_count_ = sum_count;
    Bytes mine = ToBytes(words, count);
    const Bytes values = ToBytes(sums, sum_count, sizeof(float));
    mine.insert(mine.end(), values.begin(), values.end());
    and_step_ = world_->Deposit(rank_,
                                "bitwise AND of " + std::to_string(count) + " words with " +
                                    std::to_string(sum_count) + " sums",
                                std::move(mine));
    return kd::Status::OK();
  }

  kd::Status TestBitwiseAnd(bool* done) override {
    std::vector<Bytes> all;
    kd::Status status = world_->Collect(and_step_, /*wait=*/false, &all, done);
    if (!status.ok() || !*done) return status;
    for (const Bytes& theirs : all) {
      for (size_t w = 0; w < count_; ++w) {
        uint64_t word;
        std::memcpy(&word, theirs.data() + w * sizeof(word), sizeof(word));
        words_[w] &= word;
      }
    }
    // Added in rank order on every rank, as MPI's result is the same on every rank.
    for (size_t f = 0; f < sum_count_; ++f) {
      float total = 0;
      for (const Bytes& theirs : all) {
        float value;
        std::memcpy(&value, theirs.data() + count_ * sizeof(uint64_t) + f * sizeof(value), sizeof(value));
        total += value;
      }
      sums_[f] = total;
    }
    return kd::Status::OK();
  }

  kd::Status GatherToRoot(const Bytes& mine, std::vector<Bytes>* gathered) override {
    std::vector<Bytes> all;
    kd::Status status = world_->Exchange(rank_, "gather", mine, &all);
    if (status.ok() && rank_ == 0) *gathered = std::move(all);
    return status;
  }

  kd::Status BroadcastFromRoot(Bytes* bytes) override {
    std::vector<Bytes> all;
    kd::Status status = world_->Exchange(rank_, "broadcast", rank_ == 0 ? *bytes : Bytes{}, &all);
    if (status.ok()) *bytes = all[0];
    return status;
  }

  void Post(int peer, kd::StallMessage kind, int64_t value) override { world_->Post(rank_, peer, kind, value); }
  bool Receive(int* peer, kd::StallMessage* kind, int64_t* value) override {
    return world_->Receive(rank_, peer, kind, value);
  }

  static Bytes ToBytes(const void* data, size_t count, size_t item = sizeof(uint64_t)) {
    const char* p = static_cast<const char*>(data);
    return Bytes(p, p + count * item);
  }

 private:
  World* world_;
  const int rank_;
  uint64_t* words_ = nullptr;
  size_t count_ = 0;
  float* sums_ = nullptr;
  size_t sum_count_ = 0;
  int64_t and_step_ = -1;
};

// Combines every rank's values in rank order, the same on every rank. 16-bit floats go through
// the engine's own CombineHalves (which applies the scale); other types are combined here.
class Backend : public kd::Backend {
 public:
  Backend(World* world, int rank) : world_(world), rank_(rank) {}
  int rank() const { return rank_; }

  bool ScalesWhileCombining(kd::DataType dtype) const override { return IsHalf(dtype); }

  kd::Status Allreduce(const void* in, void* out, int64_t count, kd::DataType dtype, kd::ReduceOp op, double scale,
                       const std::string& name) override {
    std::vector<Bytes> all;
    kd::Status status = world_->Exchange(rank_, "allreduce " + name, Of(in, count, dtype), &all);
    if (status.ok()) status = Combine(all, 0, count, dtype, op, scale, out);
    return status;
  }

  kd::Status Allgather(const void* in, void* out, const std::vector<int64_t>& counts, kd::DataType dtype,
                       const std::string& name) override {
    std::vector<Bytes> all;
    kd::Status status = world_->Exchange(rank_, "allgather " + name, Of(in, counts[rank_], dtype), &all);
    char* at = static_cast<char*>(out);
    for (size_t r = 0; status.ok() && r < all.size(); ++r) at = std::copy(all[r].begin(), all[r].end(), at);
    return status;
  }

  kd::Status Broadcast(void* data, int64_t count, kd::DataType dtype, int root, const std::string& name) override {
    std::vector<Bytes> all;
    kd::Status status = world_->Exchange(rank_, "broadcast " + name, rank_ == root ? Of(data, count, dtype) : Bytes{},
                                         &all);
    if (status.ok()) std::copy(all[root].begin(), all[root].end(), static_cast<char*>(data));
    return status;
  }

  kd::Status ReduceScatter(const void* in, void* out, const std::vector<int64_t>& counts, kd::DataType dtype,
                           kd::ReduceOp op, double scale, const std::string& name) override {
    int64_t total = 0, offset = 0;
    for (size_t r = 0; r < counts.size(); ++r) {
      if (static_cast<int>(r) < rank_) offset += counts[r];
      total += counts[r];
    }
    std::vector<Bytes> all;
    kd::Status status = world_->Exchange(rank_, "reducescatter " + name, Of(in, total, dtype), &all);
    if (status.ok()) status = Combine(all, offset, counts[rank_], dtype, op, scale, out);
    return status;
  }

  kd::Status Alltoall(const void* in, const std::vector<int64_t>& send_counts, void* out,
                      const std::vector<int64_t>& recv_counts, kd::DataType dtype, const std::string& name) override {
    // Each deposit is the blocks for every rank, each after its length in values.
    Bytes mine;
    const char* from = static_cast<const char*>(in);
    for (int64_t count : send_counts) {
      const char* length = reinterpret_cast<const char*>(&count);
      mine.insert(mine.end(), length, length + sizeof(count));
      mine.insert(mine.end(), from, from + count * kd::DataTypeSize(dtype));
      from += count * kd::DataTypeSize(dtype);
    }
    std::vector<Bytes> all;
    kd::Status status = world_->Exchange(rank_, "alltoall " + name, std::move(mine), &all);
    char* at = static_cast<char*>(out);
    for (size_t sender = 0; status.ok() && sender < all.size(); ++sender) {
      const char* block = all[sender].data();
      for (int r = 0;; ++r) {
        int64_t count;
        std::memcpy(&count, block, sizeof(count));
        block += sizeof(count);
        if (r == rank_) {
          if (count != recv_counts[sender]) return kd::Status::Internal("in-process alltoall: counts disagree");
          at = std::copy(block, block + count * kd::DataTypeSize(dtype), at);
          break;
        }
        block += count * kd::DataTypeSize(dtype);
      }
    }
    return status;
  }

 private:
  static bool IsHalf(kd::DataType dtype) {
    return dtype == kd::DataType::kFloat16 || dtype == kd::DataType::kBFloat16;
  }
  static Bytes Of(const void* data, int64_t count, kd::DataType dtype) {
    return ControlPlane::ToBytes(data, count, kd::DataTypeSize(dtype));
  }

  // out = the ranks' values [offset, offset + count) combined with `op`.
  static kd::Status Combine(const std::vector<Bytes>& all, int64_t offset, int64_t count, kd::DataType dtype,
                            kd::ReduceOp op, double scale, void* out) {
    switch (dtype) {
      case kd::DataType::kFloat16:
      case kd::DataType::kBFloat16: {
        std::vector<const uint16_t*> sources;
        for (const Bytes& b : all) sources.push_back(reinterpret_cast<const uint16_t*>(b.data()) + offset);
        kd::CombineHalves(sources.data(), static_cast<int>(sources.size()), static_cast<uint16_t*>(out), count, dtype,
                          op, scale);
        return kd::Status::OK();
      }
      case kd::DataType::kFloat32: return CombineAs<float>(all, offset, count, op, out);
      case kd::DataType::kFloat64: return CombineAs<double>(all, offset, count, op, out);
      case kd::DataType::kInt32: return CombineAs<int32_t>(all, offset, count, op, out);
      case kd::DataType::kInt64: return CombineAs<int64_t>(all, offset, count, op, out);
      case kd::DataType::kUInt8: return CombineAs<uint8_t>(all, offset, count, op, out);
      case kd::DataType::kInt8: return CombineAs<int8_t>(all, offset, count, op, out);
      case kd::DataType::kBool: break;
    }
    return kd::Status::InvalidArgument("in-process backend: cannot combine bool");
  }

  template <typename T>
  static kd::Status CombineAs(const std::vector<Bytes>& all, int64_t offset, int64_t count, kd::ReduceOp op,
                              void* out) {
    std::vector<T> result(reinterpret_cast<const T*>(all[0].data()) + offset,
                          reinterpret_cast<const T*>(all[0].data()) + offset + count);
    for (size_t r = 1; r < all.size(); ++r) {
      const T* theirs = reinterpret_cast<const T*>(all[r].data()) + offset;
      for (int64_t i = 0; i < count; ++i) result[i] = Apply(result[i], theirs[i], op);
    }
    std::copy(result.begin(), result.end(), static_cast<T*>(out));
    return kd::Status::OK();
  }

  template <typename T>
  static T Apply(T a, T b, kd::ReduceOp op) {
    switch (op) {
      case kd::ReduceOp::kAverage:  // its division is the engine's
      case kd::ReduceOp::kSum: return a + b;
      case kd::ReduceOp::kProduct: return a * b;
      case kd::ReduceOp::kMin:
      case kd::ReduceOp::kMax:
        if constexpr (std::is_floating_point_v<T>) return kd::Extremum(a, b, op == kd::ReduceOp::kMax);
        return op == kd::ReduceOp::kMax ? std::max(a, b) : std::min(a, b);
    }
    return a;
  }

  World* world_;
  const int rank_;
};

inline kd::Transport World::TransportFor(int rank) {
  kd::Transport transport;
  transport.control_plane = std::make_unique<ControlPlane>(this, rank);
  transport.backend = std::make_unique<Backend>(this, rank);
  return transport;
}

}  // namespace in_process
