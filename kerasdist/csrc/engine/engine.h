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
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common.h"
#include "timeline.h"

namespace kerasdist {

// Every field is set by name from kerasdist/knobs.py, which owns the defaults and the checks
// (c_api.cc refuses a start that does not name each one), so no default is written here.
struct EngineOptions {
  int64_t fusion_threshold_bytes = 0;  // 0 disables fusion
  double cycle_time_ms = 0.0;          // coalescing window after work arrives
  double stall_warning_s = 0.0;        // 0 disables warnings
  double stall_timeout_s = 0.0;        // 0: wait forever
  double mismatch_timeout_s = 0.0;     // every rank blocked in a different call; 0: never
  int cache_capacity = 0;              // requests that may take the fast path
  std::string timeline_path;           // written by rank 0 when set
  int log_level = 0;                   // 0 debug, 1 info, 2 warning, 3 error
};

class Engine {
 public:
  using Clock = std::chrono::steady_clock;

  static Engine& Get();

  // MPI must already be initialized with MPI_THREAD_MULTIPLE (mpi4py does this).
  Status Start(const EngineOptions& options);
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

  // Hands one request to the engine. On an error return, `done` is not called. `outputs` are
  // the buffers known before negotiation (broadcast, reducescatter); allreduce outputs come
  // from `allocate` or `alias` when the request runs.
  Status Enqueue(Request request, std::vector<const void*> inputs, std::vector<void*> outputs,
                 AllocateFn allocate, AliasFn alias, DoneFn done);
  // Negotiates a collective this rank could not run (`request.error` says why), so that the
  // other ranks fail the same call within a cycle instead of waiting for it. Nothing runs and
  // nothing is called back on this rank; the caller raises its own error.
  void SubmitFailure(Request request);

 private:
  struct Entry {
    Request request;
    std::string signature;
    std::vector<const void*> inputs;
    std::vector<void*> outputs;
    AllocateFn allocate;
    AliasFn alias;
    DoneFn done;
    Clock::time_point enqueued;
    bool reported = false;  // sent to rank 0 through the slow path
    Status status;          // first failure while running
    // A joined rank's stand-in for another rank's allreduce: zeros in, result dropped.
    bool zeros = false;
    std::vector<char> zero_input, zero_output;
    int contributors = 0;   // ranks whose data an Average divides by; set when it runs
  };
  struct Ready {
    Entry* entry;
    Response response;
    Clock::time_point negotiated;
  };
  struct CacheSlot {
    bool used = false;
    std::string name;
    std::string signature;  // this rank's own request when the slot was filled
    Response response;
  };
  struct Negotiation {  // rank 0 only: a name some ranks have sent
    std::vector<std::unique_ptr<Request>> by_rank;
    int count = 0;
    Clock::time_point first_seen;
    Clock::time_point last_warning;
  };

