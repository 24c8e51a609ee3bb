// Runs negotiated collectives over one backend and the memory its tensors live in: allreduces
// fused (Fusion), the other kinds one by one, outputs allocated or stood in for, scales applied
// by the memory or carried by the backend. The engine has one for host tensors (its transport's
// backend over HostMemory) and, in a build with a device API, one for device tensors (made from
// what DeviceHooks::create returns): one algorithm for both, where only bytes and copies differ.
#pragma once

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "backend.h"
#include "collective.h"
#include "fusion.h"
#include "phase_clock.h"
#include "tensor_memory.h"
#include "timeline.h"
#include "watchdog.h"

namespace kerasdist {

class Executor {
 public:
  // Why `backend` cannot serve `memory` (memory without kernels needs a backend that scales every
  // dtype while it combines), or OK.
  static Status CheckPairing(const Backend& backend, const TensorMemory& memory);

  // `backend` should be watched (WatchedBackend); `watchdog` also watches Synchronize.
  Executor(int rank, int size, int64_t fusion_threshold_bytes, std::unique_ptr<Backend> backend,
           std::unique_ptr<TensorMemory> memory, Watchdog* watchdog, Timeline* timeline, PhaseClock* phases);

  using Ready = std::vector<std::pair<Collective*, const Response*>>;
  // Runs each of `ready` (responses without errors, in the same order on every rank) and calls
  // `finished` for each once its outputs hold its results; a failure goes to its status.
  void Run(const Ready& ready, const std::function<void(Collective*)>& finished);
  Fusion& fusion() { return fusion_; }

  // Small allreduces that ride with negotiation (Engine::RunCycle): their values travel with the
  // AND, as float32, one collective's tensors after another's. Whether `request` can: a float32
  // Sum or Average in host memory, uncompressed.
  static bool CanRide(const Request& request);
  // How many float32 values `request`'s tensors hold.
  static size_t RiderValues(const Request& request);
  // Copies `riders`' inputs, prescaled, into `values`.
  void PackRiders(const std::vector<Collective*>& riders, float* values);
  // Hands `riders` back, their outputs holding the sums at `values` (laid out as PackRiders
  // packed them), finished as a reduction here would finish them.
  void FinishRiders(const std::vector<Collective*>& riders, const float* values,
                    const std::function<void(Collective*)>& finished);
  Backend& backend() { return *backend_; }
  const Backend& backend() const { return *backend_; }

 private:
  Status RunAllgather(Collective* c, const Response& r);
  Status RunBroadcast(Collective* c);
  Status RunReducescatter(Collective* c);
  Status RunAlltoall(Collective* c, const Response& r);
  // Waits for what the memory still has enqueued, then hands `collectives` back.
  void Finish(const std::vector<Collective*>& collectives, const std::function<void(Collective*)>& finished);

  const int rank_;
  const int size_;
  std::unique_ptr<TensorMemory> memory_;  // declared first: outlives the backend, which may use its stream
  std::unique_ptr<Backend> backend_;
  Watchdog* watchdog_;
  Timeline* timeline_;
  PhaseClock* phases_;
  Fusion fusion_;
};

}  // namespace kerasdist
