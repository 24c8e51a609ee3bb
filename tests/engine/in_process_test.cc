// The engine over a transport other than MPI: three ranks as threads of one process, each with
// its own Engine started over in_process_transport.h, run the engine's negotiation (fast and slow
// path, rank 0's validation), fusion and the stall inspector's questions exactly as an MPI job
// does. Each engine also has an emulated device (DeviceHooks): memory without kernels whose
// copies run only when its "stream" does, and a backend that carries every scale, as CUDA memory
// and NCCL are, so the one Executor's device path runs here too. Checked against values this
// program computes itself, on host and device tensors: grouped allreduces (fused, in small
// buffers and unfused; first calls and cached ones), requests scaled differently in one cycle,
// an integer Average, 16-bit compression (host), broadcast, allgather of unequal rows,
// reducescatter, alltoall, a mismatched shape failing on every rank, a rank that never submits
// named by the others' stall timeout, and fusion tuning picking the threshold each of two
// emulated links runs faster, on every rank alike. No MPI call is made.
// tests/engine/test_in_process.py builds and runs it; prints one line per failed check and exits
// non-zero if any failed.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine.h"
#include "in_process_transport.h"
#include "kernels.h"
#include "tuner.h"

namespace kd = kerasdist;

namespace {

constexpr int kRanks = 3;
std::atomic<int> g_checks{0}, g_failures{0};

void Check(int rank, bool ok, const std::string& what) {
  ++g_checks;
  if (ok) return;
  std::printf("rank %d: FAILED: %s\n", rank, what.c_str());
  std::fflush(stdout);
  ++g_failures;
}

class HeapBuffer : public kd::FusionBuffer {
 public:
  explicit HeapBuffer(size_t bytes) : data_(bytes) {}
  char* data() override { return data_.data(); }
  size_t size() const override { return data_.size(); }
  bool InUse() const override { return false; }  // outputs are copied out at once

 private:
  std::vector<char> data_;
};

// A device's memory, emulated in host memory: no kernels, fused outputs copied out of one
// buffer allocated up front, and copies that run only when the "stream" does (before each call
// of the backend, which shares it, as NCCL shares a CUDA stream, and in Synchronize). An executor
// that handed results back before synchronizing, or asked this memory to scale or convert, would
// leave wrong values or an error here.
class EmulatedDeviceMemory : public kd::TensorMemory {
 public:
  explicit EmulatedDeviceMemory(int64_t threshold_bytes)
      : buffer_(threshold_bytes > 0 ? threshold_bytes + kAlignment : 0) {}

  size_t alignment() const override { return kAlignment; }
  size_t largest_fused_bytes() const override { return SIZE_MAX; }
  bool runs_kernels() const override { return false; }
  bool outputs_view_buffers() const override { return false; }
  kd::Status OrderAfterFrontEnd(kd::Collective* c) override {
    if (!c->device.wait_for_framework) return kd::Status::Internal("a device collective without its ordering hook");
    return c->device.wait_for_framework(this);
  }
  kd::Status Copy(void* to, kd::DataType to_type, const void* from, kd::DataType from_type, int64_t count,
                  double scale, const std::string& name) override {
    if (to_type != from_type || scale != 1.0) {
      return kd::Status::Internal("emulated device: asked to convert or scale '" + name + "'");
    }
    const size_t bytes = count * kd::DataTypeSize(to_type);
    enqueued_.push_back([to, from, bytes] { std::memcpy(to, from, bytes); });
    return kd::Status::OK();
  }
  kd::Status Zero(void* data, size_t bytes, const std::string&) override {
    enqueued_.push_back([data, bytes] { std::memset(data, 0, bytes); });
    return kd::Status::OK();
  }
  kd::FusionBuffer* BufferFor(size_t bytes, std::unique_ptr<kd::FusionBuffer>*, size_t* tried) override {
    *tried = bytes;
    return bytes <= buffer_.size() ? &buffer_ : nullptr;
  }
  void* Scratch(size_t bytes, const std::string&) override {
    scratch_.emplace_back(bytes);
    return scratch_.back().data();
  }
  kd::Status Synchronize() override {
    RunStream();
    scratch_.clear();
    return kd::Status::OK();
  }
  void RunStream() {
    for (auto& work : enqueued_) work();
    enqueued_.clear();
  }

 private:
  static constexpr size_t kAlignment = 256;
  HeapBuffer buffer_;
  std::vector<std::function<void()>> enqueued_;
  std::deque<std::vector<char>> scratch_;
};

// NCCL's part, emulated: the in-process backend behind the device memory's stream, scaling every
// dtype while it combines (an integer Average divides, as ncclAvg does).
class EmulatedDeviceBackend : public in_process::Backend {
 public:
  EmulatedDeviceBackend(in_process::World* world, int rank, EmulatedDeviceMemory* memory)
      : in_process::Backend(world, rank), memory_(memory), size_(world->size()) {}

