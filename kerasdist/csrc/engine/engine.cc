#include "engine.h"

#include <algorithm>

#include "host_memory.h"
#include "wire.h"

namespace kerasdist {
namespace {

constexpr uint64_t kNobodyReports = 1;   // word 0, bit 0 (AND: set only if no rank reports)
constexpr uint64_t kNobodyStops = 2;     // word 0, bit 1
// Word 0, bit 2: set by a rank that can submit nothing new: its pending requests all block their
// callers (eager calls), wait inside a tf.function call, or are failures it reported. After the
// AND, set when every rank is so stuck.
constexpr uint64_t kAllWaiting = 4;
// Word 0, bit 3: set unless this rank is blocked in eager calls alone. After the AND, clear when
// some rank is. Ranks that all wait inside graphs may just be running them in different orders;
// once one rank waits in an eager call, the others' graphs can only finish with it, so nobody can.
constexpr uint64_t kNobodyBlockedEagerly = 8;
// Word 0, bits 4-6: the cycle's setting (Tuner: allreduce algorithm and fusion threshold). Rank 0
// sets its Tuner's setting there, every other rank all three bits, so the AND is rank 0's setting.
constexpr int kSettingShift = 4;
constexpr uint64_t kSettingMask = (uint64_t{1} << Tuner::kSettingBits) - 1;
// Word 0, bit 7: set by a rank whose pending requests are exactly the agreed riders (RunCycle),
// with their values in the AND's sums. After the AND, set when every rank's are: the sums are done.
constexpr uint64_t kAllRide = uint64_t{1} << 7;
// Word 0, bit 8: set by a rank whose last cycle's requests could ride with the next ANDs. After
// the AND, set when they could on every rank: from the next cycle on, their values travel.
constexpr uint64_t kCandidateRides = uint64_t{1} << 8;
constexpr int kFlagBits = 64;            // cache bits start at word 1

// The cache slots whose bits are set in `bits` (words 1 on), in slot order.
std::vector<int32_t> CacheIds(const std::vector<uint64_t>& bits) {
  std::vector<int32_t> ids;
  for (size_t w = 1; w < bits.size(); ++w) {
    for (uint64_t word = bits[w]; word; word &= word - 1) {
      ids.push_back(static_cast<int32_t>(w * 64 + __builtin_ctzll(word)) - kFlagBits);
    }
  }
  return ids;
}

}  // namespace

Engine& Engine::Get() {
  static Engine* engine = new Engine();  // never destroyed: kernels may outlive static teardown
  return *engine;
}

bool Engine::stalled() const {
  std::lock_guard<std::mutex> lock(mu_);
  return timed_out_ || stop_reason_.code == StatusCode::kDeadlineExceeded;
}

Status Engine::Start(const EngineOptions& options, const TransportFactory& make_transport) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!stopped_) return Status::OK();
  if (started_once_) {
    return Status::FailedPrecondition(
        "kerasdist: the engine was shut down and cannot be restarted in this process");
  }
  if (options.fusion_threshold_bytes > 0 && !fusion_buffer_factory_) {
    return Status::Internal("kerasdist: no fusion buffer factory; the op library registers one when it loads");
  }
  Transport transport;
  Status made = make_transport(options, &transport);
  if (!made.ok()) return made;
  options_ = options;
  control_plane_ = std::move(transport.control_plane);
  rank_ = control_plane_->rank();
  size_ = control_plane_->size();
  SetLogging(options.log_level, rank_);
  options_.cache_capacity = std::max(1, options_.cache_capacity);
  words_ = 1 + (options_.cache_capacity + 63) / 64;
  cache_.Reset(options_.cache_capacity);
  if (rank_ == 0) coordinator_ = std::make_unique<Coordinator>(size_, options_, &cache_);
  stall_inspector_ = std::make_unique<StallInspector>(control_plane_.get(), options_);
  watchdog_ = std::make_unique<Watchdog>(options_.collective_timeout_s, stall_inspector_->RankAndHost(rank_));
  Status executes = MakeExecutor(std::move(transport.backend),
                                 std::make_unique<HostMemory>(options_.fusion_threshold_bytes, fusion_buffer_factory_),
                                 &host_executor_);
  if (!executes.ok()) return executes;
  allreduce_choices_ = host_executor_->backend().AllreduceChoices();
  allreduce_choice_ = 0;
  if (rank_ == 0) {
    std::vector<std::string> names;
    for (AllreduceChoice choice : allreduce_choices_) names.push_back(AllreduceChoiceName(choice));
    if (names.empty()) names.push_back(AllreduceChoiceName(options_.allreduce_algorithm));
    std::string layout = host_executor_->backend().Layout();
    if (layout.empty()) layout = std::to_string(size_) + " ranks";
    tuner_ = std::make_unique<Tuner>(names, options_.autotune, options_.fusion_threshold_bytes,
                                     options_.autotune && options_.fusion_tuning, options_.autotune_file, layout);
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
}

