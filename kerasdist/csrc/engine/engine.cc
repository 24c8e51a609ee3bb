#include "engine.h"

#include <algorithm>
#include <climits>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <sstream>

#include <sys/mman.h>

#include "kernels.h"
#include "mpi_backend.h"
#include "wire.h"

namespace kerasdist {
namespace {

constexpr uint64_t kNobodyReports = 1;   // word 0, bit 0 (AND: set only if no rank reports)
constexpr uint64_t kNobodyStops = 2;     // word 0, bit 1
// Word 0, bit 2: set by a rank whose pending requests all block their callers (or are failures
// it reported), so it can submit nothing new; after the AND, set when every rank is so stuck.
constexpr uint64_t kAllWaiting = 4;
constexpr int kFlagBits = 64;            // cache bits start at word 1
constexpr int kTagStallQuery = 17;       // point-to-point tags on the engine's communicator
constexpr int kTagStallReply = 18;
// Fused tensors start at multiples of this, so the views handed out as outputs are as aligned
// as TensorFlow's own allocations (its vectorized kernels rely on it).
constexpr size_t kFusedAlignment = 64;
// Fusing a tensor saves one MPI call (5-20 us here) and costs a copy into the buffer (25 us
// for 256 KiB at ~10 GB/s), so larger tensors are reduced alone, in their own memory. With
// ResNet-50's 214 gradients (97.6 MiB) and a 16 MiB threshold: 39 ms a step this way, 63 ms
// fusing them all.
constexpr size_t kLargestFusedBytes = 256 << 10;
// Buffers kept for reuse. A cycle uses one per fused group (a step's gradients may fill many),
// and a step's outputs may still be alive when the next step starts. Past this, buffers are
// allocated per cycle and freed with their outputs, so results a caller keeps pin no more.
constexpr size_t kPooledFusionBuffers = 32;

int g_log_level = 2;
int g_log_rank = 0;

double Seconds(Engine::Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// "rank 0 sent float32; ranks 1, 2 sent float64" — or empty when every rank agrees.
std::string DescribeDisagreement(const std::vector<std::string>& value_by_rank,
                                 const char* verb = "sent", const char* plural_verb = "sent") {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (size_t r = 0; r < value_by_rank.size(); ++r) {
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == value_by_rank[r]; });
    if (it == groups.end()) groups.push_back({value_by_rank[r], {static_cast<int>(r)}});
    else it->second.push_back(static_cast<int>(r));
  }
  if (groups.size() <= 1) return "";
  std::ostringstream out;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& ranks = groups[g].second;
    out << (g ? "; " : "") << (ranks.size() == 1 ? "rank " : "ranks ");
    for (size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
    out << " " << (ranks.size() == 1 ? verb : plural_verb) << " " << groups[g].first;
  }
  return out.str();
}

std::string RowShape(const Shape& shape) {  // every dim but the first
  return ShapeString(Shape(shape.begin() + (shape.empty() ? 0 : 1), shape.end()));
}

int64_t RowElements(const Shape& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

bool FitsInt(int64_t v) { return v <= INT_MAX; }

// Sum and Average combine alike (Average divides afterwards), so they share fused calls.
ReduceOp CombiningOp(ReduceOp op) { return op == ReduceOp::kAverage ? ReduceOp::kSum : op; }

// Fusion buffers live long, like NumPy's large arrays, and get transparent huge pages the same
// way where the kernel grants them on request: MPI's shared-memory transfers pin every page
// they touch, and 2 MiB pages make that cheaper.
void AdviseHugePages(char* data, size_t size) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + size) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);  // a hint: failure is fine
#endif
}

size_t FusedBytes(const TensorSpec& spec) {  // in the fusion buffer, as it travels
  size_t bytes = NumElements(spec.shape) * DataTypeSize(spec.wire);
  return (bytes + kFusedAlignment - 1) / kFusedAlignment * kFusedAlignment;
}

std::vector<int> ToIntCounts(const std::vector<int64_t>& v, bool* ok) {
  std::vector<int> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    if (!FitsInt(v[i])) *ok = false;
    out[i] = static_cast<int>(v[i]);
  }
  return out;
}

std::vector<int> Displacements(const std::vector<int>& counts, bool* ok) {
  std::vector<int> displs(counts.size());
  int64_t offset = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (!FitsInt(offset)) *ok = false;
    displs[i] = static_cast<int>(offset);
    offset += counts[i];
  }
  return displs;
}

Status MpiStatus(int code, const char* what, const std::string& name) {
  if (code == MPI_SUCCESS) return Status::OK();
  return Status::Internal(std::string("kerasdist: ") + what + " failed for '" + name + "': " +
                          MpiErrorString(code));
}

Status TooLarge(const std::string& name) {
  return Status::InvalidArgument("kerasdist: '" + name +
                                 "' needs more than 2^31-1 elements in one MPI call; split it");
}

}  // namespace

void Log(int level, const char* fmt, ...) {
  if (level < g_log_level) return;
  static const char* kNames[] = {"DEBUG", "INFO", "WARNING", "ERROR"};
  char message[2048];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(message, sizeof(message), fmt, args);
  va_end(args);
  std::fprintf(stderr, "[kerasdist rank %d] %s: %s\n", g_log_rank, kNames[std::min(level, 3)], message);
  std::fflush(stderr);
}

Engine& Engine::Get() {
  static Engine* engine = new Engine();  // never destroyed: kernels may outlive static teardown
  return *engine;
}

bool Engine::stalled() const {
  std::lock_guard<std::mutex> lock(mu_);
  return timed_out_ || stop_reason_.code == StatusCode::kDeadlineExceeded;
}

Status Engine::Start(const EngineOptions& options) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!stopped_) return Status::OK();
  if (started_once_) {
    return Status::FailedPrecondition(
        "kerasdist: the engine was shut down and cannot be restarted in this process");
  }
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return Status::FailedPrecondition("kerasdist: MPI is not initialized");
  int provided = 0;
  MPI_Query_thread(&provided);
  if (provided < MPI_THREAD_MULTIPLE) {
    return Status::FailedPrecondition(
        "kerasdist: MPI was initialized without MPI_THREAD_MULTIPLE; let kerasdist.init() "
        "initialize MPI (or set mpi4py.rc.thread_level = 'multiple')");
  }
  options_ = options;
  g_log_level = options.log_level;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  g_log_rank = rank_;
  CreateMpiReductions();
  options_.cache_capacity = std::max(1, options_.cache_capacity);
  words_ = 1 + (options_.cache_capacity + 63) / 64;
  cache_.assign(options_.cache_capacity, CacheSlot());
  joined_.assign(size_, false);
  for (int32_t id = options_.cache_capacity - 1; id >= 0; --id) free_slots_.push_back(id);
  if (options_.fusion_threshold_bytes > 0 && !fusion_buffer_factory_) {
    return Status::Internal("kerasdist: no fusion buffer factory; the op library registers one when it loads");
  }
  if (rank_ == 0 && !options_.timeline_path.empty() && !timeline_.Open(options_.timeline_path)) {
    Log(2, "cannot write the timeline to '%s'; continuing without it", options_.timeline_path.c_str());
  }
  stopped_ = false;
  started_once_ = true;
  thread_ = std::thread(&Engine::Loop, this);
  return Status::OK();
}

void Engine::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!thread_.joinable()) return;
    shutdown_requested_ = true;
  }
  cv_.notify_all();
  thread_.join();
  timeline_.Close();
  // The communicator and reductions are left to MPI_Finalize: after a stall the communicator
  // may still hold an unfinished negotiation, and freeing it then would be erroneous.
}