  bool ScalesWhileCombining(kd::DataType) const override { return true; }
  kd::Status Allreduce(const void* in, void* out, int64_t count, kd::DataType dtype, kd::ReduceOp op, double scale,
                       const std::string& name) override {
    memory_->RunStream();
    kd::Status s = in_process::Backend::Allreduce(in, out, count, dtype, op, IsHalf(dtype) ? scale : 1.0, name);
    if (s.ok() && !IsHalf(dtype)) Finish(out, count, dtype, op, scale);
    return s;
  }
  kd::Status ReduceScatter(const void* in, void* out, const std::vector<int64_t>& counts, kd::DataType dtype,
                           kd::ReduceOp op, double scale, const std::string& name) override {
    memory_->RunStream();
    kd::Status s = in_process::Backend::ReduceScatter(in, out, counts, dtype, op, IsHalf(dtype) ? scale : 1.0, name);
    if (s.ok() && !IsHalf(dtype)) Finish(out, counts[rank()], dtype, op, scale);
    return s;
  }
  kd::Status Allgather(const void* in, void* out, const std::vector<int64_t>& counts, kd::DataType dtype,
                       const std::string& name) override {
    memory_->RunStream();
    return in_process::Backend::Allgather(in, out, counts, dtype, name);
  }
  kd::Status Broadcast(void* data, int64_t count, kd::DataType dtype, int root, const std::string& name) override {
    memory_->RunStream();
    return in_process::Backend::Broadcast(data, count, dtype, root, name);
  }
  kd::Status Alltoall(const void* in, const std::vector<int64_t>& send_counts, void* out,
                      const std::vector<int64_t>& recv_counts, kd::DataType dtype, const std::string& name) override {
    memory_->RunStream();
    return in_process::Backend::Alltoall(in, send_counts, out, recv_counts, dtype, name);
  }

 private:
  static bool IsHalf(kd::DataType dtype) {
    return dtype == kd::DataType::kFloat16 || dtype == kd::DataType::kBFloat16;
  }
  void Finish(void* out, int64_t count, kd::DataType dtype, kd::ReduceOp op, double scale) const {
    if (op == kd::ReduceOp::kAverage && !kd::IsFloatingPoint(dtype)) {
      kd::DivideIntegersInPlace(out, count, dtype, size_);
    } else {
      kd::ScaleInPlace(out, count, dtype, scale);
    }
  }

  EmulatedDeviceMemory* memory_;
  const int size_;
};

kd::DeviceHooks EmulatedDeviceHooks(in_process::World* world, int rank) {
  kd::DeviceHooks hooks;
  hooks.check = [](const kd::Request& request, const kd::DeviceTensors&) {
    for (const kd::TensorSpec& t : request.tensors) {
      if (t.compressed()) return kd::Status::InvalidArgument("emulated device: no compression");
    }
    return kd::Status::OK();
  };
  hooks.create = [world, rank](kd::ControlPlane*, kd::Watchdog*, const kd::EngineOptions& options,
                               std::unique_ptr<kd::Backend>* backend, std::unique_ptr<kd::TensorMemory>* memory) {
    auto device = std::make_unique<EmulatedDeviceMemory>(options.fusion_threshold_bytes);
    *backend = std::make_unique<EmulatedDeviceBackend>(world, rank, device.get());
    *memory = std::move(device);
    return kd::Status::OK();
  };
  return hooks;
}

// One rank: its engine, and calls that wait for their result as the C API's do, on host tensors
// or (after OnDevice) on the emulated device's.
class Rank {
 public:
  // `backend`, when given, moves the host tensors instead of the in-process transport's own.
  Rank(in_process::World* world, int rank, const kd::EngineOptions& options,
       std::unique_ptr<kd::Backend> backend = nullptr)
      : rank_(rank) {
    engine_.SetFusionBufferFactory([](size_t bytes) { return std::make_unique<HeapBuffer>(bytes); });
    engine_.SetDeviceHooks(EmulatedDeviceHooks(world, rank));
    const kd::Status started =
        engine_.Start(options, [world, rank, &backend](const kd::EngineOptions&, kd::Transport* t) {
          *t = world->TransportFor(rank);
          if (backend) t->backend = std::move(backend);
          return kd::Status::OK();
        });
    Check(rank, started.ok(), "Start: " + started.message);
  }
  ~Rank() { engine_.Shutdown(); }

  int rank() const { return rank_; }
  int64_t riders() const { return engine_.phases().riders(); }
  void OnDevice(bool on_device) { on_device_ = on_device; }
  bool on_device() const { return on_device_; }
  int orderings() const { return orderings_; }
  const char* where() const { return on_device_ ? " on the device" : " on the host"; }

  // Allreduces `tensors` (of `dtype`, travelling as `wire`) as one group, in place; the result
  // once `Wait` returns. `prescale`/`postscale` as the request's.
  template <typename T>
  std::future<kd::Status> StartGroupedAllreduce(const std::string& name, std::vector<std::vector<T>>* tensors,
                                                kd::DataType dtype, kd::ReduceOp op, kd::DataType wire,
                                                double prescale = 1.0, double postscale = 1.0) {
    kd::Request request;
    request.name = name;
    request.kind = kd::OpKind::kAllreduce;
    request.reduce_op = op;
    request.prescale = prescale;
    request.postscale = postscale;
    std::vector<const void*> inputs;
    for (auto& t : *tensors) {
      kd::TensorSpec spec;
      spec.dtype = dtype;
      spec.wire = wire;
      spec.shape = {static_cast<int64_t>(t.size())};
      request.tensors.push_back(spec);
      inputs.push_back(t.data());
    }
    kd::AllocateFn allocate = [tensors](int index, const kd::Shape&, void** data) {
      *data = (*tensors)[index].data();
      return kd::Status::OK();
    };
    const bool on_device = on_device_;
    const int rank = rank_;
    kd::AliasFn alias = [tensors, on_device, rank](int index, kd::FusionBuffer* buffer, size_t offset,
                                                   const kd::Shape& shape) {
      Check(rank, !on_device, "a device output was made a view of a fusion buffer");
      std::memcpy((*tensors)[index].data(), buffer->data() + offset, kd::NumElements(shape) * sizeof(T));
      return kd::Status::OK();
    };
    return Submit(std::move(request), std::move(inputs), {}, std::move(allocate), std::move(alias));
  }
  template <typename T>
  kd::Status GroupedAllreduce(const std::string& name, std::vector<std::vector<T>>* tensors, kd::DataType dtype,
                              kd::ReduceOp op, kd::DataType wire) {
    return StartGroupedAllreduce(name, tensors, dtype, op, wire).get();
  }

