// The engine over a transport other than MPI: three ranks as threads of one process, each with
// its own Engine started over in_process_transport.h, run the engine's negotiation (fast and slow
// path, rank 0's validation), fusion and the stall inspector's questions exactly as an MPI job
// does. Checked against values this program computes itself: grouped allreduces (fused, in small
// buffers and unfused; first calls and cached ones), 16-bit compression, broadcast, allgather of
// unequal rows, a mismatched shape failing on every rank, and a rank that never submits named
// by the others' stall timeout. No MPI call is made. tests/engine/test_in_process.py builds and
// runs it; prints one line per failed check and exits non-zero if any failed.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "engine.h"
#include "in_process_transport.h"

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

// One rank: its engine, and calls that wait for their result as the C API's do.
class Rank {
 public:
  Rank(in_process::World* world, int rank, const kd::EngineOptions& options) : rank_(rank) {
    engine_.SetFusionBufferFactory([](size_t bytes) { return std::make_unique<HeapBuffer>(bytes); });
    const kd::Status started = engine_.Start(options, [world, rank](const kd::EngineOptions&, kd::Transport* t) {
      *t = world->TransportFor(rank);
      return kd::Status::OK();
    });
    Check(rank, started.ok(), "Start: " + started.message);
  }
  ~Rank() { engine_.Shutdown(); }

  int rank() const { return rank_; }

  // Allreduces `tensors` (float32 or float64 `dtype`, travelling as `wire`) as one group, in place.
  template <typename T>
  kd::Status GroupedAllreduce(const std::string& name, std::vector<std::vector<T>>* tensors, kd::DataType dtype,
                              kd::ReduceOp op, kd::DataType wire) {
    kd::Request request;
    request.name = name;
    request.kind = kd::OpKind::kAllreduce;
    request.reduce_op = op;
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
    kd::AliasFn alias = [tensors](int index, kd::FusionBuffer* buffer, size_t offset, const kd::Shape& shape) {
      std::memcpy((*tensors)[index].data(), buffer->data() + offset, kd::NumElements(shape) * sizeof(T));
      return kd::Status::OK();
    };
    return Run(std::move(request), std::move(inputs), {}, std::move(allocate), std::move(alias));
  }

  kd::Status Broadcast(const std::string& name, std::vector<int64_t>* data, int root) {
    kd::Request request;
    request.name = name;
    request.kind = kd::OpKind::kBroadcast;
    request.root_rank = root;
    request.tensors.push_back({kd::DataType::kInt64, {static_cast<int64_t>(data->size())}, kd::DataType::kInt64});
    return Run(std::move(request), {data->data()}, {data->data()}, nullptr, nullptr);
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
    return Run(std::move(request), {rows_of_two.data()}, {}, std::move(allocate), nullptr);
  }

 private:
  kd::Status Run(kd::Request request, std::vector<const void*> inputs, std::vector<void*> outputs,
                 kd::AllocateFn allocate, kd::AliasFn alias) {
    request.blocking = true;
    std::promise<kd::Status> finished;
    std::future<kd::Status> result = finished.get_future();
    kd::Status status = engine_.Enqueue(std::move(request), std::move(inputs), std::move(outputs), std::move(allocate),
                                        std::move(alias), [&finished](const kd::Status& s) { finished.set_value(s); });
    return status.ok() ? result.get() : status;
  }

  const int rank_;
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
      const std::string name = std::string(label) + "/" + kd::ReduceOpName(op);
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
  kd::Status s = me.Broadcast("broadcast from 1", &data, 1);
  bool right = s.ok();
  for (int i = 0; i < 100; ++i) right = right && data[i] == 1000 + i;
  Check(me.rank(), right, "broadcast from rank 1: " + s.message);

  // Rank r sends r + 1 rows of two values: (r, row).
  std::vector<double> mine;
  for (int row = 0; row <= me.rank(); ++row) mine.insert(mine.end(), {double(me.rank()), double(row)});
  std::vector<double> gathered;
  s = me.Allgather("allgather of unequal rows", mine, &gathered);
  std::vector<double> expected;
  for (int r = 0; r < kRanks; ++r) {
    for (int row = 0; row <= r; ++row) expected.insert(expected.end(), {double(r), double(row)});
  }
  Check(me.rank(), s.ok() && gathered == expected, "allgather of unequal rows: " + s.message);
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
      CheckAllreduces<float>(me, kd::DataType::kFloat32, kd::DataType::kFloat32, "float32");
      CheckAllreduces<double>(me, kd::DataType::kFloat64, kd::DataType::kFloat64, "float64");
      CheckAllreduces<float>(me, kd::DataType::kFloat32, kd::DataType::kBFloat16, "float32 as bfloat16");
      CheckBroadcastAndAllgather(me);
      CheckAMismatchFailsOnEveryRank(me);
    });  // ~Rank shuts its engine down, with the others
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

}  // namespace

int main() {
  for (int64_t threshold : {int64_t{64} << 20, int64_t{4096}, int64_t{0}}) {
    RunJob(threshold);
    std::printf("fusion threshold %lld: done\n", static_cast<long long>(threshold));
    std::fflush(stdout);
  }
  RunJobWithARankThatNeverSubmits();
  std::printf("%s, %d of %d checks failed\n", g_failures > 0 ? "FAILED" : "passed", g_failures.load(),
              g_checks.load());
  return g_failures > 0 ? 1 : 0;
}
