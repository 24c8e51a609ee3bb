// How the engine's ranks agree: the few small exchanges of negotiation and the stall inspector's
// questions. Where a collective's data goes is the Backend's (backend.h); the engine needs only
// these calls from a transport to decide, with the other ranks, what runs and in what order.
// MpiControlPlane is the one every job uses; tests/engine/in_process_transport.h runs ranks as
// threads of one process. A new transport (Gloo, a TCP store) is a class implementing both
// interfaces plus a function that makes them, as MakeMpiTransport does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend.h"
#include "common.h"

namespace kerasdist {

// The stall inspector's point-to-point messages (stall_inspector.h).
enum class StallMessage : uint8_t { kQuestion = 0, kReply = 1 };

class ControlPlane {
 public:
  virtual ~ControlPlane() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Every rank's host name, in rank order, for messages. Collective: every rank calls it once,
  // while starting.
  virtual std::vector<std::string> HostNames() = 0;

  // Starts the cycle's bitwise AND of `count` words across ranks, in place in `words`, and in
  // the same exchange the sum across ranks of the `sum_count` float32 values at `sums` (the small
  // allreduces that ride with negotiation, engine.cc; none when `sum_count` is 0). Every rank
  // passes the same `count` and `sum_count`, and gets bitwise the same sums. Both stay the
  // caller's until TestBitwiseAnd says done. One at a time; it completes only when every rank has
  // started it, so a rank that never does keeps the others waiting (what the stall inspector is
  // for).
  virtual Status StartBitwiseAnd(uint64_t* words, size_t count, float* sums, size_t sum_count) = 0;
  // Whether the AND started last has completed (then `words` and `sums` hold the results); never
  // blocks.
  virtual Status TestBitwiseAnd(bool* done) = 0;

  // Rank 0 receives every rank's `mine`, in rank order, in `gathered`; other ranks' `gathered`
  // is left alone. Every rank calls it, after the same AND.
  virtual Status GatherToRoot(const std::vector<char>& mine, std::vector<std::vector<char>>* gathered) = 0;
  // Rank 0's `bytes` replace every other rank's.
  virtual Status BroadcastFromRoot(std::vector<char>* bytes) = 0;

  // Sends `value` to `peer` without waiting, unless the last message of this kind to `peer` has
  // not been delivered (the peer or the link to it may be gone): then nothing is sent.
  virtual void Post(int peer, StallMessage kind, int64_t value) = 0;
  // One message that has arrived for this rank, if any; never blocks.
  virtual bool Receive(int* peer, StallMessage* kind, int64_t* value) = 0;
};

// Whether `ok` holds on every rank (a bitwise AND, waited for here): for a collective step outside
// negotiation, such as creating a device communicator, that every rank must take or none.
// Collective, and never while a negotiation's AND is in flight.
Status AllRanksAgree(ControlPlane* control_plane, bool ok, bool* every_rank);

// Where a job's bytes go: the control plane its ranks agree over and the backend that moves
// host tensors between them. The engine owns both; the backend may use the control plane's
// connections, so it is destroyed first.
struct Transport {
  std::unique_ptr<ControlPlane> control_plane;
  std::unique_ptr<Backend> backend;
};

}  // namespace kerasdist