  kd::Status Broadcast(const std::string& name, std::vector<int64_t>* data, int root) {
    kd::Request request;
    request.name = name;
    request.kind = kd::OpKind::kBroadcast;
    request.root_rank = root;
    request.tensors.push_back({kd::DataType::kInt64, {static_cast<int64_t>(data->size())}, kd::DataType::kInt64});
    return Submit(std::move(request), {data->data()}, {data->data()}, nullptr, nullptr).get();
  }

  kd::Status Allgather(const std::string& name, const std::vector<double>& rows_of_two, std::vector<double>* out) {
    kd::Request request;
    request.name = name;
    request.kind = kd::OpKind::kAllgather;
    request.tensors.push_back(
        {kd::DataType::kFloat64, {static_cast<int64_t>(rows_of_two.size() / 2), 2}, kd::DataType::kFloat64});
    kd::AllocateFn allocate = [out](int, const kd::Shape& shape, void** data) {
      out->resize(kd::NumElements(shape));
      *data = out->data();
      return kd::Status::OK();
    };
    return Submit(std::move(request), {rows_of_two.data()}, {}, std::move(allocate), nullptr).get();
  }

  // Rows of two values, this rank's share of them reduced with `op` and scaled into `out`.
  kd::Status Reducescatter(const std::string& name, const std::vector<double>& rows_of_two, kd::ReduceOp op,
                           double postscale, std::vector<double>* out) {
    kd::Request request;
    request.name = name;
    request.kind = kd::OpKind::kReducescatter;
    request.reduce_op = op;
    request.postscale = postscale;
    const int64_t rows = static_cast<int64_t>(rows_of_two.size() / 2), size = kRanks;
    request.tensors.push_back({kd::DataType::kFloat64, {rows, 2}, kd::DataType::kFloat64});
    out->assign(2 * (rows / size + (rank_ < rows % size ? 1 : 0)), 0.0);  // as the kernel allocates it
    return Submit(std::move(request), {rows_of_two.data()}, {out->data()}, nullptr, nullptr).get();
  }

  // `splits[r]` rows of two values to rank r; what arrives in `out`, and from whom, in `received`.
  kd::Status Alltoall(const std::string& name, const std::vector<double>& rows_of_two,
                      const std::vector<int64_t>& splits, std::vector<double>* out, std::vector<int32_t>* received) {
    kd::Request request;
    request.name = name;
    request.kind = kd::OpKind::kAlltoall;
    request.splits = splits;
    request.tensors.push_back(
        {kd::DataType::kFloat64, {static_cast<int64_t>(rows_of_two.size() / 2), 2}, kd::DataType::kFloat64});
    kd::AllocateFn allocate = [out, received](int index, const kd::Shape& shape, void** data) {
      if (index == 0) {
        out->resize(kd::NumElements(shape));
        *data = out->data();
      } else {
        received->resize(kd::NumElements(shape));
        *data = received->data();
      }
      return kd::Status::OK();
    };
    return Submit(std::move(request), {rows_of_two.data()}, {}, std::move(allocate), nullptr).get();
  }

 private:
  std::future<kd::Status> Submit(kd::Request request, std::vector<const void*> inputs, std::vector<void*> outputs,
                                 kd::AllocateFn allocate, kd::AliasFn alias) {
    request.blocking = true;
    auto finished = std::make_shared<std::promise<kd::Status>>();
    std::future<kd::Status> result = finished->get_future();
    kd::DeviceTensors device;
    if (on_device_) {
      request.device = kd::Device::kGpu;
      device.ordinal = 0;
      device.wait_for_framework = [this](void*) {
        ++orderings_;
        return kd::Status::OK();
      };
    }
    kd::Status status = engine_.Enqueue(std::move(request), std::move(inputs), std::move(outputs),
                                        std::move(allocate), std::move(alias),
                                        [finished](const kd::Status& s) { finished->set_value(s); }, device);
    if (!status.ok()) finished->set_value(status);
    return result;
  }

