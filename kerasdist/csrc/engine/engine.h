// The engine: one background thread that agrees with the other ranks on which requests are
// ready and in what order, then runs them (fused where possible) on its own communicator.
//
// Negotiation, once per cycle:
//  * fast path: each rank sets one bit per cached request it has pending; one bitwise-AND
//    allreduce says which are pending everywhere. Flag bits in word 0 (inverted, so AND acts
//    as OR) say whether any rank has something for the slow path or is shutting down.
//  * slow path: ranks send first-seen requests to rank 0, which validates that all ranks
//    agree, answers with an ordered response list (errors included) and assigns cache ids.
// Every rank applies the same responses in the same order, so results never pair the
// wrong tensors and a disagreement is an error on every rank instead of a hang.
//
// The engine runs the cycle and owns the pending collectives; its parts have one job each:
// Coordinator (rank 0's validation and ordering), ResponseCache (the fast path's slots),
// StallInspector (what a long wait for peers reports), an Executor per memory (running what was
// agreed, allreduces fused; host tensors, and device tensors in a build with a device API) and a
// Watchdog (ending the job when agreed data movement stops). Where bytes go is a Transport's
// (control_plane.h): its ControlPlane carries negotiation, its Backend moves host tensors (MPI
// for both in every job, MakeMpiTransport).
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "backend.h"
#include "collective.h"
#include "common.h"
#include "control_plane.h"
#include "coordinator.h"
#include "device_hooks.h"
#include "executor.h"
#include "phase_clock.h"
#include "response_cache.h"
#include "stall_inspector.h"
#include "timeline.h"
#include "tuner.h"
#include "watchdog.h"

namespace kerasdist {

class Engine {
 public:
  // The process's engine, which the op library and the C API use. Tests make engines of their
  // own (several in one process, one per rank, over an in-process transport).
  static Engine& Get();

  // Makes the transport with `make_transport` (every rank, in the same call: it may be
  // collective) and starts the engine thread over it.
  using TransportFactory = std::function<Status(const EngineOptions& options, Transport* transport)>;
  Status Start(const EngineOptions& options, const TransportFactory& make_transport);
  // Fails what is pending and stops the thread; every rank should call it (atexit does).
  void Shutdown();
  // True once a collective of this rank failed for a stall (the job can no longer be trusted to
  // agree) or the engine itself gave up waiting for other ranks.
  bool stalled() const;
  int rank() const { return rank_; }
  int size() const { return size_; }

  // Where fused allreduces get their buffers; the front end sets it once, before Start.
  void SetFusionBufferFactory(FusionBufferFactory factory) { fusion_buffer_factory_ = std::move(factory); }
  bool has_fusion_buffer_factory() const { return static_cast<bool>(fusion_buffer_factory_); }
  // How device tensors run; the NCCL build's front end sets it once, before Start.
  void SetDeviceHooks(DeviceHooks hooks) { device_hooks_ = std::move(hooks); }
  bool has_device_hooks() const { return static_cast<bool>(device_hooks_.create); }

  // Hands one request to the engine. On an error return, `done` is not called. `outputs` are
  // the buffers known before negotiation (broadcast, reducescatter); allreduce outputs come
  // from `allocate` or `alias` when the request runs.
  // `device` describes tensors in device memory (request.device == kGpu).
  Status Enqueue(Request request, std::vector<const void*> inputs, std::vector<void*> outputs,
                 AllocateFn allocate, AliasFn alias, DoneFn done, DeviceTensors device = {});
  // Negotiates a collective this rank could not run (`request.error` says why), so that the
  // other ranks fail the same call within a cycle instead of waiting for it. Nothing runs and
  // nothing is called back on this rank; the caller raises its own error.
  void SubmitFailure(Request request);
  // How many calls of the tf.function named `function` this rank made before this one (what
  // Request::execution carries). Counted per name, not per trace: a retrace on one rank only
  // continues the count. Every count starts again from 0 when every rank has joined (join), since
  // ranks with unequal data made unequal numbers of calls before.
  int64_t NextExecution(const std::string& function);
  // Where the engine thread's time went since it started (kerasdist.engine_times()).
  const PhaseClock& phases() const { return phases_; }
  // How many collectives of the host backend ran as the hierarchy across hosts (0 before Start).
  int64_t hierarchical_calls() const { return host_executor_ ? host_executor_->backend().HierarchicalCalls() : 0; }

