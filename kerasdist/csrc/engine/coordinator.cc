#include "coordinator.h"

#include <algorithm>
#include <sstream>

#include "wire.h"

namespace kerasdist {
namespace {

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

}  // namespace

Coordinator::Coordinator(int size, const EngineOptions& options, ResponseCache* cache)
    : size_(size), options_(options), cache_(cache), joined_(size, false) {}

bool Coordinator::ReportDue(Clock::time_point now) {
  bool due = false;
  for (auto& [name, n] : table_) {
    if (options_.stall_timeout_s > 0 && Seconds(now - n.first_seen) > options_.stall_timeout_s) due = true;
  }
  mismatch_check_due_ = all_waiting_ && options_.mismatch_timeout_s > 0 &&
                        Seconds(now - all_waiting_since_) >= options_.mismatch_timeout_s && EveryRankReported();
  return due || mismatch_check_due_;
}

void Coordinator::NoteAllWaiting(bool all_waiting, Clock::time_point when) {
  if (all_waiting && !all_waiting_) all_waiting_since_ = when;
  all_waiting_ = all_waiting;
  mismatch_check_due_ &= all_waiting;
}

std::vector<int64_t> Coordinator::JoinedRanks() const {
  std::vector<int64_t> joined;
  for (int r = 0; r < size_; ++r) {
    if (joined_[r]) joined.push_back(r);
  }
  return joined;
}

void Coordinator::Step(const std::vector<std::vector<char>>& messages, std::vector<int32_t>* evicted,
                       std::vector<Response>* responses) {
  const auto now = Clock::now();
  std::vector<std::string> completed;
  for (int r = 0; r < size_; ++r) {
    ByteReader in(messages[r].data(), messages[r].size());
    for (int64_t id : in.GetInts()) {
      if (cache_->used(static_cast<int32_t>(id)) && std::find(evicted->begin(), evicted->end(), id) == evicted->end()) {
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
      // A warning gives the wait since the earliest rank's call: a request may reach rank 0 only
      // after waiting on the fast path. The timeout keeps counting from rank 0's first sight, so
      // names one stall holds on different ranks time out in the same cycle.
      const auto called = now - std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(request->waited_s));
      if (fresh) {
        n.by_rank.resize(size_);
        n.first_seen = now;
        n.first_called = called;
      }
      n.first_called = std::min(n.first_called, called);
      if (!n.by_rank[r]) ++n.count;
      n.by_rank[r] = std::move(request);
      if (n.count == size_) completed.push_back(name);
    }
  }
  // Freed slots are reusable at once: every rank applies evictions before insertions.
  for (int32_t id : *evicted) cache_->Release(id);
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
  FailTimedOut(now, responses);
}

void Coordinator::FailTimedOut(Clock::time_point now, std::vector<Response>* responses) {
  if (options_.stall_timeout_s <= 0) return;
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

Response Coordinator::Complete(const std::string& name, std::vector<int32_t>* evicted) {
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
    const int32_t cached = cache_->Find(name);
    const bool keeps_slot = cached >= 0 && std::find(evicted->begin(), evicted->end(), cached) == evicted->end();
    if (!keeps_slot) response.cache_id = cache_->Assign(evicted);
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
  } else if (sent->device == Device::kGpu) {
    // A joined rank's zeros are host memory, which NCCL cannot read.
    response.status = Status::FailedPrecondition(
        std::string("kerasdist: cannot run allreduce '") + name + "' of GPU tensors while rank(s) " + ranks +
        " have joined (kerasdist.join): joining is supported for host tensors only. Call join() after the "
        "last GPU collective, or place the tensor on the CPU.");
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
    ByteWriter bytes;
    WriteRequest(bytes, spec);
    response.spec.assign(bytes.bytes().begin(), bytes.bytes().end());
  }
  return response;
}

Response Coordinator::Validate(const std::string& name, const std::vector<const Request*>& by_rank) const {
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

  auto executions = per_rank([](const Request& r) {
    return r.execution < 0 ? std::string("an eager call") : "call " + std::to_string(r.execution);
  });
  if (disagree(executions)) {
    response.status = Status::FailedPrecondition(
        "kerasdist: '" + name + "' was submitted from different calls of the tf.function that contains it: " +
        DescribeDisagreement(executions, "is in", "are in") +
        " (calls of that function counted on each rank). A rank skipped this collective in an earlier call, or "
        "called the function a different number of times: a tf.cond whose branches differ in their collectives "
        "and whose condition differs between ranks (a loss-scale optimizer skipping a step on one rank, a "
        "check of local data), or a loop with a different trip count per rank. Every rank must run the same "
        "collectives in every call of a tf.function; decide such conditions from allreduced values.");
    return response;
  }
  auto kinds = per_rank([](const Request& r) { return std::string(OpKindName(r.kind)); });
  if (disagree(kinds)) return fail("collective", kinds, "Every rank must call the same op for one name.");
  auto devices = per_rank([](const Request& r) { return std::string("a tensor on ") + DeviceName(r.device); });
  if (disagree(devices)) {
    return fail("device", devices, "Place the tensor on the same kind of device on every rank (tf.device, "
                "kerasdist.pin_gpu()).");
  }
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

void Coordinator::WarnAboutStalls(Clock::time_point now) {
  if (options_.stall_warning_s <= 0) return;
  for (auto& [name, n] : table_) {
    if (Seconds(now - n.last_warning) < options_.stall_warning_s ||
        Seconds(now - n.first_called) < options_.stall_warning_s) {
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
        name.c_str(), present.c_str(), missing.c_str(), Seconds(now - n.first_called), elsewhere.c_str());
    n.last_warning = now;
  }
}

std::string Coordinator::WaitsOf(int r, size_t limit) const {
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

bool Coordinator::EveryRankReported() const {
  std::vector<bool> seen(size_, false);
  for (const auto& [name, n] : table_) {
    for (int r = 0; r < size_; ++r) seen[r] = seen[r] || n.by_rank[r] != nullptr;
  }
  for (int r = 0; r < size_; ++r) seen[r] = seen[r] || joined_[r];  // waits in join
  return std::all_of(seen.begin(), seen.end(), [](bool b) { return b; });
}

void Coordinator::FailMismatchedWaits(std::vector<Response>* responses) {
  std::vector<std::string> waits(size_);
  for (int r = 0; r < size_; ++r) waits[r] = WaitsOf(r, 3);
  std::string described = DescribeDisagreement(waits, "waits in", "wait in");
  if (described.empty()) described = "every rank waits in " + waits[0];
  std::ostringstream timeout;
  timeout << options_.mismatch_timeout_s;
  // Which ranks wait inside a tf.function call (a training step) and which in eager calls.
  std::vector<std::string> where(size_, "");
  for (const auto& [name, n] : table_) {
    for (int r = 0; r < size_; ++r) {
      if (n.by_rank[r] && where[r].empty()) where[r] = n.by_rank[r]->execution >= 0 ? "graph" : "eager";
    }
  }
  const bool graph_and_eager = std::count(where.begin(), where.end(), "graph") > 0 &&
                               std::count(where.begin(), where.end(), "eager") > 0;
  const std::string cause =
      graph_and_eager
          ? " Some ranks wait inside a tf.function call (a training step) while others have left it for an "
            "eager call: the ranks ran different numbers of steps. Common causes: training stopped on some "
            "ranks only (model.stop_training, TerminateOnNaN or EarlyStopping deciding on one rank's data: "
            "kerasdist.callbacks() makes Keras's own stops agree, a callback of your own must decide from "
            "allreduced values), a tf.data pipeline (filter, take_while, unequal files) that gives ranks "
            "different numbers of batches (give every rank the same number of steps, or call "
            "kerasdist.join() after the last one), or a custom loop that runs one more batch on one rank."
          : " Every rank must make the same collective calls in the same order; a call made on some ranks "
            "only (for example under `if rank == 0:`) pairs with nothing. Unnamed eager calls are named by "
            "file:line and a count of calls there, so calls from different lines never pair: pass the same "
            "name= to calls that belong together.";
  const Status status = Status::FailedPrecondition(
      "kerasdist: the ranks are blocked in different collectives, so none of them can complete: " +
      described + "." + cause + " (Found after every rank waited " + timeout.str() +
      " s; KERASDIST_MISMATCH_TIMEOUT_S sets this.)");
  for (const auto& [name, n] : table_) {
    Response response;
    response.name = name;
    response.status = status;
    responses->push_back(std::move(response));
  }
  table_.clear();
}

}  // namespace kerasdist