  const int rank_;
  bool on_device_ = false;
  std::atomic<int> orderings_{0};  // calls of the device's ordering hook
  kd::Engine engine_;
};

// Rank r's element i of tensor t in call `call`: small integers, exact in every dtype used.
double Local(int r, int t, int64_t i, int call) { return (r + 1) * ((i + t) % 5 - 2) + (i % 7) - 3 + call; }

template <typename T>
void CheckAllreduces(Rank& me, kd::DataType dtype, kd::DataType wire, const char* label) {
  const std::vector<int64_t> sizes = {1, 300, 5000};  // with 4 KiB buffers, the last runs alone
  for (kd::ReduceOp op : {kd::ReduceOp::kSum, kd::ReduceOp::kAverage, kd::ReduceOp::kMax}) {
    // Three calls of one name: the first goes through rank 0, the others take the fast path.
    for (int call = 0; call < 3; ++call) {
      std::vector<std::vector<T>> tensors;
      for (size_t t = 0; t < sizes.size(); ++t) {
        tensors.emplace_back(sizes[t]);
        for (int64_t i = 0; i < sizes[t]; ++i) tensors[t][i] = static_cast<T>(Local(me.rank(), t, i, call));
      }
      const std::string name = std::string(label) + me.where() + "/" + kd::ReduceOpName(op);
      const kd::Status s = me.GroupedAllreduce(name, &tensors, dtype, op, wire);
      Check(me.rank(), s.ok(), name + ": " + s.message);
      if (!s.ok()) return;
      int wrong = 0;
      for (size_t t = 0; t < sizes.size(); ++t) {
        for (int64_t i = 0; i < sizes[t]; ++i) {
          double expected = op == kd::ReduceOp::kMax ? -1e300 : 0;
          for (int r = 0; r < kRanks; ++r) {
            const double v = Local(r, t, i, call);
            expected = op == kd::ReduceOp::kMax ? std::max(expected, v) : expected + v;
          }
          if (op == kd::ReduceOp::kAverage) expected /= kRanks;
          // Sums of small integers are exact; an Average's division is not (float32: 24 bits), and
          // bfloat16 carries 8 significant bits.
          const double bits = wire != dtype ? 8 : dtype == kd::DataType::kFloat32 ? 24 : 53;
          const double tolerance = std::ldexp(2.0, -static_cast<int>(bits)) * std::max(1.0, std::fabs(expected));
          if (std::fabs(tensors[t][i] - expected) > tolerance) ++wrong;
        }
      }
      Check(me.rank(), wrong == 0, name + " call " + std::to_string(call) + ": " + std::to_string(wrong) + " wrong");
    }
  }
}

void CheckBroadcastAndAllgather(Rank& me) {
  std::vector<int64_t> data(100);
  for (int i = 0; i < 100; ++i) data[i] = 1000 * me.rank() + i;
  kd::Status s = me.Broadcast(std::string("broadcast from 1") + me.where(), &data, 1);
  bool right = s.ok();
  for (int i = 0; i < 100; ++i) right = right && data[i] == 1000 + i;
  Check(me.rank(), right, std::string("broadcast from rank 1") + me.where() + ": " + s.message);

  // Rank r sends r + 1 rows of two values: (r, row).
  std::vector<double> mine;
  for (int row = 0; row <= me.rank(); ++row) mine.insert(mine.end(), {double(me.rank()), double(row)});
  std::vector<double> gathered;
  s = me.Allgather(std::string("allgather of unequal rows") + me.where(), mine, &gathered);
  std::vector<double> expected;
  for (int r = 0; r < kRanks; ++r) {
    for (int row = 0; row <= r; ++row) expected.insert(expected.end(), {double(r), double(row)});
  }
  Check(me.rank(), s.ok() && gathered == expected,
        std::string("allgather of unequal rows") + me.where() + ": " + s.message);
}

// Requests scaled differently, in flight together (mostly one cycle): fused where they may be,
// never with a tensor scaled otherwise. Without kernels, each group's scale is the backend's.
void CheckScaledAllreduces(Rank& me) {
  struct Case {
    const char* name;
    kd::ReduceOp op;
    double prescale, postscale;
  };
  const std::vector<Case> cases = {{"sum times 2", kd::ReduceOp::kSum, 1.0, 2.0},
                                   {"sum prescaled by 0.5", kd::ReduceOp::kSum, 0.5, 1.0},
                                   {"average", kd::ReduceOp::kAverage, 1.0, 1.0},
                                   {"average times 3", kd::ReduceOp::kAverage, 1.0, 3.0},
                                   {"plain sum", kd::ReduceOp::kSum, 1.0, 1.0}};
  const std::vector<int64_t> sizes = {3, 700};
  std::vector<std::vector<std::vector<double>>> tensors(cases.size());
  std::vector<std::vector<int64_t>> integers(1, std::vector<int64_t>(5));
  std::vector<std::future<kd::Status>> results;
  for (size_t k = 0; k < cases.size(); ++k) {
    for (size_t t = 0; t < sizes.size(); ++t) {
      tensors[k].emplace_back(sizes[t]);
      for (int64_t i = 0; i < sizes[t]; ++i) tensors[k][t][i] = Local(me.rank(), t, i, k);
    }
    results.push_back(me.StartGroupedAllreduce(cases[k].name + std::string(me.where()), &tensors[k],
                                               kd::DataType::kFloat64, cases[k].op, kd::DataType::kFloat64,
                                               cases[k].prescale, cases[k].postscale));
  }
  for (int64_t i = 0; i < 5; ++i) integers[0][i] = Local(me.rank(), 0, i, 0);
  auto integer_result = me.StartGroupedAllreduce(std::string("integer average") + me.where(), &integers,
                                                 kd::DataType::kInt64, kd::ReduceOp::kAverage, kd::DataType::kInt64);
  for (size_t k = 0; k < cases.size(); ++k) {
    const kd::Status s = results[k].get();
    int wrong = 0;
    for (size_t t = 0; s.ok() && t < sizes.size(); ++t) {
      for (int64_t i = 0; i < sizes[t]; ++i) {
        double expected = 0;
        for (int r = 0; r < kRanks; ++r) expected += Local(r, t, i, k);
        expected *= cases[k].prescale * cases[k].postscale / (cases[k].op == kd::ReduceOp::kAverage ? kRanks : 1);
        if (std::fabs(tensors[k][t][i] - expected) > 1e-12 * std::max(1.0, std::fabs(expected))) ++wrong;
      }
    }
    Check(me.rank(), s.ok() && wrong == 0,
          cases[k].name + std::string(me.where()) + ": " + std::to_string(wrong) + " wrong " + s.message);
  }
  const kd::Status s = integer_result.get();
  bool right = s.ok();
  for (int64_t i = 0; i < 5; ++i) {
    int64_t sum = 0;
    for (int r = 0; r < kRanks; ++r) sum += static_cast<int64_t>(Local(r, 0, i, 0));
    right = right && integers[0][i] == sum / kRanks;  // truncated toward zero, as C and TensorFlow do
  }
  Check(me.rank(), right, std::string("integer average") + me.where() + ": " + s.message);
}

void CheckReducescatterAndAlltoall(Rank& me) {
  // 7 rows of (row + rank, -row): ranks take 3, 2, 2 rows of the Average, times 3.
  std::vector<double> rows;
  for (int row = 0; row < 7; ++row) rows.insert(rows.end(), {double(row + me.rank()), double(-row)});
  std::vector<double> mine;
  kd::Status s = me.Reducescatter(std::string("reducescatter") + me.where(), rows, kd::ReduceOp::kAverage, 3.0, &mine);
  const int first = me.rank() == 0 ? 0 : me.rank() == 1 ? 3 : 5;
  std::vector<double> expected;
  for (int row = first; row < first + static_cast<int>(mine.size() / 2); ++row) {
    expected.insert(expected.end(), {3.0 * (row + 1.0), -3.0 * row});  // the mean of row + r over r = 0, 1, 2
  }
  Check(me.rank(), s.ok() && mine.size() == (me.rank() == 0 ? 6u : 4u) && mine == expected,
        std::string("reducescatter") + me.where() + ": " + s.message);

  // Rank r sends d + 1 rows of (r, d) to rank d; rank d receives d + 1 rows from each, in rank order.
  std::vector<double> sent;
  std::vector<int64_t> splits;
  for (int d = 0; d < kRanks; ++d) {
    splits.push_back(d + 1);
    for (int row = 0; row <= d; ++row) sent.insert(sent.end(), {double(me.rank()), double(d)});
  }
  std::vector<double> received;
  std::vector<int32_t> received_rows;
  s = me.Alltoall(std::string("alltoall") + me.where(), sent, splits, &received, &received_rows);
  std::vector<double> expected_received;
  for (int r = 0; r < kRanks; ++r) {
    for (int row = 0; row <= me.rank(); ++row) expected_received.insert(expected_received.end(), {double(r), double(me.rank())});
  }
  Check(me.rank(),
        s.ok() && received == expected_received && received_rows == std::vector<int32_t>(kRanks, me.rank() + 1),
        std::string("alltoall") + me.where() + ": " + s.message);
}

void CheckAMismatchFailsOnEveryRank(Rank& me) {
  // Rank 2 passes 4 values where the others pass 3: rank 0 refuses it for every rank.
  std::vector<std::vector<float>> tensors = {std::vector<float>(me.rank() == 2 ? 4 : 3, 1.0f)};
  const kd::Status s =
      me.GroupedAllreduce("mismatched", &tensors, kd::DataType::kFloat32, kd::ReduceOp::kSum, kd::DataType::kFloat32);
  Check(me.rank(),
        s.code == kd::StatusCode::kFailedPrecondition &&
            s.message.find("mismatched shape for 'mismatched': ranks 0, 1 sent shape [3]; rank 2 sent shape [4]") !=
                std::string::npos,
        "a mismatched shape fails on every rank, naming the ranks: " + s.message);
}

// Every rank's checks, each in its own thread, over one world.
void RunJob(int64_t fusion_threshold_bytes) {
  in_process::World world(kRanks);
  kd::EngineOptions options;
  options.fusion_threshold_bytes = fusion_threshold_bytes;
  options.cache_capacity = 64;
  options.mismatch_timeout_s = 10;
  options.log_level = 3;  // the mismatch's expected error stays quiet
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&world, &options, r] {
      Rank me(&world, r, options);
      for (bool on_device : {false, true}) {
        me.OnDevice(on_device);
        CheckAllreduces<float>(me, kd::DataType::kFloat32, kd::DataType::kFloat32, "float32");
        CheckAllreduces<double>(me, kd::DataType::kFloat64, kd::DataType::kFloat64, "float64");
        if (!on_device) CheckAllreduces<float>(me, kd::DataType::kFloat32, kd::DataType::kBFloat16, "float32 as bfloat16");
        CheckScaledAllreduces(me);
        CheckBroadcastAndAllgather(me);
        CheckReducescatterAndAlltoall(me);
        CheckAMismatchFailsOnEveryRank(me);
      }
      Check(r, me.orderings() > 0, "the device collectives never ordered themselves after the front end");
      Check(r, me.riders() == 0, "with piggybacking off (0 bytes), nothing rode");
    });  // ~Rank shuts its engine down, with the others
  }
  for (auto& t : threads) t.join();
}