Status Engine::CheckLocally(Request* request) const {
  const std::string& name = request->name;
  if (request->kind == OpKind::kBroadcast && (request->root_rank < 0 || request->root_rank >= size_)) {
    return Status::InvalidArgument("kerasdist: root_rank " + std::to_string(request->root_rank) +
                                   " for '" + name + "' is outside [0, " + std::to_string(size_) + ")");
  }
  for (const auto& t : request->tensors) {
    bool needs_dim0 = request->kind == OpKind::kAllgather || request->kind == OpKind::kReducescatter ||
                      request->kind == OpKind::kAlltoall;
    if (needs_dim0 && t.shape.empty()) {
      return Status::InvalidArgument(std::string("kerasdist: ") + OpKindName(request->kind) +
                                     " needs a tensor of rank >= 1, got a scalar for '" + name + "'");
    }
    if (!IsFloatingPoint(t.dtype) && (request->prescale != 1.0 || request->postscale != 1.0)) {
      return Status::InvalidArgument("kerasdist: prescale/postscale factors apply to floating-point "
                                     "tensors only; '" + name + "' is " + DataTypeName(t.dtype));
    }
    if (t.dtype == DataType::kBool &&
        (request->kind == OpKind::kAllreduce || request->kind == OpKind::kReducescatter)) {
      return Status::InvalidArgument("kerasdist: cannot reduce bool tensor '" + name +
                                     "'; cast it to an integer type first");
    }
  }
  if (request->kind == OpKind::kAlltoall) {
    const Shape& shape = request->tensors[0].shape;
    if (request->splits.empty()) {
      if (shape[0] % size_ != 0) {
        return Status::InvalidArgument("kerasdist: alltoall of '" + name + "' without splits needs dim 0 (" +
                                       std::to_string(shape[0]) + ") divisible by size (" +
                                       std::to_string(size_) + "); pass splits");
      }
      request->splits.assign(size_, shape[0] / size_);
    }
    int64_t total = 0;
    bool negative = false;
    for (int64_t s : request->splits) { total += s; negative |= s < 0; }
    if (static_cast<int>(request->splits.size()) != size_ || total != shape[0] || negative) {
      return Status::InvalidArgument("kerasdist: alltoall splits for '" + name + "' must be " +
                                     std::to_string(size_) + " non-negative counts summing to dim 0 (" +
                                     std::to_string(shape[0]) + "), got " + ShapeString(request->splits));
    }
  }
  return Status::OK();
}

Status Engine::Enqueue(Request request, std::vector<const void*> inputs, std::vector<void*> outputs,
                       AllocateFn allocate, AliasFn alias, DoneFn done) {
  // A mistake that needs no other rank to see fails here, on the rank that made it, and is
  // negotiated too, so the ranks that did call correctly fail the same call instead of waiting.
  Status local = CheckLocally(&request);
  if (!local.ok()) {
    request.error = local.message;
    SubmitFailure(std::move(request));
    return local;
  }
  auto entry = std::make_unique<Entry>();
  entry->signature = RequestSignature(request);
  entry->request = std::move(request);
  entry->inputs = std::move(inputs);
  entry->outputs = std::move(outputs);
  entry->allocate = std::move(allocate);
  entry->alias = std::move(alias);
  entry->done = std::move(done);
  entry->enqueued = Clock::now();
  const std::string& name = entry->request.name;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) {
      return stop_reason_.ok()
                 ? Status::FailedPrecondition("kerasdist: not initialized; call kerasdist.init() first")
                 : Status{stop_reason_.code, "kerasdist is no longer running (" + stop_reason_.message +
                                                 "); '" + name + "' was not run"};
    }
    if (!in_flight_.insert(name).second) {
      return Status::FailedPrecondition(
          "kerasdist: a collective named '" + name + "' is already pending on rank " +
          std::to_string(rank_) + "; give concurrent collectives distinct names");
    }
    incoming_.push_back(std::move(entry));
    work_arrived_.store(true, std::memory_order_release);
  }
  cv_.notify_one();
  return Status::OK();
}

void Engine::SubmitFailure(Request request) {
  if (request.error.empty()) request.error = "failed on this rank";
  request.tensors.clear();   // nothing travels; only the name and the error matter
  request.blocking = false;  // the caller does not wait for it
  auto entry = std::make_unique<Entry>();
  entry->signature = RequestSignature(request);
  entry->request = std::move(request);
  entry->done = [](const Status&) {};
  entry->enqueued = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    // A name already pending here fails the other ranks' calls anyway (or is a duplicate).
    if (stopped_ || !in_flight_.insert(entry->request.name).second) return;
    incoming_.push_back(std::move(entry));
    work_arrived_.store(true, std::memory_order_release);
  }
  cv_.notify_one();
}

void Engine::Loop() {
  auto backoff = std::chrono::microseconds(0);
  while (true) {
    if (pending_.empty()) {
      // A training step issues collectives back to back: a short spin catches the next one
      // without the cost of a sleep and wake-up.
      const auto spin_until = Clock::now() + std::chrono::microseconds(50);
      while (!work_arrived_.load(std::memory_order_acquire) && Clock::now() < spin_until) {
        std::this_thread::yield();
      }
    }
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Idle: sleep until work or shutdown arrives. No rank needs an idle rank in a cycle:
      // the others' requests can't be ready before this rank enqueues them too.
      auto has_work = [&] { return !incoming_.empty() || !pending_.empty() || shutdown_requested_; };
      while (!cv_.wait_for(lock, std::chrono::milliseconds(200), has_work)) {
        // Idle but awake now and then, so a rank waiting for this one can learn it is idle.
        lock.unlock();
        AnswerStallQueries();
        lock.lock();
      }
      if (backoff.count() > 0 && incoming_.empty() && !shutdown_requested_) {
        // Last cycle made no progress: give the other ranks time to enqueue, but wake at once
        // when this rank gets new work.
        cv_.wait_for(lock, backoff, [&] { return !incoming_.empty() || shutdown_requested_; });
      } else if (options_.cycle_time_ms > 0 && pending_.empty() && !shutdown_requested_) {
        // Fresh work after idle: a short window lets companions join the same fused reduction.
        lock.unlock();
        std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(options_.cycle_time_ms));
      }
    }
    bool progress = false;
    if (!RunCycle(&progress)) break;
    if (progress) backoff = std::chrono::microseconds(0);
    else backoff = std::min(std::chrono::microseconds(5000),
                            std::max(std::chrono::microseconds(100), backoff * 2));
  }
}

Status Engine::WaitForPeers(MPI_Request* request) {
  const auto start = Clock::now();
  auto next_warning = start + std::chrono::duration<double>(options_.stall_warning_s);
  bool asked = false;
  in_negotiation_ = true;
  while (true) {
    int done = 0;
    int code = MPI_Test(request, &done, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS) return MpiStatus(code, "negotiation", "(cycle)");
    if (done) {
      in_negotiation_ = false;
      ++cycles_done_;
      return Status::OK();
    }
    // Peers usually arrive within microseconds: yield first, then poll gently, since MPI's
    // own wait spins a core and on small machines that core trains the model.
    const double waited = Seconds(Clock::now() - start);
    if (waited < 1e-3) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(waited < 0.05 ? std::chrono::microseconds(20) : std::chrono::microseconds(500));
    if (waited < 0.05) continue;
    AnswerStallQueries();
    auto now = Clock::now();
    if (options_.stall_warning_s > 0 && !asked && Seconds(now - start) > options_.stall_warning_s / 2) {
      AskWhoIsMissing();
      asked = true;
    }
    if (options_.stall_warning_s > 0 && now >= next_warning) {
      Log(2, "stall: waited %.0f s for %s to submit collectives; pending on this rank: %s. "
             "Every rank must run the same collectives.",
          Seconds(now - start), MissingRanks().c_str(), PendingNames(8).c_str());
      next_warning = now + std::chrono::duration<double>(options_.stall_warning_s);
      asked = false;
    }
    if (options_.stall_timeout_s > 0 && Seconds(now - start) > options_.stall_timeout_s) {
      return Status::DeadlineExceeded(
          "kerasdist: stalled for more than " + std::to_string(static_cast<int>(options_.stall_timeout_s)) +
          " s (KERASDIST_STALL_TIMEOUT_S) waiting for " + MissingRanks() + "; pending on rank " +
          std::to_string(rank_) + ": " + PendingNames(8));
    }
  }
}

