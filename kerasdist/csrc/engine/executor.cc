#include "executor.h"

#include <algorithm>

namespace kerasdist {
namespace {

int64_t RowElements(const Shape& shape) {  // values in one row: the product of every dim but the first
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

constexpr DataType kEveryDataType[] = {DataType::kFloat16,  DataType::kBFloat16, DataType::kFloat32,
                                       DataType::kFloat64,  DataType::kInt32,    DataType::kInt64,
                                       DataType::kUInt8,    DataType::kInt8,     DataType::kBool};

}  // namespace

Status Executor::CheckPairing(const Backend& backend, const TensorMemory& memory) {
  if (memory.runs_kernels()) return Status::OK();
  for (DataType dtype : kEveryDataType) {
    if (!backend.ScalesWhileCombining(dtype)) {
      return Status::Internal(std::string("kerasdist: the device backend cannot scale ") + DataTypeName(dtype) +
                              " while it combines, and its memory runs no kernels to scale it afterwards");
    }
  }
  return Status::OK();
}

Executor::Executor(int rank, int size, int64_t fusion_threshold_bytes, std::unique_ptr<Backend> backend,
                   std::unique_ptr<TensorMemory> memory, Watchdog* watchdog, Timeline* timeline, PhaseClock* phases)
    : rank_(rank),
      size_(size),
      memory_(std::move(memory)),
      backend_(std::move(backend)),
      watchdog_(watchdog),
      timeline_(timeline),
      phases_(phases),
      fusion_(fusion_threshold_bytes, backend_.get(), memory_.get(), timeline, phases) {}

void Executor::Run(const Ready& ready, const std::function<void(Collective*)>& finished) {
  // Allreduces first (they fuse), then the rest; the order is the same on every rank.
  std::vector<Collective*> allreduces, others;
  std::vector<const Response*> other_responses;
  for (auto& [c, r] : ready) {
    c->Fail(memory_->OrderAfterFrontEnd(c));  // before anything reads its inputs
    if (c->request.kind == OpKind::kAllreduce) {
      allreduces.push_back(c);
    } else {
      others.push_back(c);
      other_responses.push_back(r);
    }
  }
  if (!allreduces.empty()) {
    fusion_.Run(allreduces);
    Finish(allreduces, finished);
  }
  if (others.empty()) return;
  for (size_t i = 0; i < others.size(); ++i) {
    Collective* c = others[i];
    phases_->Charge(Phase::kOther);
    auto start = Clock::now();
    switch (c->request.kind) {
      case OpKind::kAllgather: c->Fail(RunAllgather(c, *other_responses[i])); break;
      case OpKind::kBroadcast: c->Fail(RunBroadcast(c)); break;
      case OpKind::kReducescatter: c->Fail(RunReducescatter(c)); break;
      case OpKind::kAlltoall: c->Fail(RunAlltoall(c, *other_responses[i])); break;
      case OpKind::kAllreduce:
      case OpKind::kJoin:  // the engine's own: it moves no data
        c->Fail(Status::Internal(std::string("kerasdist: the executor cannot run ") + OpKindName(c->request.kind)));
        break;
    }
    phases_->Charge(Phase::kTransfer);  // with the output's allocation, for these kinds
    if (timeline_->enabled()) timeline_->Phase(c->request.name, OpKindName(c->request.kind), start, Clock::now());
  }
  Finish(others, finished);
}

void Executor::Finish(const std::vector<Collective*>& collectives, const std::function<void(Collective*)>& finished) {
  watchdog_->Arm("the copies of a cycle's collectives");
  const Status synchronized = memory_->Synchronize();
  watchdog_->Disarm();
  phases_->Charge(Phase::kOutputs);
  for (Collective* c : collectives) {
    c->Fail(synchronized);
    finished(c);
  }
}

bool Executor::CanRide(const Request& request) {
  if (request.kind != OpKind::kAllreduce || request.device != Device::kCpu) return false;
  if (request.reduce_op != ReduceOp::kSum && request.reduce_op != ReduceOp::kAverage) return false;
  return std::all_of(request.tensors.begin(), request.tensors.end(), [](const TensorSpec& spec) {
    return spec.dtype == DataType::kFloat32 && !spec.compressed();
  });
}

size_t Executor::RiderValues(const Request& request) {
  size_t values = 0;
  for (const TensorSpec& spec : request.tensors) values += static_cast<size_t>(NumElements(spec.shape));
  return values;
}

void Executor::PackRiders(const std::vector<Collective*>& riders, float* values) {
  for (Collective* c : riders) {
    c->Fail(memory_->OrderAfterFrontEnd(c));  // before anything reads its inputs
    for (size_t t = 0; t < c->request.tensors.size(); ++t) {
      const int64_t count = NumElements(c->request.tensors[t].shape);
      c->Fail(memory_->Copy(values, DataType::kFloat32, c->inputs[t], DataType::kFloat32, count, ScaleIn(*memory_, *c),
                            c->request.name));
      values += count;
    }
  }
}

void Executor::FinishRiders(const std::vector<Collective*>& riders, const float* values,
                            const std::function<void(Collective*)>& finished) {
  for (Collective* c : riders) {
    for (size_t t = 0; t < c->request.tensors.size(); ++t) {
      const TensorSpec& spec = c->request.tensors[t];
      const int64_t count = NumElements(spec.shape);
      void* out = nullptr;
      c->Fail(AllocateOutput(*memory_, c, static_cast<int>(t), spec.shape, spec.dtype, &out));
      c->Fail(memory_->Copy(out, spec.dtype, values, spec.dtype, count, 1.0, c->request.name));
      c->FinishOutput(static_cast<int>(t), out, count);
      values += count;
    }
  }
  Finish(riders, finished);
}

Status Executor::RunAllgather(Collective* c, const Response& r) {
  const TensorSpec& spec = c->request.tensors[0];
  const int64_t row = RowElements(spec.shape);
  Shape out_shape = spec.shape;
  out_shape[0] = 0;
  std::vector<int64_t> counts(size_);
  for (int i = 0; i < size_; ++i) {
    out_shape[0] += r.rank_rows[i];
    counts[i] = r.rank_rows[i] * row;
  }
  void* out = nullptr;
  const Status allocated = AllocateOutput(*memory_, c, 0, out_shape, spec.dtype, &out);
  const Status s = backend_->Allgather(c->inputs[0], out, counts, spec.dtype, c->request.name);
  return allocated.ok() ? s : allocated;
}

Status Executor::RunBroadcast(Collective* c) {
  const TensorSpec& spec = c->request.tensors[0];
  const int64_t count = NumElements(spec.shape);
  if (rank_ == c->request.root_rank && c->inputs[0] != c->outputs[0]) {
    // On failure the root still sends, or the others would wait in the broadcast.
    c->Fail(memory_->Copy(c->outputs[0], spec.dtype, c->inputs[0], spec.dtype, count, 1.0, c->request.name));
  }
  return backend_->Broadcast(c->outputs[0], count, spec.dtype, c->request.root_rank, c->request.name);
}

Status Executor::RunReducescatter(Collective* c) {
  const TensorSpec& spec = c->request.tensors[0];
  const int64_t rows = spec.shape[0], row = RowElements(spec.shape);
  std::vector<int64_t> counts(size_);
  for (int i = 0; i < size_; ++i) counts[i] = (rows / size_ + (i < rows % size_ ? 1 : 0)) * row;
  const void* in = c->inputs[0];
  const double scale_in = ScaleIn(*memory_, *c);
  if (scale_in != 1.0) {
    void* scaled = memory_->Scratch(NumElements(spec.shape) * DataTypeSize(spec.dtype), c->request.name);
    c->Fail(memory_->Copy(scaled, spec.dtype, in, spec.dtype, NumElements(spec.shape), scale_in, c->request.name));
    in = scaled;
  }
  const bool scaled_while_combined = backend_->ScalesWhileCombining(spec.dtype);
  Status s = backend_->ReduceScatter(in, c->outputs[0], counts, spec.dtype, c->request.reduce_op,
                                     scaled_while_combined ? ScaleAfter(*memory_, *c, spec.dtype) : 1.0,
                                     c->request.name);
  if (s.ok() && !scaled_while_combined) c->FinishOutput(0, c->outputs[0], counts[rank_]);
  return s;
}

Status Executor::RunAlltoall(Collective* c, const Response& r) {
  const TensorSpec& spec = c->request.tensors[0];
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
  Status allocated = AllocateOutput(*memory_, c, 0, out_shape, spec.dtype, &out);
  // The received splits are host memory whatever the data's memory (the kernel says so).
  void* splits_out = nullptr;
  if (allocated.ok()) allocated = c->allocate(1, Shape{size_}, &splits_out);
  if (allocated.ok()) {
    for (int i = 0; i < size_; ++i) {
      static_cast<int32_t*>(splits_out)[i] = static_cast<int32_t>(r.alltoall_rows[i * size_ + rank_]);
    }
  }
  const Status s = backend_->Alltoall(c->inputs[0], send, out, recv, spec.dtype, c->request.name);
  return allocated.ok() ? s : allocated;
}

}  // namespace kerasdist