// Calls `name` (float32 tensors of `sizes` values; rank-dependent small integers, so sums are
// exact) with `op` on this rank and checks the result against the sum computed here.
void CheckSmallAllreduce(Rank& me, const std::string& name, const std::vector<int64_t>& sizes, kd::ReduceOp op,
                         int call, double prescale = 1.0, double postscale = 1.0) {
  std::vector<std::vector<float>> tensors;
  for (size_t t = 0; t < sizes.size(); ++t) {
    tensors.emplace_back(sizes[t]);
    for (int64_t i = 0; i < sizes[t]; ++i) tensors[t][i] = static_cast<float>(Local(me.rank(), t, i, call));
  }
  const kd::Status s = me.StartGroupedAllreduce(name, &tensors, kd::DataType::kFloat32, op, kd::DataType::kFloat32,
                                                prescale, postscale)
                           .get();
  Check(me.rank(), s.ok(), name + ": " + s.message);
  int wrong = 0;
  for (size_t t = 0; t < sizes.size(); ++t) {
    for (int64_t i = 0; i < sizes[t]; ++i) {
      double expected = 0;
      for (int r = 0; r < kRanks; ++r) expected += prescale * Local(r, t, i, call);
      expected *= postscale / (op == kd::ReduceOp::kAverage ? kRanks : 1);
      if (std::fabs(tensors[t][i] - expected) > 1e-5 * std::max(1.0, std::fabs(expected))) ++wrong;
    }
  }
  Check(me.rank(), wrong == 0, name + " call " + std::to_string(call) + ": " + std::to_string(wrong) + " wrong");
}

