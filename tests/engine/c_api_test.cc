// The engine driven through its C API alone, with no TensorFlow in the process: grouped
// allreduces (fused or not, cached or not, from two threads at once), broadcast, allgather,
// join and mismatched calls, each checked against values this program computes itself. Run under mpiexec with the fusion
// threshold in bytes as its argument; prints one line per failed check and exits non-zero if
// any failed. tests/engine/test_c_api.py builds and runs it.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "c_api.h"

namespace {

int g_rank = 0;
int g_size = 1;
std::atomic<int> g_checks{0}, g_failures{0};  // threads check too

void Check(bool ok, const std::string& what) {
  ++g_checks;
  if (ok) return;
  std::printf("rank %d: FAILED: %s\n", g_rank, what.c_str());
  std::fflush(stdout);
  ++g_failures;
}

template <typename T>
constexpr int DtypeOf() {
  if constexpr (std::is_same_v<T, float>) return KERASDIST_FLOAT32;
  if constexpr (std::is_same_v<T, double>) return KERASDIST_FLOAT64;
  return KERASDIST_INT32;
}

const char* OpName(int op) {
  switch (op) {
    case KERASDIST_AVERAGE: return "Average";
    case KERASDIST_SUM: return "Sum";
    case KERASDIST_MIN: return "Min";
    default: return "Max";
  }
}

// Rank r holds (r + 1) * Slope(t, i) + Offset(t, i, call) at element i of tensor t: small
// integers of both signs, exact in every dtype tested, and different on every call.
int64_t Slope(int t, int64_t i) { return (i + t) % 5 - 2; }
int64_t Offset(int t, int64_t i, int call) { return 3 * t + i % 11 - 5 + call; }
int64_t Local(int rank, int t, int64_t i, int call) { return (rank + 1) * Slope(t, i) + Offset(t, i, call); }

// The reduction over ranks 0..n-1 in closed form: the sum of (r + 1) is n * (n + 1) / 2, and a
// linear function of r is extreme at the first or the last rank.
double Expected(int op, int t, int64_t i, int call, bool integer, int64_t n) {
  const int64_t a = Slope(t, i), b = Offset(t, i, call);
  const int64_t sum = a * n * (n + 1) / 2 + b * n;
  const int64_t at_first = a + b, at_last = n * a + b;
  switch (op) {
    case KERASDIST_SUM: return static_cast<double>(sum);
    case KERASDIST_AVERAGE:  // integers: truncated toward zero, as C (and the engine) divide
      return integer ? static_cast<double>(sum / n) : static_cast<double>(sum) / n;
    case KERASDIST_MIN: return static_cast<double>(std::min(at_first, at_last));
    default: return static_cast<double>(std::max(at_first, at_last));
  }
}

template <typename T>
bool Close(T got, double expected, double tolerance) {
  return std::fabs(static_cast<double>(got) - expected) <= tolerance * std::max(1.0, std::fabs(expected));
}

// Lengths of the tensors in one group: a scalar's worth, odd sizes that leave padding in the
// fusion buffer, and one past the engine's largest fused tensor (256 KiB), which runs alone.
const std::vector<int64_t> kLengths = {1, 7, 1000, 70001, 33};

struct GroupedCall {
  std::string name;
  int op = KERASDIST_SUM;
  int wire = -1;  // -1: the tensors' own dtype
  double prescale = 1.0, postscale = 1.0;
  bool in_place = false;
  int calls = 3;  // the same name again: later calls take the cached fast path
  int contributors = g_size;  // ranks 0..contributors-1 send data; the others have joined
};

template <typename T>
void CheckGroupedAllreduce(const GroupedCall& c) {
  const int dtype = DtypeOf<T>();
  const bool integer = std::is_integral_v<T>;
  const double tolerance = std::is_same_v<T, float> ? 1e-6 : 1e-12;
  for (int call = 0; call < c.calls; ++call) {
    std::vector<std::vector<T>> inputs, outputs;
    for (size_t t = 0; t < kLengths.size(); ++t) {
      inputs.emplace_back(kLengths[t]);
      for (int64_t i = 0; i < kLengths[t]; ++i) inputs[t][i] = static_cast<T>(Local(g_rank, t, i, call));
      outputs.emplace_back(kLengths[t], static_cast<T>(-999));
    }
    std::vector<const void*> in;
    std::vector<void*> out;
    for (size_t t = 0; t < kLengths.size(); ++t) {
      in.push_back(inputs[t].data());
      out.push_back(c.in_place ? inputs[t].data() : outputs[t].data());
    }
    char error[1024] = "";
    const int rc = kerasdist_grouped_allreduce(c.name.c_str(), static_cast<int>(kLengths.size()), in.data(), out.data(),
                                               kLengths.data(), dtype, c.wire < 0 ? dtype : c.wire, c.op, c.prescale,
                                               c.postscale, error, sizeof(error));
    const std::string what = c.name + " call " + std::to_string(call);
    Check(rc == 0, what + " returned " + std::to_string(rc) + ": " + error);
    if (rc != 0) continue;
    int wrong = 0;
    std::string first_wrong;
    for (size_t t = 0; t < kLengths.size(); ++t) {
      const T* result = static_cast<const T*>(out[t]);
      for (int64_t i = 0; i < kLengths[t]; ++i) {
        const double expected = Expected(c.op, t, i, call, integer, c.contributors) * c.prescale * c.postscale;
        if (Close(result[i], expected, tolerance)) continue;
        if (wrong++ == 0) {
          first_wrong = "tensor " + std::to_string(t) + "[" + std::to_string(i) + "] = " +
                        std::to_string(static_cast<double>(result[i])) + ", expected " + std::to_string(expected);
        }
      }
    }
    Check(wrong == 0,
          what + " (" + OpName(c.op) + "): " + std::to_string(wrong) + " wrong values, first " + first_wrong);
  }
}

void CheckAllreduces() {
  for (int op : {KERASDIST_SUM, KERASDIST_AVERAGE, KERASDIST_MIN, KERASDIST_MAX}) {
    const std::string suffix = std::string(".") + OpName(op);
    CheckGroupedAllreduce<float>({"float32" + suffix, op});
    CheckGroupedAllreduce<double>({"float64" + suffix, op});
    CheckGroupedAllreduce<int32_t>({"int32" + suffix, op});
  }
  CheckGroupedAllreduce<double>({"float64.in_place", KERASDIST_SUM, -1, 1.0, 1.0, true});
  CheckGroupedAllreduce<float>({"float32.scaled", KERASDIST_AVERAGE, -1, 0.5, 4.0});
  // The sums are integers below 256: exact in either 16-bit dtype.
  CheckGroupedAllreduce<float>({"float32.as_float16", KERASDIST_SUM, KERASDIST_FLOAT16});
  CheckGroupedAllreduce<double>({"float64.as_bfloat16", KERASDIST_SUM, KERASDIST_BFLOAT16});
}

// Two threads per rank with their own names, submitted in a different order on each rank: the
// engine pairs them by name, and runs whatever is ready together.
void CheckConcurrentAllreduces() {
  std::vector<std::thread> threads;
  for (int thread = 0; thread < 2; ++thread) {
    threads.emplace_back([thread] {
      if ((g_rank + thread) % 2) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      CheckGroupedAllreduce<float>({"concurrent." + std::to_string(thread), KERASDIST_SUM, -1, 1.0, 1.0, false, 5});
    });
  }
  for (auto& t : threads) t.join();
}

void CheckBroadcast() {
  const int root = 1;  // not rank 0, which coordinates the negotiation
  std::vector<double> values(1001);
  std::vector<int32_t> ints(17);
  for (size_t i = 0; i < values.size(); ++i) values[i] = g_rank * 1000.0 + i + 0.25;
  for (size_t i = 0; i < ints.size(); ++i) ints[i] = -g_rank * 100 - static_cast<int32_t>(i);
  char error[1024] = "";
  int rc = kerasdist_broadcast("broadcast.float64", values.data(), values.size(), KERASDIST_FLOAT64, root, error,
                               sizeof(error));
  Check(rc == 0, "broadcast.float64 returned " + std::to_string(rc) + ": " + error);
  bool all_root = true;
  for (size_t i = 0; i < values.size(); ++i) all_root &= values[i] == root * 1000.0 + i + 0.25;
  Check(rc != 0 || all_root, "broadcast.float64: values are not root " + std::to_string(root) + "'s");
  rc = kerasdist_broadcast("broadcast.int32", ints.data(), ints.size(), KERASDIST_INT32, root, error, sizeof(error));
  Check(rc == 0, "broadcast.int32 returned " + std::to_string(rc) + ": " + error);
  all_root = true;
  for (size_t i = 0; i < ints.size(); ++i) all_root &= ints[i] == -root * 100 - static_cast<int32_t>(i);
  Check(rc != 0 || all_root, "broadcast.int32: values are not root " + std::to_string(root) + "'s");
}

// Rank r sends RowsOf(r) rows of kRow values; value c of its row j is r * 1000 + j * 10 + c.
constexpr int64_t kRow = 3;

void CheckAllgather(const std::string& name, int64_t (*rows_of)(int), int64_t spare_rows) {
  const int64_t rows = rows_of(g_rank);
  std::vector<int32_t> input(rows * kRow);
  for (int64_t j = 0; j < rows; ++j) {
    for (int64_t c = 0; c < kRow; ++c) input[j * kRow + c] = static_cast<int32_t>(g_rank * 1000 + j * 10 + c);
  }
  int64_t total = 0;
  for (int r = 0; r < g_size; ++r) total += rows_of(r);
  std::vector<int32_t> output((total + spare_rows) * kRow, -1);
  int64_t gathered = -1;
  char error[1024] = "";
  const int rc = kerasdist_allgather(name.c_str(), input.data(), rows, kRow, KERASDIST_INT32, output.data(),
                                     total + spare_rows, &gathered, error, sizeof(error));
  Check(rc == 0, name + " returned " + std::to_string(rc) + ": " + error);
  Check(gathered == total, name + " gathered " + std::to_string(gathered) + " rows, expected " + std::to_string(total));
  bool right = true;
  int64_t at = 0;
  for (int r = 0; r < g_size; ++r) {
    for (int64_t j = 0; j < rows_of(r); ++j, ++at) {
      for (int64_t c = 0; c < kRow; ++c) right &= output[at * kRow + c] == r * 1000 + j * 10 + c;
    }
  }
  for (int64_t k = total * kRow; k < static_cast<int64_t>(output.size()); ++k) right &= output[k] == -1;
  Check(rc != 0 || right, name + ": gathered rows are not every rank's, in rank order");
}

void CheckAllgathers() {
  CheckAllgather("allgather.rows", [](int r) -> int64_t { return r + 1; }, 0);
  CheckAllgather("allgather.none_from_rank_0", [](int r) -> int64_t { return r; }, 2);
  // Only the last rank's output is one row short: it fails, the others are unaffected.
  int64_t total = g_size * (g_size + 1) / 2;
  std::vector<int32_t> input((g_rank + 1) * kRow, 7), output(total * kRow);
  const bool short_here = g_rank == g_size - 1;
  int64_t gathered = -1;
  char error[1024] = "";
  const int rc = kerasdist_allgather("allgather.short", input.data(), g_rank + 1, kRow, KERASDIST_INT32, output.data(),
                                     short_here ? total - 1 : total, &gathered, error, sizeof(error));
  if (short_here) {
    Check(rc == KERASDIST_INVALID_ARGUMENT && std::strstr(error, "gathered") != nullptr,
          "allgather.short into too small an output returned " + std::to_string(rc) + ": " + error);
  } else {
    Check(rc == 0, "allgather.short returned " + std::to_string(rc) + ": " + error);
  }
  Check(gathered == total, "allgather.short reported " + std::to_string(gathered) + " rows");
}

// A call every rank must fail, with `rc` and a message containing `expected_text`.
void CheckFails(const std::string& what, int rc, int expected_rc, const char* error, const char* expected_text) {
  Check(rc == expected_rc && std::strstr(error, expected_text) != nullptr,
        what + " returned " + std::to_string(rc) + " (expected " + std::to_string(expected_rc) + " naming '" +
            expected_text + "'): " + error);
}

void CheckMismatches() {
  // Rank 0 sends float64 where the others send float32.
  std::vector<double> doubles(8, 1.0), double_out(8);
  std::vector<float> floats(8, 1.0f), float_out(8);
  const int64_t eight = 8;
  const void* in = g_rank == 0 ? static_cast<const void*>(doubles.data()) : floats.data();
  void* out = g_rank == 0 ? static_cast<void*>(double_out.data()) : float_out.data();
  const int dtype = g_rank == 0 ? KERASDIST_FLOAT64 : KERASDIST_FLOAT32;
  char error[1024] = "";
  int rc = kerasdist_grouped_allreduce("mismatch.dtype", 1, &in, &out, &eight, dtype, dtype, KERASDIST_SUM, 1.0, 1.0,
                                       error, sizeof(error));
  CheckFails("mismatch.dtype", rc, KERASDIST_FAILED_PRECONDITION, error, "mismatched dtype for 'mismatch.dtype'");

  // A cached name whose last rank sends one element more: the cache entry must be dropped and
  // the call fail, not pair unequal buffers.
  std::vector<float> data(9, 2.0f), result(9);
  const void* data_in = data.data();
  void* result_out = result.data();
  for (int call = 0; call < 3; ++call) {
    const int64_t count = call == 2 && g_rank == g_size - 1 ? 9 : 8;
    rc = kerasdist_grouped_allreduce("mismatch.cached", 1, &data_in, &result_out, &count, KERASDIST_FLOAT32,
                                     KERASDIST_FLOAT32, KERASDIST_SUM, 1.0, 1.0, error, sizeof(error));
    if (call < 2) {
      Check(rc == 0 && result[0] == 2.0f * g_size, "mismatch.cached call " + std::to_string(call) + ": " + error);
    } else {
      CheckFails("mismatch.cached call 2", rc, KERASDIST_FAILED_PRECONDITION, error, "mismatched shape");
    }
  }

  // Rank 0 names a root that does not exist: refused there before negotiation, and every other
  // rank fails the same call with rank 0's reason.
  std::vector<int32_t> buffer(4, g_rank);
  rc = kerasdist_broadcast("mismatch.root", buffer.data(), 4, KERASDIST_INT32, g_rank == 0 ? g_size : 0, error,
                           sizeof(error));
  CheckFails("mismatch.root", rc, KERASDIST_INVALID_ARGUMENT, error, "root_rank");

  // The engine goes on after the failures.
  CheckGroupedAllreduce<float>({"after_mismatches", KERASDIST_SUM});
}

// The ranks but 0 join at once. Rank 0 first runs allreduces that they never submit: they take
// part with zeros, and Average divides by the one rank whose data went in. Rank 0 joins last.
void CheckJoin() {
  if (g_rank == 0) {
    CheckGroupedAllreduce<float>({"while_joined.Sum", KERASDIST_SUM, -1, 1.0, 1.0, false, 2, 1});
    CheckGroupedAllreduce<float>({"while_joined.Average", KERASDIST_AVERAGE, -1, 1.0, 1.0, false, 2, 1});
  }
  int last = -1;
  char error[1024] = "";
  const int rc = kerasdist_join(&last, error, sizeof(error));
  Check(rc == 0 && last == 0, "kerasdist_join returned " + std::to_string(rc) + " and last rank " +
                                  std::to_string(last) + ", expected rank 0: " + error);
}

int Start(const char* fusion_threshold_bytes) {
  const char* names[] = {"fusion_threshold_bytes", "fusion_tuning", "piggyback_bytes", "cycle_time_ms", "stall_warning_s",
                         "stall_timeout_s", "mismatch_timeout_s", "collective_timeout_s", "cache_capacity",
                         "timeline_path", "log_level", "allreduce_algorithm", "autotune", "autotune_file"};
  // A collective timeout well inside the test's own: a hang ends with the engine's message.
  const char* values[] = {fusion_threshold_bytes, "1", "4096", "1", "60", "0", "5", "60", "1024", "", "2", "auto", "1", ""};
  char error[1024] = "";
  const int rc = kerasdist_start(14, names, values, error, sizeof(error));
  Check(rc == 0, std::string("kerasdist_start: ") + error);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s FUSION_THRESHOLD_BYTES\n", argv[0]);
    return 2;
  }
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  // The launch tests' convention: a rank left over after a timeout is killed by this pid.
  std::printf("LAUNCH_PID rank=%d pid=%d\n", g_rank, static_cast<int>(getpid()));
  std::fflush(stdout);
  if (Start(argv[1]) == 0) {
    CheckAllreduces();
    CheckConcurrentAllreduces();
    if (g_size > 1) {
      CheckBroadcast();
      CheckMismatches();
      CheckJoin();
    }
    CheckAllgathers();
    Check(kerasdist_stalled() == 0, "kerasdist_stalled() says the engine stalled");
    kerasdist_shutdown();
  }
  MPI_Finalize();
  std::printf("rank %d: %s, %d of %d checks failed\n", g_rank, g_failures > 0 ? "FAILED" : "passed", g_failures.load(),
              g_checks.load());
  return g_failures > 0 ? 1 : 0;
}