void Engine::AnswerStallQueries() {
  int flag = 1;
  while (flag) {
    MPI_Status status;
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &flag, &status);
    if (!flag) break;
    int64_t message = 0;
    MPI_Recv(&message, 1, MPI_INT64_T, status.MPI_SOURCE, status.MPI_TAG, comm_, MPI_STATUS_IGNORE);
    if (status.MPI_TAG == kTagStallQuery) {
      int64_t reply = in_negotiation_ ? cycles_done_ : -1;
      MPI_Send(&reply, 1, MPI_INT64_T, status.MPI_SOURCE, kTagStallReply, comm_);
    } else {
      peer_cycle_[status.MPI_SOURCE] = message;
    }
  }
}

void Engine::AskWhoIsMissing() {
  peer_cycle_.assign(size_, -2);  // -2: no answer yet
  int64_t query = cycles_done_;
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) MPI_Send(&query, 1, MPI_INT64_T, r, kTagStallQuery, comm_);
  }
}

std::string Engine::MissingRanks() {
  std::string idle, silent;
  for (int r = 0; r < static_cast<int>(peer_cycle_.size()); ++r) {
    if (r == rank_ || peer_cycle_[r] == cycles_done_) continue;  // waiting in this same negotiation
    std::string& list = peer_cycle_[r] == -2 ? silent : idle;
    list += (list.empty() ? "" : ", ") + std::to_string(r);
  }
  if (idle.empty() && silent.empty()) return "other ranks";
  std::string out;
  if (!idle.empty()) out = "rank(s) " + idle + " (not in any collective)";
  if (!silent.empty()) out += (out.empty() ? "" : " and ") + std::string("rank(s) ") + silent + " (not answering)";
  return out;
}

bool Engine::RunCycle(bool* progress) {
  bool shutting_down;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& e : incoming_) {
      std::string name = e->request.name;
      pending_.emplace(std::move(name), std::move(e));
    }
    incoming_.clear();
    work_arrived_.store(false, std::memory_order_release);
    shutting_down = shutdown_requested_;
  }
  const auto now = Clock::now();
  const double stale_s = options_.stall_warning_s / 2;
  // A blocking request still waiting by then goes to rank 0 as well, which needs every rank's
  // waits in hand to tell a mismatch from a late rank.
  const double blocking_stale_s = options_.mismatch_timeout_s / 2;

  // Fast-path bits for cached requests; everything else goes to rank 0.
  std::vector<uint64_t> bits(words_, 0);
  std::vector<int32_t> invalidations;
  bool report = false;
  bool any_blocking = false, none_free = true;
  for (auto& [name, e] : pending_) {
    any_blocking |= e->request.blocking;
    none_free &= e->request.blocking || !e->request.error.empty();
    if (e->reported) continue;
    auto it = cache_ids_.find(name);
    if (it != cache_ids_.end()) {
      const double waited = Seconds(now - e->enqueued);
      bool stale = (options_.stall_warning_s > 0 && waited > stale_s) ||
                   (e->request.blocking && options_.mismatch_timeout_s > 0 && waited > blocking_stale_s);
      if (cache_[it->second].signature == e->signature && !stale) {
        if (!any_joined_) {
          int bit = kFlagBits + it->second;
          bits[bit / 64] |= uint64_t{1} << (bit % 64);
          continue;
        }
        // Some rank has joined: rank 0 must see who sent it; the slot stays valid.
      } else {
        // Changed request, or waiting long enough that rank 0 should see who is missing.
        invalidations.push_back(it->second);
      }
    }
    report = true;
  }
  mismatch_check_due_ = false;
  if (rank_ == 0) {
    for (auto& [name, n] : table_) {
      if (options_.stall_timeout_s > 0 && Seconds(now - n.first_seen) > options_.stall_timeout_s) report = true;
    }
    if (all_waiting_ && options_.mismatch_timeout_s > 0 &&
        Seconds(now - all_waiting_since_) >= options_.mismatch_timeout_s && EveryRankReported()) {
      report = mismatch_check_due_ = true;
    }
  }
  if (!report) bits[0] |= kNobodyReports;
  if (!shutting_down) bits[0] |= kNobodyStops;
  if (any_blocking && none_free) bits[0] |= kAllWaiting;

  MPI_Request request;
  int code = MPI_Iallreduce(MPI_IN_PLACE, bits.data(), static_cast<int>(words_), MPI_UINT64_T,
                            MPI_BAND, comm_, &request);
  Status status = code == MPI_SUCCESS ? WaitForPeers(&request) : MpiStatus(code, "negotiation", "(cycle)");
  if (!status.ok()) {
    Log(3, "%s", status.message.c_str());
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_reason_ = status;
      stopped_ = true;
    }
    FailAllPending(status);
    return false;
  }

  std::vector<Ready> ready;
  const auto negotiated = Clock::now();
  if (rank_ == 0) {
    const bool all_waiting = bits[0] & kAllWaiting;
    if (all_waiting && !all_waiting_) all_waiting_since_ = negotiated;
    all_waiting_ = all_waiting;
    mismatch_check_due_ &= all_waiting;
  }
  for (size_t w = 1; w < words_; ++w) {
    for (uint64_t word = bits[w]; word; word &= word - 1) {
      int32_t id = static_cast<int32_t>((w * 64 + __builtin_ctzll(word)) - kFlagBits);
      auto it = pending_.find(cache_[id].name);
      ready.push_back({it->second.get(), cache_[id].response, negotiated});
    }
  }
  if (!(bits[0] & kNobodyReports) && !SlowPath(invalidations, &ready)) return false;

  if (timeline_.enabled()) timeline_.CycleMark(negotiated, static_cast<int>(ready.size()));
  *progress = !ready.empty();
  if (*progress) all_waiting_ = false;
  Execute(ready);
  zero_entries_.clear();

  if (!(bits[0] & kNobodyStops)) {
    Status stop = Status::Aborted("kerasdist was shut down (on this or another rank)");
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_reason_ = stop;
      stopped_ = true;
    }
    FailAllPending(Status::Aborted("kerasdist was shut down on this or another rank while this "
                                   "collective was pending; every rank must run the same collectives"));
    return false;
  }
  if (rank_ == 0) CheckStalls(Clock::now());
  return true;
}