  // Checks that need no other rank; fills alltoall's default splits.
  Status CheckLocally(Request* request) const;
  void Loop();
  // Returns false when the engine must stop (shutdown agreed or a fatal error).
  bool RunCycle(bool* progress);
  Status WaitForPeers(MPI_Request* request);
  // Stall diagnosis over point-to-point messages, which an idle rank's thread answers
  // without joining a negotiation.
  void AnswerStallQueries();
  void AskWhoIsMissing();
  std::string MissingRanks();
  bool SlowPath(const std::vector<int32_t>& invalidations, std::vector<Ready>* ready);
  void CoordinatorStep(const std::vector<std::vector<char>>& messages, std::vector<int32_t>* evicted, std::vector<Response>* responses);
  Response Validate(const std::string& name, const std::vector<const Request*>& by_rank);
  // Rank 0: the response for a name every rank that has not joined has sent.
  Response Complete(const std::string& name, std::vector<int32_t>* evicted);
  // A joined rank's entry for `response`, which it runs with zeros (null if it cannot).
  std::unique_ptr<Entry> ZeroEntry(const Response& response);
  int32_t AssignCacheId(std::vector<int32_t>* evicted);
  void ApplyCacheChanges(const std::vector<int32_t>& evicted, const std::vector<Response>& responses);
  void Execute(std::vector<Ready>& ready);
  void RunAllreduces(const std::vector<Ready*>& ready);
  void RunFusedGroup(const std::vector<std::pair<Entry*, int>>& items);
  void RunAlone(Entry* e, int index);
  void RunAloneCompressed(Entry* e, int index);
  // A free pooled buffer, a new pooled one, or (pool full and busy) one of exactly `bytes`
  // that `transient` owns. Null if it cannot be allocated; `tried` is the size asked for.
  FusionBuffer* FusionBufferFor(size_t bytes, std::unique_ptr<FusionBuffer>* transient, size_t* tried);
  Status RunAllgather(Entry* e, const Response& r);
  Status RunBroadcast(Entry* e);
  Status RunReducescatter(Entry* e);
  Status RunAlltoall(Entry* e, const Response& r);
  // What a reduced output is multiplied by: its postscale, divided by the contributing ranks
  // (size, unless some have joined) for a float Average.
  double FinishScale(const Entry& e, DataType dtype) const;
  void FinishAllreduceOutput(Entry* e, int index, void* out, int64_t count);
  void Finish(Entry* e, const Status& status);
  void FailAllPending(const Status& status);
  std::string PendingNames(size_t limit) const;
  void CheckStalls(Clock::time_point now);
  // Rank 0: the names rank `r` has submitted that are still incomplete, for messages.
  std::string WaitsOf(int r, size_t limit) const;
  // Rank 0: true when every rank has reported at least one incomplete request.
  bool EveryRankReported() const;
  // Rank 0: when every rank has been blocked in collectives that pair with nothing for the
  // mismatch timeout, fails all of them with one message naming what each rank waits in.
  void FailMismatchedWaits(std::vector<Response>* responses);

  EngineOptions options_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  size_t words_ = 1;  // bit-vector length in 64-bit words

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Entry>> incoming_;   // guarded by mu_
  std::unordered_set<std::string> in_flight_;      // guarded by mu_
  bool shutdown_requested_ = false;                // guarded by mu_
  bool stopped_ = true;                            // guarded by mu_
  bool started_once_ = false;                      // guarded by mu_
  Status stop_reason_;                             // guarded by mu_
  std::atomic<bool> work_arrived_{false};           // incoming_ non-empty, readable without mu_
  std::thread thread_;

  // Engine thread only.
  std::map<std::string, std::unique_ptr<Entry>> pending_;
  std::vector<CacheSlot> cache_;
  std::unordered_map<std::string, int32_t> cache_ids_;
  std::deque<int32_t> cache_fifo_;    // rank 0: filled slots, oldest first
  std::vector<int32_t> free_slots_;   // rank 0
  std::map<std::string, Negotiation> table_;  // rank 0
  FusionBufferFactory fusion_buffer_factory_;
  std::vector<std::unique_ptr<FusionBuffer>> fusion_pool_;
  std::vector<uint16_t> half_scratch_;        // what AllreduceHalves receives before combining
  std::vector<uint16_t> compressed_scratch_;  // a large compressed tensor, as it travels
  int64_t cycles_done_ = 0;          // negotiations completed, equal on every rank
  bool in_negotiation_ = false;
  // Rank 0: since when every rank has been blocked (see kAllWaiting) with no progress.
  Clock::time_point all_waiting_since_{};
  bool all_waiting_ = false;
  bool mismatch_check_due_ = false;  // this cycle's slow path fails the mismatched waits
  std::atomic<bool> timed_out_{false};
  std::vector<int64_t> peer_cycle_;  // last reply per rank: the cycle it waits in, or -1 if idle
  Timeline timeline_;
  // Join (kerasdist.join). Rank 0 decides who has joined and sends the list with every slow-path
  // answer, so every rank knows it from the same cycle on; while it is non-empty, every request
  // goes through the slow path (rank 0 must see who sent what), and the fast path is untouched
  // for jobs that never join. Engine thread only.
  std::vector<bool> joined_;       // by rank
  bool any_joined_ = false;
  int32_t last_joined_ = -1;       // rank 0
  std::string join_name_;          // rank 0: the name the joins came with
  std::vector<std::unique_ptr<Entry>> zero_entries_;  // this cycle's stand-ins
};

void Log(int level, const char* fmt, ...);

}  // namespace kerasdist