 private:
  struct Ready {
    Collective* collective;
    Response response;
    Clock::time_point negotiated;
  };

  // Checks that need no other rank (and the device hooks' own); fills alltoall's default splits.
  Status CheckLocally(Request* request, const DeviceTensors& device) const;
  void Loop();
  // Returns false when the engine must stop (shutdown agreed or a fatal error).
  bool RunCycle(bool* progress);
  bool SlowPath(const std::vector<int32_t>& invalidations, std::vector<Ready>* ready);
  // A joined rank's stand-in for `response`, which it runs with zeros.
  std::unique_ptr<Collective> ZeroCollective(const Response& response);
  void Execute(std::vector<Ready>& ready);
  // The small allreduces of a cycle, if they can ride with the next cycles' AND (RunCycle).
  struct Riders {
    std::vector<uint64_t> bits;  // their cache bits (word 0 unused); empty: none
    size_t values = 0;           // float32 values in all
  };
  // A fast-path cycle's `ready` (the cache slots set in `bits`, the cycle's AND), if it could
  // ride; none otherwise.
  Riders RidersOf(const std::vector<Ready>& ready, const std::vector<uint64_t>& bits) const;
  // Runs the cycle's device collectives, creating their executor on first use.
  void ExecuteOnDevice(const Executor::Ready& ready);
  // An executor over `backend` (watched from here on) and `memory`.
  Status MakeExecutor(std::unique_ptr<Backend> backend, std::unique_ptr<TensorMemory> memory,
                      std::unique_ptr<Executor>* executor);
  void Finish(Collective* c, const Status& status);
  // Every later call fails with `reason`; what is pending fails with `pending_status`.
  void Stop(const Status& reason, const Status& pending_status);
  void FailAllPending(const Status& status);
  std::string PendingNames(size_t limit) const;

  EngineOptions options_;
  int rank_ = 0;
  int size_ = 1;
  size_t words_ = 1;  // bit-vector length in 64-bit words

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Collective>> incoming_;  // guarded by mu_
  std::unordered_set<std::string> in_flight_;          // guarded by mu_
  bool shutdown_requested_ = false;                    // guarded by mu_
  bool stopped_ = true;                                // guarded by mu_
  bool started_once_ = false;                          // guarded by mu_
  Status stop_reason_;                                 // guarded by mu_
  std::atomic<bool> work_arrived_{false};               // incoming_ non-empty, readable without mu_
  std::thread thread_;

  // Engine thread only.
  std::map<std::string, std::unique_ptr<Collective>> pending_;
  ResponseCache cache_;
  std::unique_ptr<Coordinator> coordinator_;  // rank 0 only
  std::unique_ptr<Tuner> tuner_;  // rank 0 only
  // The host backend's allreduce algorithms that a cycle's setting indexes (Tuner), and the one
  // it runs now: the same on every rank.
  std::vector<AllreduceChoice> allreduce_choices_;
  int allreduce_choice_ = 0;
  std::unique_ptr<ControlPlane> control_plane_;
  std::unique_ptr<StallInspector> stall_inspector_;
  std::unique_ptr<Watchdog> watchdog_;
  std::unique_ptr<Executor> host_executor_;  // the transport's backend over HostMemory
  FusionBufferFactory fusion_buffer_factory_;
  DeviceHooks device_hooks_;
  std::unique_ptr<Executor> device_executor_;  // created by the first device collective
  std::atomic<bool> timed_out_{false};
  Timeline timeline_;
  PhaseClock phases_;  // charged by the engine thread
  // Join (kerasdist.join). Rank 0 decides who has joined and sends the list with every
  // slow-path answer, so every rank knows it from the same cycle on; while anyone has joined,
  // every request goes through the slow path (rank 0 must see who sent what), and the fast
  // path is untouched for jobs that never join.
  bool any_joined_ = false;
  std::vector<std::unique_ptr<Collective>> zero_entries_;  // this cycle's stand-ins
  // Small allreduces that ride with negotiation (RunCycle): the set every rank has agreed may
  // ride (its values travel with the next AND), this rank's candidate (the last cycle's set, if
  // it could ride), and the values' buffer.
  Riders riding_, candidate_;
  std::vector<float> rider_values_;

  std::mutex executions_mu_;
  std::map<std::string, int64_t> executions_;  // guarded by executions_mu_
};

}  // namespace kerasdist