bool Engine::SlowPath(const std::vector<int32_t>& invalidations, std::vector<Ready>* ready) {
  ByteWriter out;
  out.PutInts(std::vector<int64_t>(invalidations.begin(), invalidations.end()));
  std::vector<Entry*> reporting;
  for (auto& [name, e] : pending_) {
    if (e->reported) continue;
    auto it = cache_ids_.find(name);
    bool invalidated = it != cache_ids_.end() &&
        std::find(invalidations.begin(), invalidations.end(), it->second) != invalidations.end();
    if (it != cache_ids_.end() && !invalidated && !any_joined_) continue;  // took the fast path this cycle
    reporting.push_back(e.get());
  }
  out.Put<uint32_t>(static_cast<uint32_t>(reporting.size()));
  for (Entry* e : reporting) {
    WriteRequest(out, e->request);
    e->reported = true;
  }

  int my_size = static_cast<int>(out.bytes().size());
  std::vector<int> sizes(rank_ == 0 ? size_ : 0);
  MPI_Gather(&my_size, 1, MPI_INT, sizes.data(), 1, MPI_INT, 0, comm_);
  std::vector<int> displs;
  std::vector<char> gathered;
  if (rank_ == 0) {
    bool ok = true;
    displs = Displacements(sizes, &ok);
    gathered.resize(static_cast<size_t>(displs.back()) + sizes.back());
  }
  MPI_Gatherv(out.bytes().data(), my_size, MPI_BYTE, gathered.data(), sizes.data(), displs.data(),
              MPI_BYTE, 0, comm_);

  ByteWriter answer;
  if (rank_ == 0) {
    std::vector<std::vector<char>> messages(size_);
    for (int r = 0; r < size_; ++r) {
      messages[r].assign(gathered.begin() + displs[r], gathered.begin() + displs[r] + sizes[r]);
    }
    std::vector<int32_t> evicted;
    std::vector<Response> responses;
    CoordinatorStep(messages, &evicted, &responses);
    answer.PutInts(std::vector<int64_t>(evicted.begin(), evicted.end()));
    std::vector<int64_t> joined;
    for (int r = 0; r < size_; ++r) if (joined_[r]) joined.push_back(r);
    answer.PutInts(joined);
    answer.Put<uint32_t>(static_cast<uint32_t>(responses.size()));
    for (const auto& r : responses) WriteResponse(answer, r);
  }
  int answer_size = static_cast<int>(answer.bytes().size());
  MPI_Bcast(&answer_size, 1, MPI_INT, 0, comm_);
  answer.bytes().resize(answer_size);
  MPI_Bcast(answer.bytes().data(), answer_size, MPI_BYTE, 0, comm_);

  ByteReader in(answer.bytes().data(), answer.bytes().size());
  std::vector<int64_t> evicted64 = in.GetInts();
  std::vector<int32_t> evicted(evicted64.begin(), evicted64.end());
  std::vector<int64_t> joined = in.GetInts();
  joined_.assign(size_, false);
  for (int64_t r : joined) joined_[r] = true;
  any_joined_ = !joined.empty();
  std::vector<Response> responses(in.Get<uint32_t>());
  for (auto& r : responses) r = ReadResponse(in);
  ApplyCacheChanges(evicted, responses);

  const auto negotiated = Clock::now();
  for (auto& r : responses) {
    auto it = pending_.find(r.name);
    const bool zeros = std::find(r.zero_ranks.begin(), r.zero_ranks.end(), rank_) != r.zero_ranks.end();
    if (it != pending_.end() && (it->second->reported || zeros)) {
      ready->push_back({it->second.get(), std::move(r), negotiated});
    } else if (zeros) {  // this rank has joined: it takes part with zeros
      std::unique_ptr<Entry> stand_in = ZeroEntry(r);
      ready->push_back({stand_in.get(), std::move(r), negotiated});
      zero_entries_.push_back(std::move(stand_in));
    }
    // Otherwise a stall error naming a request this rank never sent.
  }
  return true;
}

