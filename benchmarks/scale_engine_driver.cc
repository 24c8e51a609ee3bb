// The engine through its C API alone (no TensorFlow), running a fixed training-like workload in
// phases that benchmarks/scale_mpi_counts.c counts separately (MPI_Pcontrol names the phase):
//   1 first step: every bucket is new, so it goes through rank 0 (the slow path);
//   2 steady steps: the same buckets again, from the response cache (the bit-vector fast path);
//   3 churning steps: new names every step, so every request goes through rank 0 again;
//   4 one step that rank 0 starts `pause_s` late (an evaluation, a checkpoint): the others wait
//     in the negotiation and the stall inspector asks its peers who is missing.
// A step is `buckets` grouped float32 Sum allreduces, submitted at once from a thread each (as
// DistributedOptimizer's buckets are), holding `tensors` tensors of `elements` values in all.
// Every result is checked against a value computed from (rank, size). Each rank writes
// $SCALE_COUNTS_DIR/driver<rank>.tsv: per phase, its steps, the engine's cycles and
// collectives, and the seconds it took. benchmarks/scale_counts.py builds and runs it.
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "c_api.h"

namespace {

int g_rank = 0, g_size = 1, g_checks = 0, g_failures = 0;

struct Workload {
  int steps, tensors, buckets;
  int64_t elements;
  double pause_s;
};

// Rank r holds (r + 1) + Offset at every element, so the Sum is size*(size+1)/2 + size*Offset:
// small integers, exact in float32 up to far more ranks than any run here.
int Offset(int tensor, int step, int64_t i) { return tensor % 7 + step % 5 + static_cast<int>(i % 3); }
float Expected(int tensor, int step, int64_t i) {
  return static_cast<float>(g_size * (g_size + 1) / 2 + g_size * Offset(tensor, step, i));
}

// One bucket's grouped allreduce; returns the number of wrong values (or -1 for a failed call).
int RunBucket(const Workload& w, const std::string& name, int bucket, int step) {
  std::vector<int> mine;
  for (int t = bucket; t < w.tensors; t += w.buckets) mine.push_back(t);
  const int64_t per_tensor = w.elements / w.tensors;
  std::vector<std::vector<float>> data(mine.size(), std::vector<float>(per_tensor));
  std::vector<const void*> in;
  std::vector<void*> out;
  std::vector<int64_t> counts(mine.size(), per_tensor);
  for (size_t k = 0; k < mine.size(); ++k) {
    for (int64_t i = 0; i < per_tensor; ++i) data[k][i] = static_cast<float>(g_rank + 1 + Offset(mine[k], step, i));
    in.push_back(data[k].data());
    out.push_back(data[k].data());
  }
  char error[1024] = "";
  const int rc = kerasdist_grouped_allreduce(name.c_str(), static_cast<int>(mine.size()), in.data(), out.data(),
                                             counts.data(), KERASDIST_FLOAT32, KERASDIST_FLOAT32, KERASDIST_SUM, 1.0,
                                             1.0, error, sizeof(error));
  if (rc != 0) {
    std::printf("rank %d: %s returned %d: %s\n", g_rank, name.c_str(), rc, error);
    return -1;
  }
  int wrong = 0;
  for (size_t k = 0; k < mine.size(); ++k) {
    for (int64_t i = 0; i < per_tensor; ++i) wrong += data[k][i] != Expected(mine[k], step, i);
  }
  if (wrong > 0) std::printf("rank %d: %s step %d: %d wrong values\n", g_rank, name.c_str(), step, wrong);
  return wrong;
}

void RunStep(const Workload& w, int step, bool new_names) {
  std::vector<std::thread> threads;
  std::vector<int> wrong(w.buckets, 0);
  for (int b = 0; b < w.buckets; ++b) {
    const std::string name = (new_names ? "step" + std::to_string(step) + "." : "") + "bucket" + std::to_string(b);
    threads.emplace_back([&, b, name] { wrong[b] = RunBucket(w, name, b, step); });
  }
  for (auto& t : threads) t.join();
  for (int b = 0; b < w.buckets; ++b) {
    ++g_checks;
    g_failures += wrong[b] != 0;
  }
}

double EngineCount(const char* which) {
  const char* names[32];
  double values[32];
  const int n = kerasdist_engine_times(names, values, 32);
  for (int i = 0; i < n && i < 32; ++i) {
    if (std::strcmp(names[i], which) == 0) return values[i];
  }
  return -1;
}

// Runs `body` as phase `phase`: counted by the shim from a barrier to the next, uncounted itself.
template <typename Body>
void Phase(FILE* out, int phase, int steps, Body body) {
  MPI_Barrier(MPI_COMM_WORLD);
  const double cycles = EngineCount("cycles"), collectives = EngineCount("collectives");
  const auto start = std::chrono::steady_clock::now();
  MPI_Pcontrol(phase);
  body();
  MPI_Pcontrol(0);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(out, "%d\t%d\t%.0f\t%.0f\t%.6f\n", phase, steps, EngineCount("cycles") - cycles,
               EngineCount("collectives") - collectives, seconds);
}

int Start(const char* fusion_threshold_bytes, const char* cache_capacity) {
  // Staleness timers off (stall warning, mismatch check): a cached request then takes the fast
  // path however long the oversubscribed ranks take, so the counts do not depend on the load.
  const char* names[] = {"fusion_threshold_bytes", "fusion_tuning", "piggyback_bytes", "cycle_time_ms", "stall_warning_s",
                         "stall_timeout_s", "mismatch_timeout_s", "collective_timeout_s", "cache_capacity",
                         "timeline_path", "log_level", "allreduce_algorithm", "autotune", "autotune_file"};
  // Autotune off: the tuner's timed choice of algorithm would make the data's messages depend on the
  // load. Piggybacking off: the counts are of negotiation and data apart, the path of any size.
  const char* values[] = {fusion_threshold_bytes, "0", "0", "0", "0", "0", "0", "300", cache_capacity, "", "2", "auto", "0", ""};
  char error[1024] = "";
  const int rc = kerasdist_start(14, names, values, error, sizeof(error));
  if (rc != 0) std::printf("rank %d: kerasdist_start: %s\n", g_rank, error);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 8) {
    std::fprintf(stderr, "usage: %s STEPS TENSORS BUCKETS ELEMENTS PAUSE_S FUSION_THRESHOLD_BYTES CACHE_CAPACITY\n",
                 argv[0]);
    return 2;
  }
  const Workload w{std::atoi(argv[1]), std::atoi(argv[2]), std::atoi(argv[3]), std::atoll(argv[4]),
                   std::atof(argv[5])};
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  // The launch tests' convention: a rank left over after a timeout is killed by this pid.
  std::printf("LAUNCH_PID rank=%d pid=%d\n", g_rank, static_cast<int>(getpid()));
  std::fflush(stdout);
  const char* dir = std::getenv("SCALE_COUNTS_DIR");
  const std::string path = std::string(dir ? dir : ".") + "/driver" + std::to_string(g_rank) + ".tsv";
  FILE* out = std::fopen(path.c_str(), "w");
  if (out == nullptr || Start(argv[6], argv[7]) != 0) {
    ++g_failures;
  } else {
    std::fprintf(out, "phase\tsteps\tcycles\tcollectives\tseconds\n");
    int step = 0;
    Phase(out, 1, 1, [&] { RunStep(w, step++, false); });
    Phase(out, 2, w.steps, [&] {
      for (int s = 0; s < w.steps; ++s) RunStep(w, step++, false);
    });
    Phase(out, 3, w.steps, [&] {
      for (int s = 0; s < w.steps; ++s) RunStep(w, step++, true);
    });
    if (w.pause_s > 0) {
      Phase(out, 4, 1, [&] {
        if (g_rank == 0) std::this_thread::sleep_for(std::chrono::duration<double>(w.pause_s));
        RunStep(w, step++, false);
      });
    }
    ++g_checks;
    if (kerasdist_stalled() != 0) {
      std::printf("rank %d: kerasdist_stalled() says the engine stalled\n", g_rank);
      ++g_failures;
    }
    kerasdist_shutdown();
  }
  if (out != nullptr) std::fclose(out);
  MPI_Finalize();
  std::printf("rank %d: %s, %d of %d checks failed\n", g_rank, g_failures > 0 ? "FAILED" : "passed", g_failures,
              g_checks);
  return g_failures > 0 ? 1 : 0;
}