// Small float32 allreduces ride with negotiation (KERASDIST_PIGGYBACK_BYTES): repeated ones ride
// from their fifth cycle on, alternating ones too; the sums are right whether they ride or not,
// when one rank has something else pending (the values travel and are dropped), and never for a
// set over the limit or of integers.
void RunJobWithRiders() {
  in_process::World world(kRanks);
  kd::EngineOptions options;
  options.fusion_threshold_bytes = int64_t{1} << 20;
  options.piggyback_bytes = 4096;
  options.cache_capacity = 64;
  options.mismatch_timeout_s = 10;
  options.log_level = 3;
  constexpr int kCalls = 20;
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&world, &options, r] {
      Rank me(&world, r, options);
      for (int call = 0; call < kCalls; ++call) {
        CheckSmallAllreduce(me, "summed", {1, 300}, kd::ReduceOp::kSum, call);
        CheckSmallAllreduce(me, "averaged", {7, 2, 5}, kd::ReduceOp::kAverage, call, 0.5, 2.0);
      }
      // Two names take turns, one cycle each: after the first four, every cycle rides.
      Check(r, me.riders() >= 2 * kCalls - 4, "alternating small allreduces rode " + std::to_string(me.riders()) +
                                                  " times in " + std::to_string(2 * kCalls) + " cycles");

      // Rank 2 has another cached request pending first: the others' values travel for nothing.
      std::vector<std::vector<float>> other = {std::vector<float>(1, static_cast<float>(r)),
                                               std::vector<float>(300, static_cast<float>(r))};
      std::future<kd::Status> summed;
      if (r == 2) {
        summed = me.StartGroupedAllreduce("summed", &other, kd::DataType::kFloat32, kd::ReduceOp::kSum,
                                          kd::DataType::kFloat32);
        std::this_thread::sleep_for(std::chrono::milliseconds(30));
      }
      CheckSmallAllreduce(me, "averaged", {7, 2, 5}, kd::ReduceOp::kAverage, kCalls, 0.5, 2.0);
      if (r != 2) {
        summed = me.StartGroupedAllreduce("summed", &other, kd::DataType::kFloat32, kd::ReduceOp::kSum,
                                          kd::DataType::kFloat32);
      }
      const kd::Status s = summed.get();
      Check(r, s.ok() && other[0] == std::vector<float>(1, 3) && other[1] == std::vector<float>(300, 3),
            "'summed' beside another rank's order");

      // Riding resumes; never for 4100 bytes or for integers.
      const int64_t before = me.riders();
      for (int call = 0; call < 10; ++call) CheckSmallAllreduce(me, "summed", {1, 300}, kd::ReduceOp::kSum, call);
      Check(r, me.riders() - before >= 10 - 4, "riding resumed: " + std::to_string(me.riders() - before));
      const int64_t before_large = me.riders();
      for (int call = 0; call < 8; ++call) CheckSmallAllreduce(me, "4100 bytes", {1025}, kd::ReduceOp::kSum, call);
      for (int call = 0; call < 8; ++call) {
        std::vector<std::vector<int32_t>> integers = {std::vector<int32_t>(4, r + call)};
        const kd::Status summed = me.GroupedAllreduce("integers", &integers, kd::DataType::kInt32, kd::ReduceOp::kSum,
                                                      kd::DataType::kInt32);
        Check(r, summed.ok() && integers[0] == std::vector<int32_t>(4, 3 * call + 3), "an int32 sum");
      }
      Check(r, me.riders() == before_large, "over the limit or of integers, nothing rode");
    });
  }
  for (auto& t : threads) t.join();
}

// Rank 2 starts its engine and submits nothing: the others' wait in negotiation times out,
// naming it as in no collective (it answered their questions while idle).
void RunJobWithARankThatNeverSubmits() {
  in_process::World world(kRanks);
  kd::EngineOptions options;
  options.cache_capacity = 64;
  options.stall_warning_s = 1;
  options.stall_timeout_s = 3;
  options.log_level = 3;
  std::promise<void> others_failed;
  std::shared_future<void> others_done = others_failed.get_future().share();
  std::atomic<int> failed{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      Rank me(&world, r, options);
      if (r == 2) {
        others_done.wait();
        world.Close();  // as if the job ended: rank 2's shutdown then fails its negotiation and stops
        return;
      }
      std::vector<std::vector<float>> tensors = {std::vector<float>(8, 1.0f)};
      const kd::Status s =
          me.GroupedAllreduce("never on rank 2", &tensors, kd::DataType::kFloat32, kd::ReduceOp::kSum,
                              kd::DataType::kFloat32);
      Check(r,
            s.code == kd::StatusCode::kDeadlineExceeded &&
                s.message.find("rank(s) 2 (host thread2) (not in any collective)") != std::string::npos,
            "the stall timeout names rank 2 as in no collective: " + s.message);
      if (++failed == 2) others_failed.set_value();
    });
  }
  for (auto& t : threads) t.join();
}