void Engine::CoordinatorStep(const std::vector<std::vector<char>>& messages,
                             std::vector<int32_t>* evicted, std::vector<Response>* responses) {
  const auto now = Clock::now();
  std::vector<std::string> completed;
  for (int r = 0; r < size_; ++r) {
    ByteReader in(messages[r].data(), messages[r].size());
    for (int64_t id : in.GetInts()) {
      if (cache_[id].used && std::find(evicted->begin(), evicted->end(), id) == evicted->end()) {
        evicted->push_back(static_cast<int32_t>(id));
      }
    }
    uint32_t count = in.Get<uint32_t>();
    for (uint32_t i = 0; i < count; ++i) {
      auto request = std::make_unique<Request>(ReadRequest(in));
      if (request->kind == OpKind::kJoin) {  // kept apart: it completes when every rank has joined
        if (!joined_[r]) last_joined_ = r;
        joined_[r] = true;
        join_name_ = request->name;
        continue;
      }
      std::string name = request->name;
      auto [it, fresh] = table_.try_emplace(name);
      Negotiation& n = it->second;
      if (fresh) {
        n.by_rank.resize(size_);
        n.first_seen = now;
        n.last_warning = now;
      }
      if (!n.by_rank[r]) ++n.count;
      n.by_rank[r] = std::move(request);
      if (n.count == size_) completed.push_back(name);
    }
  }
  // Freed slots are reusable at once: every rank applies evictions before insertions.
  for (int32_t id : *evicted) {
    cache_fifo_.erase(std::remove(cache_fifo_.begin(), cache_fifo_.end(), id), cache_fifo_.end());
    free_slots_.push_back(id);
  }
  const bool any_joined = std::find(joined_.begin(), joined_.end(), true) != joined_.end();
  if (any_joined) {  // a join may have completed names that were waiting for the joined ranks only
    for (const auto& [name, n] : table_) {
      bool complete = true;
      for (int r = 0; r < size_ && complete; ++r) complete = n.by_rank[r] || joined_[r];
      if (complete && n.count < size_) completed.push_back(name);
    }
  }
  for (const std::string& name : completed) {
    responses->push_back(Complete(name, evicted));
    table_.erase(name);
  }
  const bool all_joined = any_joined && std::find(joined_.begin(), joined_.end(), false) == joined_.end();
  if (all_joined) {
    // Every rank has joined: the joins complete, after this cycle's other responses, and the
    // next epoch starts with nobody joined.
    Response response;
    response.name = join_name_;
    response.last_joined_rank = last_joined_;
    responses->push_back(std::move(response));
    joined_.assign(size_, false);
    last_joined_ = -1;
  }
  // Something completing is progress: the waits were not stuck after all.
  if (mismatch_check_due_ && completed.empty() && !all_joined) FailMismatchedWaits(responses);
  if (options_.stall_timeout_s > 0) {
    for (auto it = table_.begin(); it != table_.end();) {
      if (Seconds(now - it->second.first_seen) <= options_.stall_timeout_s) { ++it; continue; }
      std::string missing;
      for (int r = 0; r < size_; ++r) {
        if (!it->second.by_rank[r] && !joined_[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      Response response;
      response.name = it->first;
      response.status = Status::DeadlineExceeded(
          "kerasdist: '" + it->first + "' stalled for more than " +
          std::to_string(static_cast<int>(options_.stall_timeout_s)) +
          " s (KERASDIST_STALL_TIMEOUT_S): rank(s) " + missing + " never submitted it");
      responses->push_back(std::move(response));
      it = table_.erase(it);
    }
  }
}

int32_t Engine::AssignCacheId(std::vector<int32_t>* evicted) {
  int32_t id;
  if (!free_slots_.empty()) {
    id = free_slots_.back();
    free_slots_.pop_back();
  } else {  // full: reuse the oldest slot
    id = cache_fifo_.front();
    cache_fifo_.pop_front();
    evicted->push_back(id);
  }
  cache_fifo_.push_back(id);
  return id;
}

void Engine::ApplyCacheChanges(const std::vector<int32_t>& evicted, const std::vector<Response>& responses) {
  for (int32_t id : evicted) {
    if (!cache_[id].used) continue;
    cache_ids_.erase(cache_[id].name);
    cache_[id] = CacheSlot();
  }
  for (const Response& r : responses) {
    if (r.cache_id < 0) continue;
    auto it = pending_.find(r.name);
    CacheSlot& slot = cache_[r.cache_id];
    if (slot.used) cache_ids_.erase(slot.name);
    slot.used = true;
    slot.name = r.name;
    slot.signature = it->second->signature;
    slot.response = r;
    cache_ids_[r.name] = r.cache_id;
  }
}

Response Engine::Complete(const std::string& name, std::vector<int32_t>* evicted) {
  const Negotiation& n = table_[name];
  // Ranks that joined without sending this take part with zeros; they need no checking.
  std::vector<const Request*> by_rank(size_, nullptr);
  const Request* sent = nullptr;
  for (int r = 0; r < size_; ++r) {
    by_rank[r] = n.by_rank[r].get();
    if (!sent && by_rank[r]) sent = by_rank[r];
  }
  std::vector<int64_t> zero_ranks;
  for (int r = 0; r < size_; ++r) {
    if (by_rank[r]) continue;
    by_rank[r] = sent;
    zero_ranks.push_back(r);
  }
  Response response = Validate(name, by_rank);
  if (response.status.ok() && zero_ranks.empty()) {
    // A name cached already (re-sent while some rank had joined) keeps its slot.
    auto cached = cache_ids_.find(name);
    bool keeps_slot = cached != cache_ids_.end() &&
                      std::find(evicted->begin(), evicted->end(), cached->second) == evicted->end();
    if (!keeps_slot) response.cache_id = AssignCacheId(evicted);
  }
  if (!response.status.ok() || zero_ranks.empty()) return response;
  std::string ranks;
  for (int64_t r : zero_ranks) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  const char* kind = OpKindName(sent->kind);
  if (sent->kind != OpKind::kAllreduce) {
    response.status = Status::FailedPrecondition(
        std::string("kerasdist: cannot run ") + kind + " '" + name + "' while rank(s) " + ranks +
        " have joined (kerasdist.join) without it: a joined rank has no data to send. Only allreduce "
        "with Sum or Average runs until every rank has joined; call join() after the last collective "
        "that needs every rank.");
  } else if (sent->reduce_op != ReduceOp::kSum && sent->reduce_op != ReduceOp::kAverage) {
    response.status = Status::FailedPrecondition(
        std::string("kerasdist: cannot run allreduce '") + name + "' with op " + ReduceOpName(sent->reduce_op) +
        " while rank(s) " + ranks + " have joined (kerasdist.join): a joined rank contributes zeros, "
        "which only Sum and Average can take. Reduce with Sum or Average, or before joining.");
  } else {
    response.contributors = size_ - static_cast<int32_t>(zero_ranks.size());
    response.zero_ranks = std::move(zero_ranks);
    Request spec = *sent;
    spec.blocking = false;
    response.spec = RequestSignature(spec);
  }
  return response;
}

std::unique_ptr<Engine::Entry> Engine::ZeroEntry(const Response& response) {
  auto e = std::make_unique<Entry>();
  ByteReader in(response.spec.data(), response.spec.size());
  e->request = ReadRequest(in);
  e->zeros = true;
  e->enqueued = Clock::now();
  std::vector<size_t> offsets{0};
  for (const auto& t : e->request.tensors) {
    const size_t bytes = NumElements(t.shape) * DataTypeSize(t.dtype);
    offsets.push_back(offsets.back() + (bytes + kFusedAlignment - 1) / kFusedAlignment * kFusedAlignment);
  }
  e->zero_input.assign(offsets.back() + kFusedAlignment, 0);
  e->zero_output.assign(offsets.back() + kFusedAlignment, 0);
  for (size_t t = 0; t < e->request.tensors.size(); ++t) e->inputs.push_back(e->zero_input.data() + offsets[t]);
  Entry* self = e.get();
  e->allocate = [self, offsets](int index, const Shape&, void** data) {
    *data = self->zero_output.data() + offsets[index];
    return Status::OK();
  };
  e->alias = [](int, FusionBuffer*, size_t, const Shape&) { return Status::OK(); };  // the result is dropped
  e->done = [](const Status&) {};
  return e;
}

Response Engine::Validate(const std::string& name, const std::vector<const Request*>& by_rank) {
  Response response;
  response.name = name;
  auto fail = [&](const std::string& what, const std::vector<std::string>& values, const std::string& fix) {
    response.status = Status::FailedPrecondition("kerasdist: mismatched " + what + " for '" + name +
                                                 "': " + DescribeDisagreement(values) + ". " + fix);
    return response;
  };
  auto per_rank = [&](auto field) {
    std::vector<std::string> values;
    for (const auto& r : by_rank) values.push_back(field(*r));
    return values;
  };
  auto disagree = [](const std::vector<std::string>& v) {
    return std::any_of(v.begin(), v.end(), [&](const std::string& x) { return x != v[0]; });
  };

  // A rank that could not run the call told us why: every rank fails it with that reason.
  std::string failures;
  for (size_t r = 0; r < by_rank.size(); ++r) {
    if (by_rank[r]->error.empty()) continue;
    failures += std::string(failures.empty() ? "" : "; ") + "rank " + std::to_string(r) + ": " + by_rank[r]->error;
  }
  if (!failures.empty()) {
    response.status = Status::InvalidArgument("kerasdist: '" + name + "' failed on every rank because a rank "
                                              "could not run it (" + failures + ")");
    return response;
  }

  auto kinds = per_rank([](const Request& r) { return std::string(OpKindName(r.kind)); });
  if (disagree(kinds)) return fail("collective", kinds, "Every rank must call the same op for one name.");
  auto counts = per_rank([](const Request& r) { return std::to_string(r.tensors.size()) + " tensor(s)"; });
  if (disagree(counts)) return fail("group size", counts, "Every rank must group the same tensors.");
  const Request& first = *by_rank[0];
  for (size_t t = 0; t < first.tensors.size(); ++t) {
    auto dtypes = per_rank([&](const Request& r) {
      const TensorSpec& spec = r.tensors[t];
      return std::string(DataTypeName(spec.dtype)) +
             (spec.compressed() ? std::string(" compressed to ") + DataTypeName(spec.wire) : "");
    });
    if (disagree(dtypes)) return fail("dtype", dtypes, "Cast to one dtype on every rank first.");
    auto ndims = per_rank([&](const Request& r) { return "rank-" + std::to_string(r.tensors[t].shape.size()) + " tensor"; });
    if (disagree(ndims)) return fail("number of dimensions", ndims, "");
    bool dim0_may_differ = first.kind == OpKind::kAllgather || first.kind == OpKind::kAlltoall;
    auto shapes = per_rank([&](const Request& r) {
      return dim0_may_differ ? "rows of shape " + RowShape(r.tensors[t].shape) : "shape " + ShapeString(r.tensors[t].shape);
    });
    if (disagree(shapes)) {
      return fail("shape", shapes, dim0_may_differ ? "Only the first dimension may differ between ranks."
                                                   : "Every rank must pass the same shape.");
    }
  }
  if (first.kind == OpKind::kAllreduce || first.kind == OpKind::kReducescatter) {
    auto ops = per_rank([](const Request& r) { return std::string(ReduceOpName(r.reduce_op)); });
    if (disagree(ops)) return fail("reduce op", ops, "");
    auto scales = per_rank([](const Request& r) {
      std::ostringstream s;
      s << "prescale " << r.prescale << ", postscale " << r.postscale;
      return s.str();
    });
    if (disagree(scales)) return fail("scale factors", scales, "");
  }
  if (first.kind == OpKind::kBroadcast) {
    auto roots = per_rank([](const Request& r) { return "root_rank " + std::to_string(r.root_rank); });
    if (disagree(roots)) return fail("root rank", roots, "Every rank must name the same root.");
  }
  if (first.kind == OpKind::kAllgather) {
    for (const auto& r : by_rank) response.rank_rows.push_back(r->tensors[0].shape[0]);
  }
  if (first.kind == OpKind::kAlltoall) {
    for (const auto& r : by_rank) {
      response.alltoall_rows.insert(response.alltoall_rows.end(), r->splits.begin(), r->splits.end());
    }
  }
  return response;
}

void Engine::CheckStalls(Clock::time_point now) {
  if (options_.stall_warning_s <= 0) return;
  for (auto& [name, n] : table_) {
    if (Seconds(now - n.last_warning) < options_.stall_warning_s / 2 ||
        Seconds(now - n.first_seen) < options_.stall_warning_s / 2) {
      continue;
    }
    std::string missing, present, elsewhere;
    for (int r = 0; r < size_; ++r) {
      if (!n.by_rank[r] && joined_[r]) continue;  // joined: it takes part with zeros, not missing
      std::string& list = n.by_rank[r] ? present : missing;
      list += (list.empty() ? "" : ", ") + std::to_string(r);
      const std::string waits = n.by_rank[r] ? "" : WaitsOf(r, 2);
      if (!waits.empty()) elsewhere += "; rank " + std::to_string(r) + " waits in " + waits;
    }
    Log(2, "stall: '%s' was submitted by rank(s) %s but not by rank(s) %s (waiting %.0f s)%s. "
           "Ranks must run the same collectives.",
        name.c_str(), present.c_str(), missing.c_str(), Seconds(now - n.first_seen) + options_.stall_warning_s / 2,
        elsewhere.c_str());
    n.last_warning = now;
  }
}

std::string Engine::WaitsOf(int r, size_t limit) const {
  std::string names;
  size_t count = 0;
  for (const auto& [name, n] : table_) {
    if (!n.by_rank[r]) continue;
    if (count++ < limit) names += (names.empty() ? "'" : ", '") + name + "'";
  }
  if (joined_[r]) names += (names.empty() ? "'" : ", '") + join_name_ + "'";
  if (count > limit) names += " and " + std::to_string(count - limit) + " more";
  return names;
}

bool Engine::EveryRankReported() const {
  std::vector<bool> seen(size_, false);
  for (const auto& [name, n] : table_) {
    for (int r = 0; r < size_; ++r) seen[r] = seen[r] || n.by_rank[r] != nullptr;
  }
  for (int r = 0; r < size_; ++r) seen[r] = seen[r] || joined_[r];  // waits in join
  return std::all_of(seen.begin(), seen.end(), [](bool b) { return b; });
}

void Engine::FailMismatchedWaits(std::vector<Response>* responses) {
  std::vector<std::string> waits(size_);
  for (int r = 0; r < size_; ++r) waits[r] = WaitsOf(r, 3);
  std::string described = DescribeDisagreement(waits, "waits in", "wait in");
  if (described.empty()) described = "every rank waits in " + waits[0];
  std::ostringstream timeout;
  timeout << options_.mismatch_timeout_s;
  const Status status = Status::FailedPrecondition(
      "kerasdist: the ranks are blocked in different collectives, so none of them can complete: " +
      described +
      ". Every rank must make the same collective calls in the same order; a call made on some ranks "
      "only (for example under `if rank == 0:`) pairs with nothing. Unnamed eager calls are named by "
      "file:line and a count of calls there, so calls from different lines never pair: pass the same "
      "name= to calls that belong together. (Found after every rank waited " + timeout.str() +
      " s; KERASDIST_MISMATCH_TIMEOUT_S sets this.)");
  for (const auto& [name, n] : table_) {
    Response response;
    response.name = name;
    response.status = status;
    responses->push_back(std::move(response));
  }
  table_.clear();
}

void Engine::Execute(std::vector<Ready>& ready) {
  // Allreduces first (they fuse), then the rest; the order is the same on every rank.
  std::vector<Ready*> allreduces, others;
  for (Ready& r : ready) {
    r.entry->contributors = r.response.contributors;
    bool fusable = r.entry->request.kind == OpKind::kAllreduce && r.response.status.ok();
    (fusable ? allreduces : others).push_back(&r);
  }
  RunAllreduces(allreduces);
  for (Ready* r : others) {
    Entry* e = r->entry;
    if (timeline_.enabled()) timeline_.Phase(e->request.name, "queued", e->enqueued, r->negotiated);
    Status status = r->response.status;
    if (status.ok()) {
      auto start = Clock::now();
      switch (e->request.kind) {
        case OpKind::kAllgather: status = RunAllgather(e, r->response); break;
        case OpKind::kBroadcast: status = RunBroadcast(e); break;
        case OpKind::kReducescatter: status = RunReducescatter(e); break;
        case OpKind::kAlltoall: status = RunAlltoall(e, r->response); break;
        case OpKind::kJoin: *static_cast<int32_t*>(e->outputs[0]) = r->response.last_joined_rank; break;
        case OpKind::kAllreduce: break;
      }
      if (timeline_.enabled()) timeline_.Phase(e->request.name, OpKindName(e->request.kind), start, Clock::now());
    }
    Finish(e, status);
  }
}

void Engine::RunAllreduces(const std::vector<Ready*>& ready) {
  // Tensors that share a dtype and a way of combining travel together, in negotiated order.
  std::vector<std::pair<std::pair<DataType, ReduceOp>, std::vector<std::pair<Entry*, int>>>> groups;
  std::vector<Entry*> entries;
  for (Ready* r : ready) {
    Entry* e = r->entry;
    entries.push_back(e);
    if (timeline_.enabled()) timeline_.Phase(e->request.name, "queued", e->enqueued, r->negotiated);
    for (int t = 0; t < static_cast<int>(e->request.tensors.size()); ++t) {
      auto key = std::make_pair(e->request.tensors[t].wire, CombiningOp(e->request.reduce_op));
      auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == key; });
      if (it == groups.end()) { groups.push_back({key, {}}); it = groups.end() - 1; }
      it->second.push_back({e, t});
    }
  }
  // A fused group is one MPI call, whose count is an int.
  const size_t threshold = static_cast<size_t>(std::clamp<int64_t>(options_.fusion_threshold_bytes, 0, INT_MAX));
  for (auto& [key, candidates] : groups) {
    std::vector<std::pair<Entry*, int>> items;  // the ones worth fusing, in negotiated order
    for (auto& item : candidates) {
      if (FusedBytes(item.first->request.tensors[item.second]) > kLargestFusedBytes) {
        RunAlone(item.first, item.second);
      } else {
        items.push_back(item);
      }
    }
    size_t begin = 0;
    while (begin < items.size()) {
      // Pack consecutive tensors while they fit under the fusion threshold.
      size_t end = begin, bytes = 0;
      while (end < items.size()) {
        size_t b = FusedBytes(items[end].first->request.tensors[items[end].second]);
        if (end > begin && bytes + b > threshold) break;
        bytes += b;
        ++end;
      }
      RunFusedGroup({items.begin() + begin, items.begin() + end});
      begin = end;
    }
  }
  for (Entry* e : entries) Finish(e, e->status);
}

double Engine::FinishScale(const Entry& e, DataType dtype) const {
  const bool divides = e.request.reduce_op == ReduceOp::kAverage && IsFloatingPoint(dtype);
  return divides ? e.request.postscale / (e.contributors > 0 ? e.contributors : size_) : e.request.postscale;
}

void Engine::FinishAllreduceOutput(Entry* e, int index, void* out, int64_t count) {
  DataType dtype = e->request.tensors[index].dtype;
  if (e->request.reduce_op == ReduceOp::kAverage && !IsFloatingPoint(dtype)) {
    DivideIntegersInPlace(out, count, dtype, e->contributors > 0 ? e->contributors : size_);
  }
  ScaleInPlace(out, count, dtype, FinishScale(*e, dtype));
}

void Engine::RunAlone(Entry* e, int t) {
  // Reduced straight into its output (usually the input's own memory): no staging copy.
  const TensorSpec& spec = e->request.tensors[t];
  const int64_t count = NumElements(spec.shape);
  const size_t item_size = DataTypeSize(spec.dtype);
  // Past the fusion threshold, in threshold-sized MPI calls: one MPICH allreduce of more than
  // 32 MiB allocates and faults in a scratch buffer that large every call, and 64 MiB in one
  // call took 30 ms here against 18 ms in 16 MiB pieces. MPI counts are ints in any case.
  const int64_t threshold_items = options_.fusion_threshold_bytes / static_cast<int64_t>(item_size);
  const int64_t piece = threshold_items > 0 ? std::min<int64_t>(threshold_items, INT_MAX) : INT_MAX;
  auto fail = [e](const Status& s) { if (e->status.ok()) e->status = s; };
  if (spec.compressed()) return RunAloneCompressed(e, t);
  void* out = nullptr;
  Status s = e->allocate(t, spec.shape, &out);
  if (!s.ok()) return fail(s);
  const char* in = static_cast<const char*>(e->inputs[t]);
  auto start = Clock::now();
  if (e->request.prescale != 1.0) {
    ScaledCopy(out, in, count, spec.dtype, e->request.prescale);
    in = static_cast<const char*>(out);
  }
  // 16-bit floats are combined in place, and scaled as they are combined: no pass of its own.
  const bool halves = IsHalf(spec.dtype);
  if (halves && in != out) {
    std::memcpy(out, in, count * item_size);
    in = static_cast<const char*>(out);
  }
  const bool in_place = in == out;
  for (int64_t offset = 0; offset < count; offset += piece) {
    const size_t at = offset * item_size;
    const int n = static_cast<int>(std::min(piece, count - offset));
    int code = halves ? AllreduceHalves(static_cast<char*>(out) + at, n, spec.dtype, e->request.reduce_op,
                                        FinishScale(*e, spec.dtype), comm_, &half_scratch_)
                      : MPI_Allreduce(in_place ? MPI_IN_PLACE : in + at, static_cast<char*>(out) + at, n,
                                      ToMpiType(spec.dtype), ToMpiOp(e->request.reduce_op, spec.dtype), comm_);
    s = MpiStatus(code, "allreduce", e->request.name);
    if (!s.ok()) return fail(s);
  }
  auto reduced = Clock::now();
  if (!halves) FinishAllreduceOutput(e, t, out, count);
  if (timeline_.enabled()) {
    timeline_.Phase(e->request.name, "allreduce", start, reduced);
    timeline_.Phase(e->request.name, "scale", reduced, Clock::now());
  }
}

void Engine::RunAloneCompressed(Entry* e, int t) {
  // Converted to 16 bits on the way into scratch memory, reduced there, and converted back into
  // the output with the finishing scale: the same passes as an uncompressed tensor's copy and
  // scale, and half the bytes on the wire.
  const TensorSpec& spec = e->request.tensors[t];
  const int64_t count = NumElements(spec.shape);
  const int64_t threshold_items = options_.fusion_threshold_bytes / static_cast<int64_t>(DataTypeSize(spec.wire));
  const int64_t piece = threshold_items > 0 ? std::min<int64_t>(threshold_items, INT_MAX) : INT_MAX;
  auto fail = [e](const Status& s) { if (e->status.ok()) e->status = s; };
  auto start = Clock::now();
  compressed_scratch_.resize(count);
  CompressCopy(compressed_scratch_.data(), spec.wire, e->inputs[t], spec.dtype, count, e->request.prescale);
  auto reduce_start = Clock::now();
  for (int64_t offset = 0; offset < count; offset += piece) {
    const int n = static_cast<int>(std::min(piece, count - offset));
    Status s = MpiStatus(AllreduceHalves(compressed_scratch_.data() + offset, n, spec.wire, e->request.reduce_op,
                                         FinishScale(*e, spec.dtype), comm_, &half_scratch_),
                         "allreduce", e->request.name);
    if (!s.ok()) return fail(s);
  }
  auto reduced = Clock::now();
  void* out = nullptr;
  Status s = e->allocate(t, spec.shape, &out);
  if (!s.ok()) return fail(s);
  DecompressCopy(out, spec.dtype, compressed_scratch_.data(), spec.wire, count, 1.0);
  if (timeline_.enabled()) {
    timeline_.Phase(e->request.name, "copy_in", start, reduce_start);
    timeline_.Phase(e->request.name, "allreduce", reduce_start, reduced);
    timeline_.Phase(e->request.name, "copy_out", reduced, Clock::now());
  }
}

FusionBuffer* Engine::FusionBufferFor(size_t bytes, std::unique_ptr<FusionBuffer>* transient, size_t* tried) {
  for (auto& buffer : fusion_pool_) {
    if (buffer->size() >= bytes && !buffer->InUse()) return buffer.get();
  }
  if (fusion_pool_.size() < kPooledFusionBuffers) {
    // Pooled buffers have the threshold's size, so every later group fits. Pages nobody
    // writes are never touched, so a small model does not pay for the whole threshold.
    *tried = std::max<size_t>(bytes, options_.fusion_threshold_bytes);
    auto buffer = fusion_buffer_factory_(*tried);
    if (!buffer) return nullptr;
    AdviseHugePages(buffer->data(), buffer->size());
    fusion_pool_.push_back(std::move(buffer));
    return fusion_pool_.back().get();
  }
  // Every pooled buffer is still viewed by live outputs (a caller keeps old results).
  *tried = bytes;
  *transient = fusion_buffer_factory_(bytes);
  return transient->get();
}

void Engine::RunFusedGroup(const std::vector<std::pair<Entry*, int>>& items) {
  if (items.size() == 1) return RunAlone(items[0].first, items[0].second);
  const DataType dtype = items[0].first->request.tensors[items[0].second].wire;  // what the buffer holds
  const ReduceOp op = items[0].first->request.reduce_op;
  const size_t item_size = DataTypeSize(dtype);
  // 16-bit floats take their scale while being combined when the whole group shares one.
  auto finish_scale = [&](const std::pair<Entry*, int>& item) {
    return FinishScale(*item.first, item.first->request.tensors[item.second].dtype);
  };
  const double scale = finish_scale(items[0]);
  const bool scaled_while_combined = IsHalf(dtype) && std::all_of(items.begin(), items.end(), [&](const auto& item) {
    return finish_scale(item) == scale;
  });
  auto fail_all = [&](const Status& s) {
    for (auto& [e, t] : items) if (e->status.ok()) e->status = s;
  };

  std::vector<size_t> offsets{0};  // where each tensor starts, then where the group ends
  for (auto& [e, t] : items) offsets.push_back(offsets.back() + FusedBytes(e->request.tensors[t]));
  const size_t total = offsets.back();
  std::unique_ptr<FusionBuffer> transient;
  size_t tried = total;
  FusionBuffer* buffer = FusionBufferFor(total, &transient, &tried);
  if (!buffer) {
    return fail_all(Status::Internal("kerasdist: cannot allocate a " + std::to_string(tried) +
                                     "-byte fusion buffer (KERASDIST_FUSION_THRESHOLD=" +
                                     std::to_string(options_.fusion_threshold_bytes) + "); lower it"));
  }
  char* data = buffer->data();

  auto copy_in_start = Clock::now();
  for (size_t i = 0; i < items.size(); ++i) {
    auto& [e, t] = items[i];
    const TensorSpec& spec = e->request.tensors[t];
    const int64_t count = NumElements(spec.shape);
    if (spec.compressed()) {
      CompressCopy(reinterpret_cast<uint16_t*>(data + offsets[i]), dtype, e->inputs[t], spec.dtype, count,
                   e->request.prescale);
    } else {
      ScaledCopy(data + offsets[i], e->inputs[t], count, dtype, e->request.prescale);
    }
    // Padding is reduced too: zeros keep it from holding stale NaNs or denormals.
    const size_t end = offsets[i] + count * item_size;
    std::memset(data + end, 0, offsets[i + 1] - end);
  }
  auto reduce_start = Clock::now();
  const int count = static_cast<int>(total / item_size);
  int code = IsHalf(dtype) ? AllreduceHalves(data, count, dtype, op, scaled_while_combined ? scale : 1.0, comm_,
                                             &half_scratch_)
                           : MPI_Allreduce(MPI_IN_PLACE, data, count, ToMpiType(dtype), ToMpiOp(op, dtype), comm_);
  auto scale_start = Clock::now();
  Status reduced = MpiStatus(code, "fused allreduce", items[0].first->request.name);
  if (!reduced.ok()) return fail_all(reduced);
  for (size_t i = 0; i < items.size(); ++i) {
    auto& [e, t] = items[i];
    const TensorSpec& spec = e->request.tensors[t];
    Status s;
    if (spec.compressed()) {  // its own dtype is wider than the buffer's: converted out, not viewed
      void* out = nullptr;
      s = e->allocate(t, spec.shape, &out);
      if (s.ok()) {
        DecompressCopy(out, spec.dtype, reinterpret_cast<const uint16_t*>(data + offsets[i]), dtype,
                       NumElements(spec.shape), scaled_while_combined ? 1.0 : finish_scale(items[i]));
      }
    } else {
      if (!scaled_while_combined) FinishAllreduceOutput(e, t, data + offsets[i], NumElements(spec.shape));
      s = e->alias(t, buffer, offsets[i], spec.shape);
    }
    if (!s.ok() && e->status.ok()) e->status = s;
  }
  if (timeline_.enabled()) {
    auto end = Clock::now();
    for (auto& [e, t] : items) {
      timeline_.Phase(e->request.name, "copy_in", copy_in_start, reduce_start);
      timeline_.Phase(e->request.name, "allreduce", reduce_start, scale_start);
      timeline_.Phase(e->request.name, "scale", scale_start, end);
    }
  }
}

Status Engine::RunAllgather(Entry* e, const Response& r) {
  const TensorSpec& spec = e->request.tensors[0];
  const int64_t row = RowElements(spec.shape);
  Shape out_shape = spec.shape;
  out_shape[0] = 0;
  std::vector<int64_t> counts(size_);
  for (int i = 0; i < size_; ++i) {
    out_shape[0] += r.rank_rows[i];
    counts[i] = r.rank_rows[i] * row;
  }
  void* out = nullptr;
  Status s = e->allocate(0, out_shape, &out);
  if (!s.ok()) return s;
  bool ok = FitsInt(NumElements(out_shape));
  std::vector<int> icounts = ToIntCounts(counts, &ok);
  std::vector<int> displs = Displacements(icounts, &ok);
  if (!ok) return TooLarge(e->request.name);
  MPI_Datatype type = ToMpiType(spec.dtype);
  return MpiStatus(MPI_Allgatherv(e->inputs[0], icounts[rank_], type, out, icounts.data(),
                                  displs.data(), type, comm_),
                   "allgather", e->request.name);
}

Status Engine::RunBroadcast(Entry* e) {
  const TensorSpec& spec = e->request.tensors[0];
  int64_t count = NumElements(spec.shape);
  if (!FitsInt(count)) return TooLarge(e->request.name);
  if (rank_ == e->request.root_rank && e->inputs[0] != e->outputs[0]) {
    std::memcpy(e->outputs[0], e->inputs[0], count * DataTypeSize(spec.dtype));
  }
  return MpiStatus(MPI_Bcast(e->outputs[0], static_cast<int>(count), ToMpiType(spec.dtype),
                             e->request.root_rank, comm_),
                   "broadcast", e->request.name);
}

Status Engine::RunReducescatter(Entry* e) {
  const TensorSpec& spec = e->request.tensors[0];
  const int64_t rows = spec.shape[0], row = RowElements(spec.shape);
  std::vector<int64_t> counts(size_);
  for (int i = 0; i < size_; ++i) counts[i] = (rows / size_ + (i < rows % size_ ? 1 : 0)) * row;
  bool ok = FitsInt(NumElements(spec.shape));
  std::vector<int> icounts = ToIntCounts(counts, &ok);
  if (!ok) return TooLarge(e->request.name);
  const void* in = e->inputs[0];
  std::vector<char> scaled;
  if (e->request.prescale != 1.0) {
    scaled.resize(NumElements(spec.shape) * DataTypeSize(spec.dtype));
    ScaledCopy(scaled.data(), in, NumElements(spec.shape), spec.dtype, e->request.prescale);
    in = scaled.data();
  }
  if (IsHalf(spec.dtype)) {  // scaled as they are combined
    return MpiStatus(ReduceScatterHalves(in, e->outputs[0], icounts, spec.dtype, e->request.reduce_op,
                                         FinishScale(*e, spec.dtype), comm_, &half_scratch_),
                     "reducescatter", e->request.name);
  }
  int code = MPI_Reduce_scatter(in, e->outputs[0], icounts.data(), ToMpiType(spec.dtype),
                                ToMpiOp(e->request.reduce_op, spec.dtype), comm_);
  Status s = MpiStatus(code, "reducescatter", e->request.name);
  if (s.ok()) FinishAllreduceOutput(e, 0, e->outputs[0], counts[rank_]);
  return s;
}

Status Engine::RunAlltoall(Entry* e, const Response& r) {
  const TensorSpec& spec = e->request.tensors[0];
  const int64_t row = RowElements(spec.shape);
  std::vector<int64_t> send(size_), recv(size_);
  Shape out_shape = spec.shape;
  out_shape[0] = 0;
  for (int i = 0; i < size_; ++i) {
    send[i] = r.alltoall_rows[rank_ * size_ + i] * row;
    recv[i] = r.alltoall_rows[i * size_ + rank_] * row;
    out_shape[0] += r.alltoall_rows[i * size_ + rank_];
  }
  void* out = nullptr;
  void* splits_out = nullptr;
  Status s = e->allocate(0, out_shape, &out);
  if (s.ok()) s = e->allocate(1, Shape{size_}, &splits_out);
  if (!s.ok()) return s;
  for (int i = 0; i < size_; ++i) {
    static_cast<int32_t*>(splits_out)[i] = static_cast<int32_t>(r.alltoall_rows[i * size_ + rank_]);
  }
  bool ok = FitsInt(NumElements(spec.shape)) && FitsInt(NumElements(out_shape));
  std::vector<int> scounts = ToIntCounts(send, &ok), rcounts = ToIntCounts(recv, &ok);
  std::vector<int> sdispls = Displacements(scounts, &ok), rdispls = Displacements(rcounts, &ok);
  if (!ok) return TooLarge(e->request.name);
  MPI_Datatype type = ToMpiType(spec.dtype);
  return MpiStatus(MPI_Alltoallv(e->inputs[0], scounts.data(), sdispls.data(), type, out,
                                 rcounts.data(), rdispls.data(), type, comm_),
                   "alltoall", e->request.name);
}

void Engine::Finish(Entry* e, const Status& status) {
  if (status.code == StatusCode::kDeadlineExceeded) timed_out_ = true;
  if (e->zeros) return;  // a joined rank's stand-in: nobody waits for it
  auto it = pending_.find(e->request.name);
  std::unique_ptr<Entry> owned = std::move(it->second);
  pending_.erase(it);
  {
    // Release the name before `done`: the front end may reuse it at once.
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.erase(owned->request.name);
  }
  owned->done(status);
}

void Engine::FailAllPending(const Status& status) {
  if (status.code == StatusCode::kDeadlineExceeded) timed_out_ = true;
  std::vector<std::unique_ptr<Entry>> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& e : incoming_) failed.push_back(std::move(e));
    incoming_.clear();
    for (auto& [name, e] : pending_) failed.push_back(std::move(e));
    pending_.clear();
    in_flight_.clear();
  }
  for (auto& e : failed) {
    e->done(Status{status.code, status.message + " ['" + e->request.name + "']"});
  }
}

std::string Engine::PendingNames(size_t limit) const {
  std::string names;
  size_t n = 0;
  for (const auto& [name, e] : pending_) {
    if (n++ == limit) { names += ", ..."; break; }
    names += (names.empty() ? "'" : ", '") + name + "'";
  }
  if (names.empty()) names = "(none: waiting to shut down)";
  return names + " (" + std::to_string(pending_.size()) + " total)";
}

}  // namespace kerasdist
