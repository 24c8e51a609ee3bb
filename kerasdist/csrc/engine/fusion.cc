#include "fusion.h"

#include <algorithm>
#include <climits>
#include <cstring>

#include <sys/mman.h>

#include "kernels.h"

namespace kerasdist {
namespace {

// Fusing a tensor saves one backend call (5-20 us with MPI here) and costs a copy into the
// buffer (25 us for 256 KiB at ~10 GB/s), so larger tensors are reduced alone, in their own
// memory. With ResNet-50's 214 gradients (97.6 MiB) and a 16 MiB threshold: 39 ms a step this
// way, 63 ms fusing them all.
constexpr size_t kLargestFusedBytes = 256 << 10;
// Buffers kept for reuse. A cycle uses one per fused group (a step's gradients may fill many),
// and a step's outputs may still be alive when the next step starts. Past this, buffers are
// allocated per cycle and freed with their outputs, so results a caller keeps pin no more.
constexpr size_t kPooledFusionBuffers = 32;

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
  return AlignedBytes(NumElements(spec.shape) * DataTypeSize(spec.wire));
}

}  // namespace

Fusion::Fusion(const EngineOptions& options, Backend* backend, Timeline* timeline, PhaseClock* phases,
               FusionBufferFactory factory)
    : threshold_bytes_(options.fusion_threshold_bytes),
      backend_(backend),
      timeline_(timeline),
      phases_(phases),
      factory_(std::move(factory)) {}

void Fusion::Run(const std::vector<Collective*>& collectives) {
  // Tensors that share a dtype and a way of combining travel together, in negotiated order.
  std::vector<std::pair<std::pair<DataType, ReduceOp>, std::vector<Item>>> groups;
  for (Collective* c : collectives) {
    for (int t = 0; t < static_cast<int>(c->request.tensors.size()); ++t) {
      auto key = std::make_pair(c->request.tensors[t].wire, CombiningOp(c->request.reduce_op));
      auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == key; });
      if (it == groups.end()) { groups.push_back({key, {}}); it = groups.end() - 1; }
      it->second.push_back({c, t});
    }
  }
  // A fused group is one backend call, whose count MPI takes as an int.
  const size_t threshold = static_cast<size_t>(std::clamp<int64_t>(threshold_bytes_, 0, INT_MAX));
  for (auto& [key, candidates] : groups) {
    std::vector<Item> items;  // the ones worth fusing, in negotiated order
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
      RunGroup({items.begin() + begin, items.begin() + end});
      begin = end;
    }
  }
}

void Fusion::RunAlone(Collective* c, int t) {
  // Reduced straight into its output (usually the input's own memory): no staging copy.
  const TensorSpec& spec = c->request.tensors[t];
  if (spec.compressed()) return RunAloneCompressed(c, t);
  const int64_t count = NumElements(spec.shape);
  phases_->Charge(Phase::kOther);
  void* out = nullptr;
  const Status allocated = c->allocate(t, spec.shape, &out);
  std::vector<char> stand_in;
  if (!allocated.ok()) out = StandInOutput(count * DataTypeSize(spec.dtype), &stand_in, c->request.name);
  phases_->Charge(Phase::kOutputs);
  const void* in = c->inputs[t];
  auto start = Clock::now();
  if (c->request.prescale != 1.0) {
    ScaledCopy(out, in, count, spec.dtype, c->request.prescale);
    in = out;
    phases_->Charge(Phase::kCopyIn);
  }
  // Where the backend scales while it combines, the finishing scale needs no pass of its own.
  const bool scaled_while_combined = backend_->ScalesWhileCombining(spec.dtype);
  Status s = backend_->Allreduce(in, out, count, spec.dtype, c->request.reduce_op,
                                 scaled_while_combined ? c->FinishScale(spec.dtype) : 1.0, c->request.name);
  phases_->Charge(Phase::kTransfer);
  if (!allocated.ok()) return c->Fail(allocated);
  if (!s.ok()) return c->Fail(s);
  auto reduced = Clock::now();
  if (!scaled_while_combined) c->FinishOutput(t, out, count);
  phases_->Charge(Phase::kOutputs);
  if (timeline_->enabled()) {
    timeline_->Phase(c->request.name, "allreduce", start, reduced);
    timeline_->Phase(c->request.name, "scale", reduced, Clock::now());
  }
}

void Fusion::RunAloneCompressed(Collective* c, int t) {
  // Converted to 16 bits on the way into scratch memory, reduced there, and converted back into
  // the output with the finishing scale: the same passes as an uncompressed tensor's copy and
  // scale, and half the bytes on the wire.
  const TensorSpec& spec = c->request.tensors[t];
  const int64_t count = NumElements(spec.shape);
  phases_->Charge(Phase::kOther);
  auto start = Clock::now();
  compressed_scratch_.resize(count);
  CompressCopy(compressed_scratch_.data(), spec.wire, c->inputs[t], spec.dtype, count, c->request.prescale);
  phases_->Charge(Phase::kCopyIn);
  auto reduce_start = Clock::now();
  const double scale = c->FinishScale(spec.dtype);
  const bool scaled_while_combined = backend_->ScalesWhileCombining(spec.wire);
  Status s = backend_->Allreduce(compressed_scratch_.data(), compressed_scratch_.data(), count, spec.wire,
                                 c->request.reduce_op, scaled_while_combined ? scale : 1.0, c->request.name);
  phases_->Charge(Phase::kTransfer);
  if (!s.ok()) return c->Fail(s);
  auto reduced = Clock::now();
  void* out = nullptr;
  s = c->allocate(t, spec.shape, &out);
  if (!s.ok()) return c->Fail(s);
  DecompressCopy(out, spec.dtype, compressed_scratch_.data(), spec.wire, count, scaled_while_combined ? 1.0 : scale);
  phases_->Charge(Phase::kOutputs);
  if (timeline_->enabled()) {
    timeline_->Phase(c->request.name, "copy_in", start, reduce_start);
    timeline_->Phase(c->request.name, "allreduce", reduce_start, reduced);
    timeline_->Phase(c->request.name, "copy_out", reduced, Clock::now());
  }
}

