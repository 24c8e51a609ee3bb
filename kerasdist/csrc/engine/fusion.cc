#include "fusion.h"

#include <algorithm>
#include <climits>
#include <tuple>

namespace kerasdist {
namespace {

// Sum and Average combine alike (Average divides afterwards), so they share fused calls.
ReduceOp CombiningOp(ReduceOp op) { return op == ReduceOp::kAverage ? ReduceOp::kSum : op; }

}  // namespace

Fusion::Fusion(int64_t threshold_bytes, Backend* backend, TensorMemory* memory, Timeline* timeline,
               PhaseClock* phases)
    : threshold_bytes_(threshold_bytes), backend_(backend), memory_(memory), timeline_(timeline), phases_(phases) {}

size_t Fusion::FusedBytes(const TensorSpec& spec) const {
  return RoundedUp(NumElements(spec.shape) * DataTypeSize(spec.wire), memory_->alignment());
}

void Fusion::Run(const std::vector<Collective*>& collectives) {
  const auto start = Clock::now();
  last_bytes_ = 0;
  last_fused_bytes_ = 0;
  // Tensors that share a wire dtype and a way of combining travel together, in negotiated order.
  // In memory without kernels the backend scales a group as a whole, so its tensors also share
  // their scale, and an Average stays an Average (an integer one is the backend's to divide).
  const bool kernels = memory_->runs_kernels();
  using Key = std::tuple<DataType, ReduceOp, double>;
  std::vector<std::pair<Key, std::vector<Item>>> groups;
  for (Collective* c : collectives) {
    for (int t = 0; t < static_cast<int>(c->request.tensors.size()); ++t) {
      const ReduceOp op = c->request.reduce_op;
      const Key key{c->request.tensors[t].wire, kernels ? CombiningOp(op) : op, kernels ? 1.0 : ScaleAfter({c, t})};
      auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == key; });
      if (it == groups.end()) it = groups.insert(groups.end(), {key, {}});
      it->second.push_back({c, t});
    }
  }
  // A fused group is one backend call, whose count MPI takes as an int.
  const size_t threshold = static_cast<size_t>(std::clamp<int64_t>(threshold_bytes_, 0, INT_MAX));
  for (auto& [key, candidates] : groups) {
    std::vector<Item> items;  // the ones worth fusing, in negotiated order
    for (auto& item : candidates) {
      last_bytes_ += FusedBytes(item.first->request.tensors[item.second]);
      if (FusedBytes(item.first->request.tensors[item.second]) > memory_->largest_fused_bytes()) {
        RunAlone(item.first, item.second);
      } else {
        items.push_back(item);
        last_fused_bytes_ += FusedBytes(item.first->request.tensors[item.second]);
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
      RunGroup({items.begin() + begin, items.begin() + end});
      begin = end;
    }
  }
  last_seconds_ = Seconds(Clock::now() - start);
}

void Fusion::RunAlone(Collective* c, int t) {
  // Reduced straight into its output (usually the input's own memory): no staging copy.
  const TensorSpec& spec = c->request.tensors[t];
  if (spec.compressed()) return RunAloneCompressed(c, t);
  const std::string& name = c->request.name;
  const int64_t count = NumElements(spec.shape);
  phases_->Charge(Phase::kOther);
  void* out = nullptr;
  const Status allocated = AllocateOutput(*memory_, c, t, spec.shape, spec.dtype, &out);
  phases_->Charge(Phase::kOutputs);
  const void* in = c->inputs[t];
  memory_->PrepareLoneTensor(out, count * DataTypeSize(spec.dtype));
  auto start = Clock::now();
  if (ScaleIn(c) != 1.0) {
    c->Fail(memory_->Copy(out, spec.dtype, in, spec.dtype, count, ScaleIn(c), name));
    in = out;
    phases_->Charge(Phase::kCopyIn);
  }
  // Where the backend scales while it combines, the finishing scale needs no pass of its own.
  const bool scaled_while_combined = backend_->ScalesWhileCombining(spec.dtype);
  Status s = backend_->Allreduce(in, out, count, spec.dtype, c->request.reduce_op,
                                 scaled_while_combined ? ScaleAfter({c, t}) : 1.0, name);
  phases_->Charge(Phase::kTransfer);
  if (!allocated.ok()) return c->Fail(allocated);
  if (!s.ok()) return c->Fail(s);
  auto reduced = Clock::now();
  if (!scaled_while_combined) c->FinishOutput(t, out, count);
  phases_->Charge(Phase::kOutputs);
  if (timeline_->enabled()) {
    timeline_->Phase(name, "allreduce", start, reduced);
    timeline_->Phase(name, "scale", reduced, Clock::now());
  }
}