// The in-process backend behind a link: each allreduce sleeps `call_s` plus its bytes at
// `bytes_per_s`, and twice that per byte for calls over 1 MiB when `large_calls_slow` (as MPI's
// large calls ran over a 1 Gbit/s link). Records the largest call since the test last asked.
class LinkBackend : public in_process::Backend {
 public:
  LinkBackend(in_process::World* world, int rank, double call_s, bool large_calls_slow)
      : in_process::Backend(world, rank), call_s_(call_s), large_calls_slow_(large_calls_slow) {}

  kd::Status Allreduce(const void* in, void* out, int64_t count, kd::DataType dtype, kd::ReduceOp op, double scale,
                       const std::string& name) override {
    const int64_t bytes = count * kd::DataTypeSize(dtype);
    const double per_byte = (large_calls_slow_ && bytes > (int64_t{1} << 20) ? 2 : 1) / kBytesPerSecond;
    std::this_thread::sleep_for(std::chrono::duration<double>(call_s_ + bytes * per_byte));
    int64_t largest = largest_call_.load();
    while (bytes > largest && !largest_call_.compare_exchange_weak(largest, bytes)) {
    }
    return in_process::Backend::Allreduce(in, out, count, dtype, op, scale, name);
  }
  int64_t TakeLargestCall() { return largest_call_.exchange(0); }

 private:
  static constexpr double kBytesPerSecond = 1e9;
  const double call_s_;
  const bool large_calls_slow_;
  std::atomic<int64_t> largest_call_{0};
};

// A 16 MiB threshold with fusion tuning on, over a link that `large_calls_slow` or where each
// call costs 2 ms: every step fuses 48 tensors of 64 KiB (3 MiB). Once rank 0 has timed 8 steps
// of each threshold, every rank fuses in calls of at most 1 MiB on the first link and in one
// call on the second; the sums are right throughout.
void RunJobThatTunesFusion(bool large_calls_slow) {
  in_process::World world(kRanks);
  kd::EngineOptions options;
  options.fusion_threshold_bytes = int64_t{16} << 20;
  options.autotune = true;
  options.fusion_tuning = true;
  options.cache_capacity = 64;
  options.log_level = 3;
  const std::string link = large_calls_slow ? "a link slow for large calls" : "a link with a 2 ms call cost";
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      auto backend = std::make_unique<LinkBackend>(&world, r, large_calls_slow ? 0.0 : 2e-3, large_calls_slow);
      LinkBackend* link_backend = backend.get();
      Rank me(&world, r, options, std::move(backend));
      constexpr int kSteps = 2 * kd::Tuner::kRounds + 5;
      int wrong_steps = 0;
      for (int step = 0; step < kSteps; ++step) {
        if (step == kSteps - 5) link_backend->TakeLargestCall();  // from here on, the choice is made
        std::vector<std::vector<float>> tensors(48, std::vector<float>(16384));
        for (size_t t = 0; t < tensors.size(); ++t) {
          for (int64_t i = 0; i < 16384; ++i) tensors[t][i] = static_cast<float>(Local(r, t, i, step));
        }
        const kd::Status s =
            me.GroupedAllreduce("tuned", &tensors, kd::DataType::kFloat32, kd::ReduceOp::kSum, kd::DataType::kFloat32);
        bool right = s.ok();
        for (size_t t = 0; right && t < tensors.size(); ++t) {
          for (int64_t i = 0; right && i < 16384; ++i) {
            double expected = 0;
            for (int q = 0; q < kRanks; ++q) expected += Local(q, t, i, step);
            right = tensors[t][i] == static_cast<float>(expected);
          }
        }
        wrong_steps += right ? 0 : 1;
      }
      Check(r, wrong_steps == 0, link + ": " + std::to_string(wrong_steps) + " steps with wrong sums");
      const int64_t largest = link_backend->TakeLargestCall();
      const int64_t expected = large_calls_slow ? int64_t{1} << 20 : int64_t{3} << 20;
      Check(r, largest == expected,
            link + ": the last steps' largest call was " + std::to_string(largest) + " bytes, not " +
                std::to_string(expected));
    });
  }
  for (auto& t : threads) t.join();
}

// The in-process backend with three allreduce algorithms to choose from, as MpiBackend offers
// auto, mpi and ring on 3 hosts: a call of `bytes` sleeps bytes / 50 MB/s times the current
// algorithm's factor. Appends the algorithm of each call to `ran`, which outlives the backend.
class ChoosingBackend : public in_process::Backend {
 public:
  // auto, mpi, ring: ring takes a quarter of auto's time. A 2 MiB call sleeps 40 ms under auto,
  // so that the machine's load (CI runs two test files at once) cannot reverse the order.
  static constexpr double kFactor[] = {1.0, 1.5, 0.25};

  ChoosingBackend(in_process::World* world, int rank, std::vector<int>* ran)
      : in_process::Backend(world, rank), ran_(ran) {}

  std::vector<kd::AllreduceChoice> AllreduceChoices() const override {
    return {kd::AllreduceChoice::kAuto, kd::AllreduceChoice::kMpi, kd::AllreduceChoice::kRing};
  }
  void UseAllreduceChoice(kd::AllreduceChoice choice) override {
    const auto choices = AllreduceChoices();
    current_ = static_cast<int>(std::find(choices.begin(), choices.end(), choice) - choices.begin());
  }
  std::string Layout() const override { return "3 emulated hosts x 1 rank"; }