FusionBuffer* Fusion::BufferFor(size_t bytes, std::unique_ptr<FusionBuffer>* transient, size_t* tried) {
  for (auto& buffer : pool_) {
    if (buffer->size() >= bytes && !buffer->InUse()) return buffer.get();
  }
  if (pool_.size() < kPooledFusionBuffers) {
    // Pooled buffers have the threshold's size, so every later group fits. Pages nobody
    // writes are never touched, so a small model does not pay for the whole threshold.
    *tried = std::max<size_t>(bytes, threshold_bytes_);
    auto buffer = factory_(*tried);
    if (!buffer) return nullptr;
    AdviseHugePages(buffer->data(), buffer->size());
    pool_.push_back(std::move(buffer));
    return pool_.back().get();
  }
  // Every pooled buffer is still viewed by live outputs (a caller keeps old results).
  *tried = bytes;
  *transient = factory_(bytes);
  return transient->get();
}

void Fusion::RunGroup(const std::vector<Item>& items) {
  if (items.size() == 1) return RunAlone(items[0].first, items[0].second);
  const DataType dtype = items[0].first->request.tensors[items[0].second].wire;  // what the buffer holds
  const ReduceOp op = items[0].first->request.reduce_op;
  const size_t item_size = DataTypeSize(dtype);
  auto finish_scale = [&](const Item& item) {
    return item.first->FinishScale(item.first->request.tensors[item.second].dtype);
  };
  // Where the backend scales while it combines, it takes the group's scale when all share one.
  const double scale = finish_scale(items[0]);
  const bool scaled_while_combined =
      backend_->ScalesWhileCombining(dtype) &&
      std::all_of(items.begin(), items.end(), [&](const Item& item) { return finish_scale(item) == scale; });
  auto fail_all = [&](const Status& s) {
    for (auto& [c, t] : items) c->Fail(s);
  };

  std::vector<size_t> offsets{0};  // where each tensor starts, then where the group ends
  for (auto& [c, t] : items) offsets.push_back(offsets.back() + FusedBytes(c->request.tensors[t]));
  const size_t total = offsets.back();
  std::unique_ptr<FusionBuffer> transient;
  size_t tried = total;
  FusionBuffer* buffer = BufferFor(total, &transient, &tried);
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
    if (spec.compressed()) {
      CompressCopy(reinterpret_cast<uint16_t*>(data + offsets[i]), dtype, c->inputs[t], spec.dtype, count,
                   c->request.prescale);
    } else {
      ScaledCopy(data + offsets[i], c->inputs[t], count, dtype, c->request.prescale);
    }
    // Padding is reduced too: zeros keep it from holding stale NaNs or denormals.
    const size_t end = offsets[i] + count * item_size;
    std::memset(data + end, 0, offsets[i + 1] - end);
  }
  phases_->Charge(Phase::kCopyIn);
  auto reduce_start = Clock::now();
  Status reduced = backend_->Allreduce(data, data, static_cast<int64_t>(total / item_size), dtype, op,
                                       scaled_while_combined ? scale : 1.0, items[0].first->request.name);
  phases_->Charge(Phase::kTransfer);
  auto scale_start = Clock::now();
  if (!reduced.ok()) return fail_all(reduced);
  for (size_t i = 0; i < items.size(); ++i) {
    auto& [c, t] = items[i];
    const TensorSpec& spec = c->request.tensors[t];
    Status s;
    if (spec.compressed()) {  // its own dtype is wider than the buffer's: converted out, not viewed
      void* out = nullptr;
      s = c->allocate(t, spec.shape, &out);
      if (s.ok()) {
        DecompressCopy(out, spec.dtype, reinterpret_cast<const uint16_t*>(data + offsets[i]), dtype,
                       NumElements(spec.shape), scaled_while_combined ? 1.0 : finish_scale(items[i]));
      }
    } else {
      if (!scaled_while_combined) c->FinishOutput(t, data + offsets[i], NumElements(spec.shape));
      s = c->alias(t, buffer, offsets[i], spec.shape);
    }
    if (!s.ok()) c->Fail(s);
  }
  phases_->Charge(Phase::kOutputs);
  if (timeline_->enabled()) {
    auto end = Clock::now();
    for (auto& [c, t] : items) {
      timeline_->Phase(c->request.name, "copy_in", copy_in_start, reduce_start);
      timeline_->Phase(c->request.name, "allreduce", reduce_start, scale_start);
      timeline_->Phase(c->request.name, "scale", scale_start, end);
    }
  }
}

}  // namespace kerasdist