void Fusion::RunAloneCompressed(Collective* c, int t) {
  // Converted to 16 bits on the way into scratch memory, reduced there, and converted back into
  // the output with the finishing scale: the same passes as an uncompressed tensor's copy and
  // scale, and half the bytes on the wire. Host memory only: compression of tensors in memory
  // without kernels is refused before negotiation.
  const TensorSpec& spec = c->request.tensors[t];
  const std::string& name = c->request.name;
  const int64_t count = NumElements(spec.shape);
  phases_->Charge(Phase::kOther);
  auto start = Clock::now();
  compressed_scratch_.resize(count);
  c->Fail(memory_->Copy(compressed_scratch_.data(), spec.wire, c->inputs[t], spec.dtype, count, ScaleIn(c), name));
  phases_->Charge(Phase::kCopyIn);
  auto reduce_start = Clock::now();
  const double scale = ScaleAfter({c, t});
  const bool scaled_while_combined = backend_->ScalesWhileCombining(spec.wire);
  Status s = backend_->Allreduce(compressed_scratch_.data(), compressed_scratch_.data(), count, spec.wire,
                                 c->request.reduce_op, scaled_while_combined ? scale : 1.0, name);
  phases_->Charge(Phase::kTransfer);
  if (!s.ok()) return c->Fail(s);
  auto reduced = Clock::now();
  void* out = nullptr;
  s = c->allocate(t, spec.shape, &out);
  if (!s.ok()) return c->Fail(s);
  c->Fail(memory_->Copy(out, spec.dtype, compressed_scratch_.data(), spec.wire, count,
                        scaled_while_combined ? 1.0 : scale, name));
  phases_->Charge(Phase::kOutputs);
  if (timeline_->enabled()) {
    timeline_->Phase(name, "copy_in", start, reduce_start);
    timeline_->Phase(name, "allreduce", reduce_start, reduced);
    timeline_->Phase(name, "copy_out", reduced, Clock::now());
  }
}

void Fusion::RunGroup(const std::vector<Item>& items) {
  if (items.size() == 1) return RunAlone(items[0].first, items[0].second);
  const DataType dtype = items[0].first->request.tensors[items[0].second].wire;  // what the buffer holds
  const ReduceOp op = items[0].first->request.reduce_op;
  const std::string& group_name = items[0].first->request.name;
  const size_t item_size = DataTypeSize(dtype);
  // Where the backend scales while it combines, it takes the group's scale when all share one.
  const double scale = ScaleAfter(items[0]);
  const bool scaled_while_combined =
      backend_->ScalesWhileCombining(dtype) &&
      std::all_of(items.begin(), items.end(), [&](const Item& item) { return ScaleAfter(item) == scale; });
  auto fail_all = [&](const Status& s) {
    for (auto& [c, t] : items) c->Fail(s);
  };

  std::vector<size_t> offsets{0};  // where each tensor starts, then where the group ends
  for (auto& [c, t] : items) offsets.push_back(offsets.back() + FusedBytes(c->request.tensors[t]));
  const size_t total = offsets.back();
  std::unique_ptr<FusionBuffer> transient;
  size_t tried = total;
  FusionBuffer* buffer = memory_->BufferFor(total, &transient, &tried);
  if (!buffer) {
    return fail_all(Status::Internal("kerasdist: cannot allocate a " + std::to_string(tried) +
                                     "-byte fusion buffer (KERASDIST_FUSION_THRESHOLD=" +
                                     std::to_string(threshold_bytes_) + "); lower it"));
  }
  char* data = buffer->data();

  phases_->Charge(Phase::kOther);
  auto copy_in_start = Clock::now();
  for (size_t i = 0; i < items.size(); ++i) {
    auto& [c, t] = items[i];
    const TensorSpec& spec = c->request.tensors[t];
    const int64_t count = NumElements(spec.shape);
    c->Fail(memory_->Copy(data + offsets[i], dtype, c->inputs[t], spec.dtype, count, ScaleIn(c), c->request.name));
    // Padding is reduced too: zeros keep it from holding stale NaNs or denormals.
    const size_t end = offsets[i] + count * item_size;
    if (offsets[i + 1] > end) c->Fail(memory_->Zero(data + end, offsets[i + 1] - end, c->request.name));
  }
  phases_->Charge(Phase::kCopyIn);
  auto reduce_start = Clock::now();
  Status reduced = backend_->Allreduce(data, data, static_cast<int64_t>(total / item_size), dtype, op,
                                       scaled_while_combined ? scale : 1.0, group_name);
  phases_->Charge(Phase::kTransfer);
  auto outputs_start = Clock::now();
  if (!reduced.ok()) return fail_all(reduced);
  for (size_t i = 0; i < items.size(); ++i) {
    auto& [c, t] = items[i];
    const TensorSpec& spec = c->request.tensors[t];
    const int64_t count = NumElements(spec.shape);
    char* result = data + offsets[i];
    Status s;
    if (!scaled_while_combined && !spec.compressed()) c->FinishOutput(t, result, count);
    if (spec.compressed() || !memory_->outputs_view_buffers()) {
      // Its own memory: converted out of a narrower wire dtype, or copied out of the buffer.
      void* out = nullptr;
      s = c->allocate(t, spec.shape, &out);
      if (s.ok()) s = memory_->OrderAfterFrontEnd(c);
      const double out_scale = spec.compressed() && !scaled_while_combined ? ScaleAfter(items[i]) : 1.0;
      if (s.ok()) s = memory_->Copy(out, spec.dtype, result, dtype, count, out_scale, c->request.name);
    } else {
      s = c->alias(t, buffer, offsets[i], spec.shape);
    }
    c->Fail(s);
  }
  phases_->Charge(Phase::kOutputs);
  if (timeline_->enabled()) {
    auto end = Clock::now();
    for (auto& [c, t] : items) {
      timeline_->Phase(c->request.name, "copy_in", copy_in_start, reduce_start);
      timeline_->Phase(c->request.name, "allreduce", reduce_start, outputs_start);
      timeline_->Phase(c->request.name, memory_->outputs_view_buffers() ? "scale" : "copy_out", outputs_start, end);
    }
  }
}

}  // namespace kerasdist