Status Engine::CheckLocally(Request* request, const DeviceTensors& device) const {
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
  if (request->device == Device::kGpu) {
    if (!device_hooks_.check) {
      return Status::InvalidArgument("kerasdist: '" + name + "' is on a GPU, but this op library was built "
                                     "without NCCL; rebuild with KERASDIST_WITH_NCCL=1 or place it on the CPU");
    }
    Status supported = device_hooks_.check(*request, device);
    if (!supported.ok()) return supported;
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
                       AllocateFn allocate, AliasFn alias, DoneFn done,
                       DeviceTensors device) {
  // A mistake that needs no other rank to see fails here, on the rank that made it, and is
  // negotiated too, so the ranks that did call correctly fail the same call instead of waiting.
  Status local = CheckLocally(&request, device);
  if (!local.ok()) {
    request.error = local.message;
    SubmitFailure(std::move(request));
    return local;
  }
  auto entry = std::make_unique<Collective>();
  entry->signature = RequestSignature(request);
  entry->request = std::move(request);
  entry->inputs = std::move(inputs);
  entry->outputs = std::move(outputs);
  entry->allocate = std::move(allocate);
  entry->alias = std::move(alias);
  entry->done = std::move(done);
  entry->device = std::move(device);
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
  auto entry = std::make_unique<Collective>();
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

int64_t Engine::NextExecution(const std::string& function) {
  std::lock_guard<std::mutex> lock(executions_mu_);
  return executions_[function]++;
}

void Engine::Loop() {
  NameThisThread("kd_engine");
  auto backoff = std::chrono::microseconds(0);
  phases_.Start();
  while (true) {
    // With something pending, this rank waits for the others to agree; else for its own caller.
    const Phase waiting = pending_.empty() ? Phase::kIdle : Phase::kNegotiation;
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
        watchdog_->ArmForNegotiationCall();
        stall_inspector_->AnswerQueries();
        watchdog_->Disarm();
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
    phases_.Charge(waiting);
    bool progress = false;
    if (!RunCycle(&progress)) break;
    if (progress) backoff = std::chrono::microseconds(0);
    else backoff = std::min(std::chrono::microseconds(5000),
                            std::max(std::chrono::microseconds(100), backoff * 2));
  }
}

bool Engine::RunCycle(bool* progress) {
  bool shutting_down;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto taken_up = Clock::now();
    for (auto& e : incoming_) {
      phases_.CountTakenUp(taken_up - e->enqueued);
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
  bool any_blocking = false, none_free = true, none_free_of_graph = true;
  for (auto& [name, e] : pending_) {
    any_blocking |= e->request.blocking;
    none_free &= e->request.blocking || !e->request.error.empty();
    none_free_of_graph &= e->request.blocking || !e->request.error.empty() || e->request.execution >= 0;
    if (e->reported) continue;
    const int32_t id = cache_.Find(name);
    if (id >= 0) {
      const double waited = Seconds(now - e->enqueued);
      // A graph's request waits while its rank's thread is inside the function call, so, like
      // a blocking one, it must reach rank 0 for a mismatch with an eager call to be seen.
      const bool caller_waits = e->request.blocking || e->request.execution >= 0;
      bool stale = (options_.stall_warning_s > 0 && waited > stale_s) ||
                   (caller_waits && options_.mismatch_timeout_s > 0 && waited > blocking_stale_s);
      if (cache_.Matches(id, e->signature) && cache_.Follows(id, e->request.execution) && !stale) {
        if (!any_joined_) {
          int bit = kFlagBits + id;
          bits[bit / 64] |= uint64_t{1} << (bit % 64);
          continue;
        }
        // Some rank has joined: rank 0 must see who sent it; the slot stays valid.
      } else {
        // Changed request, another call of its tf.function than the slot expects, or waiting
        // long enough that rank 0 should see who is missing.
        invalidations.push_back(id);
      }
    }
    report = true;
  }
  if (coordinator_ && coordinator_->ReportDue(now)) report = true;
  if (!report) bits[0] |= kNobodyReports;
  if (!shutting_down) bits[0] |= kNobodyStops;
  const bool blocked_eagerly = any_blocking && none_free;
  if (blocked_eagerly || (!pending_.empty() && none_free_of_graph)) bits[0] |= kAllWaiting;
  if (!blocked_eagerly) bits[0] |= kNobodyBlockedEagerly;
  bits[0] |= (tuner_ ? static_cast<uint64_t>(tuner_->setting()) : kSettingMask) << kSettingShift;

  // Small allreduces that repeat cycle after cycle ride with the AND: while a set of them is
  // agreed, every rank sends its values with each AND (the same count everywhere), and when every
  // rank has exactly that set pending and nothing to report, the sums arrive with the negotiation:
  // one exchange instead of two. A rank that cannot ride sends zeros and clears kAllRide; the
  // cycle then runs as if nothing had ridden.
  rider_values_.assign(riding_.values, 0.0f);
  std::vector<Collective*> riders;
  if (!riding_.bits.empty() && !report && std::equal(bits.begin() + 1, bits.end(), riding_.bits.begin() + 1)) {
    bool can_ride = true;
    size_t values = 0;
    for (int32_t id : CacheIds(bits)) {
      Collective* c = pending_.at(cache_.name(id)).get();
      can_ride &= Executor::CanRide(c->request);
      values += Executor::RiderValues(c->request);
      riders.push_back(c);
    }
    if (can_ride && values == riding_.values) {
      host_executor_->PackRiders(riders, rider_values_.data());
      bits[0] |= kAllRide;
    }
  }
  if (!candidate_.bits.empty()) bits[0] |= kCandidateRides;

  phases_.Charge(Phase::kOther);
  phases_.CountCycle();
  watchdog_->ArmForNegotiationCall();
  const auto exchange_started = Clock::now();
  Status status = control_plane_->StartBitwiseAnd(bits.data(), words_, rider_values_.data(), rider_values_.size());
  if (status.ok()) status = stall_inspector_->WaitForPeers([this] { return PendingNames(8); }, watchdog_.get());
  watchdog_->Disarm();
  phases_.Charge(Phase::kNegotiation);
  if (!status.ok()) {
    Log(3, "%s", status.message.c_str());
    Stop(status, status);
    return false;
  }

  std::vector<Ready> ready;
  const auto negotiated = Clock::now();
  if (coordinator_) {
    coordinator_->NoteAllWaiting((bits[0] & kAllWaiting) && !(bits[0] & kNobodyBlockedEagerly), negotiated);
  }
  for (int32_t id : CacheIds(bits)) {
    auto it = pending_.find(cache_.name(id));
    cache_.Ran(id, it->second->request.execution);
    ready.push_back({it->second.get(), cache_.response(id), negotiated});
  }
  if (!(bits[0] & kNobodyReports)) {
    phases_.Charge(Phase::kOther);
    const bool agreed = SlowPath(invalidations, &ready);
    phases_.Charge(Phase::kSlowPath);
    if (!agreed) return false;
  }

  if (timeline_.enabled()) timeline_.CycleMark(negotiated, static_cast<int>(ready.size()));
  *progress = !ready.empty();
  if (*progress && coordinator_) coordinator_->NoteProgress();
  const int setting = static_cast<int>((bits[0] >> kSettingShift) & kSettingMask);
  Fusion& fusion = host_executor_->fusion();
  fusion.set_threshold_bytes(Tuner::SmallFusion(setting) ? Tuner::kSmallThresholdBytes
                                                         : options_.fusion_threshold_bytes);
  const int choice = Tuner::Algorithm(setting);
  if (choice != allreduce_choice_ && choice < static_cast<int>(allreduce_choices_.size())) {
    host_executor_->backend().UseAllreduceChoice(allreduce_choices_[choice]);
    allreduce_choice_ = choice;
  }
  // What may ride next: decided from what every rank knows alike, before `ready` is handed back.
  const bool slow_path = !(bits[0] & kNobodyReports);
  const bool rode = bits[0] & kAllRide;
  // A cycle the riders missed sent their values for nothing: they stop until they run again
  // (a step of several large cycles and one small one would otherwise pay in each large one).
  if (!rode) riding_ = Riders{};
  if (bits[0] & kCandidateRides) riding_ = candidate_;
  // The slow path may have given the riders' cache slots to other requests.
  if (slow_path || any_joined_) riding_ = Riders{};
  candidate_ = slow_path ? Riders{} : RidersOf(ready, bits);

  fusion.ForgetLastRun();
  if (rode) {
    // Every rank had exactly the riders pending: `ready` is them, in the order they were packed.
    for (Ready& r : ready) {
      r.collective->contributors = size_;
      if (timeline_.enabled()) {
        timeline_.Phase(r.collective->request.name, "queued", r.collective->enqueued, exchange_started);
        timeline_.Phase(r.collective->request.name, "allreduce", exchange_started, negotiated);
      }
    }
    phases_.CountRiders(static_cast<int64_t>(riders.size()));
    host_executor_->FinishRiders(riders, rider_values_.data(), [this](Collective* c) { Finish(c, c->status); });
  } else {
    Execute(ready);
  }
  if (tuner_) tuner_->Record(setting, fusion.last_bytes(), fusion.last_fused_bytes(), fusion.last_seconds());
  zero_entries_.clear();

  if (!(bits[0] & kNobodyStops)) {
    Stop(Status::Aborted("kerasdist was shut down (on this or another rank)"),
         Status::Aborted("kerasdist was shut down on this or another rank while this "
                         "collective was pending; every rank must run the same collectives"));
    return false;
  }
  if (coordinator_) coordinator_->WarnAboutStalls(Clock::now());
  phases_.Charge(Phase::kOther);
  return true;
}

bool Engine::SlowPath(const std::vector<int32_t>& invalidations, std::vector<Ready>* ready) {
  ByteWriter out;
  out.PutInts(std::vector<int64_t>(invalidations.begin(), invalidations.end()));
  std::vector<Collective*> reporting;
  for (auto& [name, e] : pending_) {
    if (e->reported) continue;
    const int32_t id = cache_.Find(name);
    const bool invalidated = id >= 0 && std::find(invalidations.begin(), invalidations.end(), id) != invalidations.end();
    if (id >= 0 && !invalidated && !any_joined_) continue;  // took the fast path this cycle
    reporting.push_back(e.get());
  }
  out.Put<uint32_t>(static_cast<uint32_t>(reporting.size()));
  const auto now = Clock::now();
  for (Collective* e : reporting) {
    e->request.waited_s = Seconds(now - e->enqueued);
    WriteRequest(out, e->request);
    e->reported = true;
  }

  // Every rank has entered this cycle's slow path (the bitwise AND said so): from here on, only a
  // rank or a link that is gone can keep the exchange from completing.
  watchdog_->Arm("the slow-path negotiation");
  std::vector<std::vector<char>> messages;
  Status exchanged = control_plane_->GatherToRoot(out.bytes(), &messages);
  std::vector<char> answer;
  if (exchanged.ok() && rank_ == 0) {
    std::vector<int32_t> evicted;
    std::vector<Response> responses;
    coordinator_->Step(messages, &evicted, &responses);
    ByteWriter bytes;
    bytes.PutInts(std::vector<int64_t>(evicted.begin(), evicted.end()));
    bytes.PutInts(coordinator_->JoinedRanks());
    bytes.Put<uint32_t>(static_cast<uint32_t>(responses.size()));
    for (const auto& r : responses) WriteResponse(bytes, r);
    answer = std::move(bytes.bytes());
  }
  if (exchanged.ok()) exchanged = control_plane_->BroadcastFromRoot(&answer);
  watchdog_->Disarm();
  if (!exchanged.ok()) {
    Log(3, "%s", exchanged.message.c_str());
    Stop(exchanged, exchanged);
    return false;
  }

  ByteReader in(answer.data(), answer.size());
  std::vector<int64_t> evicted64 = in.GetInts();
  std::vector<int32_t> evicted(evicted64.begin(), evicted64.end());
  any_joined_ = !in.GetInts().empty();
  std::vector<Response> responses(in.Get<uint32_t>());
  for (auto& r : responses) r = ReadResponse(in);
  cache_.Evict(evicted);
  for (const Response& r : responses) {
    // A cached response pairs requests every rank sent, so this rank has it pending.
    if (r.cache_id >= 0) {
      const Collective& mine = *pending_.at(r.name);
      cache_.Insert(r, mine.request, mine.signature);
    }
  }

  const auto negotiated = Clock::now();
  for (auto& r : responses) {
    auto it = pending_.find(r.name);
    const bool zeros = std::find(r.zero_ranks.begin(), r.zero_ranks.end(), rank_) != r.zero_ranks.end();
    if (it != pending_.end() && (it->second->reported || zeros)) {
      ready->push_back({it->second.get(), std::move(r), negotiated});
    } else if (zeros) {  // this rank has joined: it takes part with zeros
      std::unique_ptr<Collective> stand_in = ZeroCollective(r);
      ready->push_back({stand_in.get(), std::move(r), negotiated});
      zero_entries_.push_back(std::move(stand_in));
    }
    // Otherwise a stall error naming a request this rank never sent.
  }
  return true;
}

std::unique_ptr<Collective> Engine::ZeroCollective(const Response& response) {
  auto e = std::make_unique<Collective>();
  ByteReader in(response.spec.data(), response.spec.size());
  e->request = ReadRequest(in);
  e->zeros = true;
  e->enqueued = Clock::now();
  constexpr size_t kAlignment = HostMemory::kFusedAlignment;
  std::vector<size_t> offsets{0};
  for (const auto& t : e->request.tensors) {
    offsets.push_back(offsets.back() + RoundedUp(NumElements(t.shape) * DataTypeSize(t.dtype), kAlignment));
  }
  e->zero_input.assign(offsets.back() + kAlignment, 0);
  e->zero_output.assign(offsets.back() + kAlignment, 0);
  for (size_t t = 0; t < e->request.tensors.size(); ++t) e->inputs.push_back(e->zero_input.data() + offsets[t]);
  Collective* self = e.get();
  e->allocate = [self, offsets](int index, const Shape&, void** data) {
    *data = self->zero_output.data() + offsets[index];
    return Status::OK();
  };
  e->alias = [](int, FusionBuffer*, size_t, const Shape&) { return Status::OK(); };  // the result is dropped
  e->done = [](const Status&) {};
  return e;
}

Engine::Riders Engine::RidersOf(const std::vector<Ready>& ready, const std::vector<uint64_t>& bits) const {
  if (options_.piggyback_bytes <= 0 || ready.empty() || any_joined_) return Riders{};
  Riders riders;
  for (const Ready& r : ready) {
    if (!r.response.status.ok() || !Executor::CanRide(r.collective->request)) return Riders{};
    riders.values += Executor::RiderValues(r.collective->request);
  }
  if (riders.values * sizeof(float) > static_cast<size_t>(options_.piggyback_bytes)) return Riders{};
  riders.bits = bits;  // a fast-path cycle's ready requests are the AND's cache bits
  riders.bits[0] = 0;
  return riders;
}

void Engine::Execute(std::vector<Ready>& ready) {
  Executor::Ready on_host, on_device;
  for (Ready& r : ready) {
    Collective* c = r.collective;
    c->contributors = r.response.contributors > 0 ? r.response.contributors : size_;
    if (timeline_.enabled()) timeline_.Phase(c->request.name, "queued", c->enqueued, r.negotiated);
    if (!r.response.status.ok()) {
      Finish(c, r.response.status);
    } else if (c->request.kind == OpKind::kJoin) {
      *static_cast<int32_t*>(c->outputs[0]) = r.response.last_joined_rank;
      {
        std::lock_guard<std::mutex> lock(executions_mu_);
        executions_.clear();  // every rank is between its steps, in join: the counts start alike
      }
      Finish(c, Status::OK());
    } else {
      (c->request.device == Device::kGpu ? on_device : on_host).push_back({c, &r.response});
    }
  }
  // The same partition, in the same order, on every rank.
  if (!on_host.empty()) host_executor_->Run(on_host, [this](Collective* c) { Finish(c, c->status); });
  if (!on_device.empty()) ExecuteOnDevice(on_device);
}

Status Engine::MakeExecutor(std::unique_ptr<Backend> backend, std::unique_ptr<TensorMemory> memory,
                            std::unique_ptr<Executor>* executor) {
  if (!backend || !memory) return Status::Internal("kerasdist: a transport or device hook made no backend or memory");
  Status pairs = Executor::CheckPairing(*backend, *memory);
  if (!pairs.ok()) return pairs;
  *executor = std::make_unique<Executor>(rank_, size_, options_.fusion_threshold_bytes,
                                         std::make_unique<WatchedBackend>(std::move(backend), watchdog_.get()),
                                         std::move(memory), watchdog_.get(), &timeline_, &phases_);
  return Status::OK();
}

void Engine::ExecuteOnDevice(const Executor::Ready& ready) {
  Status created;
  if (!device_executor_) {
    // Requests on a GPU pass CheckLocally only where the hooks exist, and every rank runs the
    // same library, so every rank gets here in this cycle.
    std::unique_ptr<Backend> backend;
    std::unique_ptr<TensorMemory> memory;
    created = device_hooks_.create(control_plane_.get(), watchdog_.get(), options_, &backend, &memory);
    if (created.ok()) created = MakeExecutor(std::move(backend), std::move(memory), &device_executor_);
  }
  if (!created.ok()) {
    for (auto& [c, r] : ready) Finish(c, created);
    return;
  }
  device_executor_->Run(ready, [this](Collective* c) { Finish(c, c->status); });
}

void Engine::Finish(Collective* e, const Status& status) {
  if (status.code == StatusCode::kDeadlineExceeded) timed_out_ = true;
  if (e->zeros) return;  // a joined rank's stand-in: nobody waits for it
  auto it = pending_.find(e->request.name);
  std::unique_ptr<Collective> owned = std::move(it->second);
  pending_.erase(it);
  {
    // Release the name before `done`: the front end may reuse it at once.
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.erase(owned->request.name);
  }
  phases_.Charge(Phase::kOther);
  owned->done(status);
  phases_.Charge(Phase::kHandBack);
}

void Engine::Stop(const Status& reason, const Status& pending_status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_reason_ = reason;
    stopped_ = true;
  }
  FailAllPending(pending_status);
}

void Engine::FailAllPending(const Status& status) {
  if (status.code == StatusCode::kDeadlineExceeded) timed_out_ = true;
  std::vector<std::unique_ptr<Collective>> failed;
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