  kd::Status Allreduce(const void* in, void* out, int64_t count, kd::DataType dtype, kd::ReduceOp op, double scale,
                       const std::string& name) override {
    const int64_t bytes = count * kd::DataTypeSize(dtype);
    std::this_thread::sleep_for(std::chrono::duration<double>(bytes * kFactor[current_] / kBytesPerSecond));
    ran_->push_back(current_);
    return in_process::Backend::Allreduce(in, out, count, dtype, op, scale, name);
  }

 private:
  int current_ = 0;
  static constexpr double kBytesPerSecond = 50e6;
  std::vector<int>* ran_;  // written by the engine thread only
};

// Autotune on, over ChoosingBackend: every step is one 2 MiB allreduce (above the tuner's 64 KiB).
// Every rank runs every call with the same algorithm, switching between the same two calls as the
// others; once rank 0 has timed 8 calls of each, every rank runs ring, and the sums are right
// throughout. With `file`, the choice is written there; a second job over the same file runs
// ring from its first call, timing nothing.
void RunJobThatTunesTheAlgorithm(const std::string& file, bool reads_saved_choice) {
  in_process::World world(kRanks);
  kd::EngineOptions options;
  options.fusion_threshold_bytes = int64_t{16} << 20;
  options.autotune = true;
  options.autotune_file = file;
  options.cache_capacity = 64;
  options.log_level = 3;
  constexpr int kSteps = 3 * kd::Tuner::kRounds + 4;
  constexpr int64_t kCount = int64_t{1} << 19;  // 2 MiB of floats
  std::vector<std::vector<int>> ran(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      {
        Rank me(&world, r, options, std::make_unique<ChoosingBackend>(&world, r, &ran[r]));
        int wrong_steps = 0;
        for (int step = 0; step < kSteps; ++step) {
          std::vector<std::vector<float>> tensors(1, std::vector<float>(kCount));
          for (int64_t i = 0; i < kCount; ++i) tensors[0][i] = static_cast<float>(Local(r, 0, i, step));
          const kd::Status s =
              me.GroupedAllreduce("chosen", &tensors, kd::DataType::kFloat32, kd::ReduceOp::kSum, kd::DataType::kFloat32);
          bool right = s.ok();
          for (int64_t i = 0; right && i < kCount; ++i) {
            double expected = 0;
            for (int q = 0; q < kRanks; ++q) expected += Local(q, 0, i, step);
            right = tensors[0][i] == static_cast<float>(expected);
          }
          wrong_steps += right ? 0 : 1;
        }
        Check(r, wrong_steps == 0, "algorithm tuning: " + std::to_string(wrong_steps) + " steps with wrong sums");
      }  // the engine has stopped: `ran[r]` is complete
    });
  }
  for (auto& t : threads) t.join();
  const std::string job = reads_saved_choice ? "the job reading the saved choice" : "the tuning job";
  for (int r = 1; r < kRanks; ++r) {
    Check(r, ran[r] == ran[0], job + ": rank " + std::to_string(r) + " ran other algorithms than rank 0, call by call");
  }
  const std::vector<int>& calls = ran[0];
  constexpr int kRing = 2;
  Check(0, static_cast<int>(calls.size()) == kSteps, job + ": " + std::to_string(calls.size()) + " calls");
  if (reads_saved_choice) {
    Check(0, std::count(calls.begin(), calls.end(), kRing) == kSteps, job + ": not every call ran as ring");
    return;
  }
  for (int algorithm = 0; algorithm < 3; ++algorithm) {
    Check(0, std::count(calls.begin(), calls.begin() + 3 * kd::Tuner::kRounds, algorithm) == kd::Tuner::kRounds,
          job + ": algorithm " + std::to_string(algorithm) + " was not timed over exactly 8 calls");
  }
  Check(0, std::all_of(calls.begin() + 3 * kd::Tuner::kRounds, calls.end(), [](int a) { return a == kRing; }),
        job + ": the calls after tuning did not all run as ring");
  std::ifstream saved(file);
  std::string text((std::istreambuf_iterator<char>(saved)), std::istreambuf_iterator<char>());
  Check(0, text.find("3 emulated hosts x 1 rank\tring\t16777216\n") != std::string::npos,
        "the saved choice: '" + text + "'");
}

}  // namespace

int main() {
  for (int64_t threshold : {int64_t{64} << 20, int64_t{4096}, int64_t{0}}) {
    RunJob(threshold);
    std::printf("fusion threshold %lld: done\n", static_cast<long long>(threshold));
    std::fflush(stdout);
  }
  RunJobWithRiders();
  std::printf("riders: done\n");
  RunJobWithARankThatNeverSubmits();
  for (bool large_calls_slow : {true, false}) RunJobThatTunesFusion(large_calls_slow);
  std::printf("fusion tuning: done\n");
  const std::string tuning_file = "kerasdist-tuning.tsv";  // in the test's own directory
  std::remove(tuning_file.c_str());
  RunJobThatTunesTheAlgorithm(tuning_file, false);
  RunJobThatTunesTheAlgorithm(tuning_file, true);
  std::printf("algorithm tuning: done\n");
  std::printf("%s, %d of %d checks failed\n", g_failures > 0 ? "FAILED" : "passed", g_failures.load(),
              g_checks.load());
  return g_failures > 0 ? 1 : 0;
}
