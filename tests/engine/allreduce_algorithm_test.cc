// AllreduceAlgorithm and MpiBackend without the engine: which algorithm MPI's allreduce variable
// holds while each of the backend's MPI_Allreduce calls runs. This program defines MPI_Allreduce
// itself (MPI's profiling interface): the backend's calls reach it, it reads the variable through a
// handle of its own and passes the call on to PMPI_Allreduce.
//
//   allreduce_algorithm_test --print-variable   prints "VARIABLE <value>": the variable's value as
//                                               MPI set it from the environment (run it with
//                                               MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring)
//   allreduce_algorithm_test RING_VALUE|none HOSTS
//                                               the checks, under mpiexec on one host; RING_VALUE is
//                                               what the first form printed, none for an MPI without
//                                               the variable (then nothing may change); HOSTS is how
//                                               many hosts MPICH emulates (MPIR_CVAR_NUM_CLIQUES; 1
//                                               without), 0 when they hold different numbers of ranks
//
// Prints one line per failed check and "rank R: passed, F of N checks failed"; tests/engine/
// test_allreduce_algorithm.py builds and runs it.
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "allreduce_algorithm.h"
#include "half.h"
#include "mpi_backend.h"

namespace kd = kerasdist;

namespace {

int g_rank = 0;
int g_size = 1;
int g_checks = 0, g_failures = 0;
MPI_T_cvar_handle g_variable = MPI_T_CVAR_HANDLE_NULL;  // this program's own handle; null without one
MPI_Comm g_watched = MPI_COMM_NULL;                     // the backend's communicator
std::vector<int> g_seen;                                // the variable's value in each of its allreduces
// The hierarchy's calls, on communicators other than the backend's: the variable's value in each
// MPI_Allreduce, and how many MPI_Reduce_scatter_block, MPI_Allgather, MPI_Reduce and MPI_Bcast
// calls ran.
std::vector<int> g_seen_across;
int g_reduce_scatters = 0, g_allgathers = 0, g_tail_reduces = 0, g_tail_broadcasts = 0;

void Check(bool ok, const std::string& what) {
  ++g_checks;
  if (ok) return;
  std::printf("rank %d: FAILED: %s\n", g_rank, what.c_str());
  std::fflush(stdout);
  ++g_failures;
}

int ReadVariable() {
  int value = -1;
  if (g_variable != MPI_T_CVAR_HANDLE_NULL) MPI_T_cvar_read(g_variable, &value);
  return value;
}

// A handle on the variable, found by its name alone.
void OpenVariable() {
  int provided = 0, index = -1, count = 0;
  MPI_T_init_thread(MPI_THREAD_MULTIPLE, &provided);
  if (MPI_T_cvar_get_index("MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM", &index) != MPI_SUCCESS) return;
  if (MPI_T_cvar_handle_alloc(index, nullptr, &g_variable, &count) != MPI_SUCCESS) g_variable = MPI_T_CVAR_HANDLE_NULL;
}

void ClearSeen() {
  g_seen.clear();
  g_seen_across.clear();
  g_reduce_scatters = g_allgathers = g_tail_reduces = g_tail_broadcasts = 0;
}

std::string Seen() {
  std::string text;
  for (int value : g_seen) text += (text.empty() ? "" : ", ") + std::to_string(value);
  return "[" + text + "]";
}

// A Sum of `count` float32 values through `backend` in pieces of `piece_bytes`: checks the result
// (rank r sends i + r at index i) and that each of its MPI_Allreduce calls ran with the variable
// at `expected` and that the variable holds what it held before afterwards.
void CheckSum(kd::MpiBackend& backend, const std::string& what, int count, int calls, int expected) {
  std::vector<float> values(count);
  for (int i = 0; i < count; ++i) values[i] = static_cast<float>(i + g_rank);
  const int before = ReadVariable();
  ClearSeen();
  const kd::Status status =
      backend.Allreduce(values.data(), values.data(), count, kd::DataType::kFloat32, kd::ReduceOp::kSum, 1.0, what);
  Check(status.ok(), what + ": " + status.message);
  bool right = true;
  for (int i = 0; i < count; ++i) right &= values[i] == static_cast<float>(g_size * i + g_size * (g_size - 1) / 2);
  Check(right, what + ": wrong sum");
  Check(g_seen == std::vector<int>(calls, expected),
        what + ": the variable held " + Seen() + " in its MPI_Allreduce calls, expected " + std::to_string(calls) +
            " x " + std::to_string(expected));
  Check(ReadVariable() == before, what + ": the variable holds " + std::to_string(ReadVariable()) + " afterwards, " +
                                      std::to_string(before) + " before");
}

kd::AllreduceAlgorithm Made(kd::AllreduceChoice choice) {
  kd::AllreduceAlgorithm algorithm;
  const kd::Status status = kd::AllreduceAlgorithm::Make(g_watched, choice, &algorithm);
  Check(status.ok(), "AllreduceAlgorithm::Make: " + status.message);
  return algorithm;
}

// A Sum of `count` float32 values through `backend` as the hierarchy, in pieces of `piece_values`
// (0: one piece): the result right (rank r sends i + r at index i, sums exact in float32), and
// per piece one reduce-scatter and one allgather within the host, one allreduce across the hosts
// with the variable at `expected_across` and none over all ranks; when a piece does not split
// evenly among a host's `local` ranks, also one reduce and one broadcast within the host.
void CheckHierarchySum(kd::MpiBackend& backend, const std::string& what, int count, int piece_values, int local,
                       int expected_across) {
  std::vector<float> values(count);
  for (int i = 0; i < count; ++i) values[i] = static_cast<float>(i + g_rank);
  ClearSeen();
  const kd::Status status =
      backend.Allreduce(values.data(), values.data(), count, kd::DataType::kFloat32, kd::ReduceOp::kSum, 1.0, what);
  Check(status.ok(), what + ": " + status.message);
  bool right = true;
  for (int i = 0; i < count; ++i) right &= values[i] == static_cast<float>(g_size * i + g_size * (g_size - 1) / 2);
  Check(right, what + ": wrong sum");
  int pieces = 0, uneven = 0;
  for (int begin = 0; begin < count; begin += piece_values > 0 ? piece_values : count) {
    ++pieces;
    uneven += (std::min(count - begin, piece_values > 0 ? piece_values : count) % local) != 0;
  }
  Check(g_seen.empty(), what + ": MPI_Allreduce ran over all ranks: " + Seen());
  Check(g_tail_reduces == uneven && g_tail_broadcasts == uneven,
        what + ": " + std::to_string(g_tail_reduces) + " reduces and " + std::to_string(g_tail_broadcasts) +
            " broadcasts within the host, expected " + std::to_string(uneven) + " each");
  Check(g_reduce_scatters == pieces && g_allgathers == pieces,
        what + ": " + std::to_string(g_reduce_scatters) + " reduce-scatters and " + std::to_string(g_allgathers) +
            " allgathers, expected " + std::to_string(pieces) + " each");
  std::string across;
  for (int value : g_seen_across) across += (across.empty() ? "" : ", ") + std::to_string(value);
  Check(g_seen_across == std::vector<int>(pieces, expected_across),
        what + ": the variable held [" + across + "] in the allreduces across hosts, expected " +
            std::to_string(pieces) + " x " + std::to_string(expected_across));
}

// MPICH's cliques (MPIR_CVAR_NUM_CLIQUES) make `hosts` emulated hosts of one host's ranks.
void RunHierarchyChecks(int hosts, bool mpich, int ring, int held) {
  const kd::AllreduceAlgorithm hierarchical = Made(kd::AllreduceChoice::kHierarchical);
  const bool equal_hosts = hosts >= 2 && g_size % hosts == 0 && g_size / hosts >= 2;
  Check(hierarchical.hierarchy_available() == equal_hosts,
        std::string("hierarchy_available() is ") + (hierarchical.hierarchy_available() ? "true" : "false") + " at " +
            std::to_string(g_size) + " ranks on " + std::to_string(hosts) + " hosts");
  if (!equal_hosts) {
    // One host, or hosts of different sizes: the flat path, as auto runs it (MPI's own below 3 hosts).
    kd::MpiBackend flat(g_watched, 0, hierarchical);
    CheckSum(flat, "hierarchical without the layout for it", 1000, 1, held);
    Check(g_reduce_scatters == 0 && g_seen_across.empty(), "hierarchical without the layout ran the hierarchy");
    return;
  }
  Check(hierarchical.hosts() == hosts && hierarchical.ranks_per_host() == g_size / hosts,
        "the layout is " + std::to_string(hierarchical.hosts()) + " hosts x " +
            std::to_string(hierarchical.ranks_per_host()) + " ranks, expected " + std::to_string(hosts) + " x " +
            std::to_string(g_size / hosts));
  // Ring across from 64 KiB slices on 3 hosts or more; the slices of 1 MiB over 2 or 3 local ranks are past it.
  const int across_large = mpich && hosts >= 3 ? ring : held;
  const int local = g_size / hosts;
  kd::MpiBackend whole(g_watched, 0, hierarchical);
  CheckHierarchySum(whole, "hierarchical, one piece", 1 << 18, 0, local, across_large);
  // 3,076 bytes in pieces of 1,024 (256 values): the last piece of 1 value, less than one per local rank.
  kd::MpiBackend pieces(g_watched, 1024, hierarchical);
  CheckHierarchySum(pieces, "hierarchical, in pieces", 769, 256, local, held);

  // auto: the hierarchy from kHierarchyFromBytes (4 MiB: 1 << 20 float32 values).
  const kd::AllreduceAlgorithm automatic = Made(kd::AllreduceChoice::kAuto);
  kd::MpiBackend auto_backend(g_watched, 0, automatic);
  CheckHierarchySum(auto_backend, "auto, large", 1 << 20, 0, local, across_large);
  // Below it, what auto ran before: MPICH's ring from 64 KiB on 3 hosts (6 ranks, not a power of two).
  const int small = static_cast<int>(kd::AllreduceAlgorithm::kHierarchyFromBytes / 4) - 1;
  CheckSum(auto_backend, "auto, below the hierarchy", small, 1, mpich && hosts >= 3 ? ring : held);
  Check(g_reduce_scatters == 0, "auto ran the hierarchy below kHierarchyFromBytes");

  // What the tuner may choose between under auto, and what each choice runs: calls from 64 KiB
  // (Tuner::kTimedFromBytes) as chosen, smaller ones as auto runs them.
  std::vector<kd::AllreduceChoice> expected = {kd::AllreduceChoice::kAuto, kd::AllreduceChoice::kMpi};
  if (mpich && hosts >= 3) expected.push_back(kd::AllreduceChoice::kRing);
  expected.push_back(kd::AllreduceChoice::kHierarchical);
  Check(auto_backend.AllreduceChoices() == expected, "the tuner's choices under auto on these hosts");
  const int timed = static_cast<int>(kd::Tuner::kTimedFromBytes / 4);  // float32 values
  auto_backend.UseAllreduceChoice(kd::AllreduceChoice::kMpi);
  CheckSum(auto_backend, "tuned to mpi, large", 1 << 20, 1, held);
  Check(g_reduce_scatters == 0, "tuned to mpi ran the hierarchy");
  auto_backend.UseAllreduceChoice(kd::AllreduceChoice::kHierarchical);
  CheckHierarchySum(auto_backend, "tuned to the hierarchy, from 64 KiB", timed, 0, local, held);
  CheckSum(auto_backend, "tuned to the hierarchy, below 64 KiB", timed - 1, 1, held);
  Check(g_reduce_scatters == 0, "tuned to the hierarchy ran it below 64 KiB");
  if (mpich && hosts >= 3) {
    auto_backend.UseAllreduceChoice(kd::AllreduceChoice::kRing);
    CheckSum(auto_backend, "tuned to ring, large", 1 << 20, 1, ring);
    Check(g_reduce_scatters == 0, "tuned to ring ran the hierarchy");
  }
  auto_backend.UseAllreduceChoice(kd::AllreduceChoice::kAuto);
  CheckHierarchySum(auto_backend, "tuned back to auto, large", 1 << 20, 0, local, across_large);

  // mpi and ring never run the hierarchy, and make no communicators for it.
  Check(!Made(kd::AllreduceChoice::kMpi).hierarchy_available() && !Made(kd::AllreduceChoice::kRing).hierarchy_available(),
        "mpi or ring made the hierarchy's communicators");
}

void RunChecks(const char* ring_argument, int hosts) {
  const bool mpich = std::string(ring_argument) != "none";
  const int ring = mpich ? std::atoi(ring_argument) : -1;
  const int held = ReadVariable();
  RunHierarchyChecks(hosts, mpich, ring, held);
  if (hosts != 1) return;  // the checks below are of one host

  kd::AllreduceAlgorithm ring_choice = Made(kd::AllreduceChoice::kRing);
  Check(ring_choice.ring_available() == mpich, std::string("ring_available() is ") +
                                                   (ring_choice.ring_available() ? "true" : "false") +
                                                   (mpich ? " under MPICH" : " without the variable"));
  Check(ring_choice.hosts() == 1, "the job's ranks are on one host, not " + std::to_string(ring_choice.hosts()));
  kd::MpiBackend ring_backend(g_watched, 0, ring_choice);
  CheckSum(ring_backend, "ring, one piece", 1000, 1, mpich ? ring : held);
  kd::MpiBackend ring_pieces(g_watched, 1024, ring_choice);  // 4,000 bytes: 4 pieces
  CheckSum(ring_pieces, "ring, in pieces", 1000, 4, mpich ? ring : held);

  // Below 3 hosts auto leaves every size to MPI, and mpi leaves everything to it.
  kd::MpiBackend auto_backend(g_watched, 0, Made(kd::AllreduceChoice::kAuto));
  CheckSum(auto_backend, "auto on one host", 1 << 20, 1, held);
  kd::MpiBackend mpi_backend(g_watched, 0, Made(kd::AllreduceChoice::kMpi));
  CheckSum(mpi_backend, "mpi", 1 << 20, 1, held);
  // On one host auto runs MPI's own choice at every size: nothing for the tuner to time.
  Check(auto_backend.AllreduceChoices().empty() && ring_backend.AllreduceChoices().empty(),
        "the tuner was given allreduce choices on one host");

  // 16-bit floats take Alltoall and Allgather, not MPI_Allreduce, whatever the choice.
  std::vector<uint16_t> halves(1000, kd::FloatToHalf(1.0f));
  ClearSeen();
  const kd::Status half_status = ring_backend.Allreduce(halves.data(), halves.data(), 1000, kd::DataType::kFloat16,
                                                        kd::ReduceOp::kSum, 1.0, "float16");
  Check(half_status.ok() && kd::HalfToFloat(halves[999]) == static_cast<float>(g_size), "float16 sum");
  Check(g_seen.empty(), "float16 ran MPI_Allreduce calls: " + Seen());

  // Ranks given different choices are told so, every one of them, instead of hanging later.
  kd::AllreduceAlgorithm mixed;
  const kd::Status refused = kd::AllreduceAlgorithm::Make(
      g_watched, g_rank == 0 ? kd::AllreduceChoice::kRing : kd::AllreduceChoice::kMpi, &mixed);
  const bool named = refused.message.find("KERASDIST_ALLREDUCE_ALGORITHM differs between ranks") != std::string::npos;
  Check(g_size == 1 ? refused.ok() : refused.code == kd::StatusCode::kInvalidArgument && named,
        "different choices on different ranks: '" + refused.message + "'");
}

}  // namespace

// MPI's profiling interface: the backend's MPI_Allreduce calls land here.
// Whether `comm` is the backend's communicator (else the hierarchy's, or the program's own).
bool Watched(MPI_Comm comm) {
  int same = MPI_UNEQUAL;
  if (g_watched != MPI_COMM_NULL && comm != MPI_COMM_NULL) PMPI_Comm_compare(comm, g_watched, &same);
  return same == MPI_IDENT;
}

// MPI's profiling interface: the backend's MPI calls land here. Make's own calls (before the
// backend runs) are cleared with the rest by ClearSeen.
extern "C" int MPI_Allreduce(const void* in, void* out, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm) {
  if (g_watched != MPI_COMM_NULL) (Watched(comm) ? g_seen : g_seen_across).push_back(ReadVariable());
  return PMPI_Allreduce(in, out, count, type, op, comm);
}
extern "C" int MPI_Reduce_scatter_block(const void* in, void* out, int count, MPI_Datatype type, MPI_Op op,
                                        MPI_Comm comm) {
  if (!Watched(comm)) ++g_reduce_scatters;
  return PMPI_Reduce_scatter_block(in, out, count, type, op, comm);
}
extern "C" int MPI_Allgather(const void* in, int count, MPI_Datatype type, void* out, int out_count,
                             MPI_Datatype out_type, MPI_Comm comm) {
  if (!Watched(comm)) ++g_allgathers;
  return PMPI_Allgather(in, count, type, out, out_count, out_type, comm);
}
extern "C" int MPI_Reduce(const void* in, void* out, int count, MPI_Datatype type, MPI_Op op, int root, MPI_Comm comm) {
  if (!Watched(comm)) ++g_tail_reduces;
  return PMPI_Reduce(in, out, count, type, op, root, comm);
}
extern "C" int MPI_Bcast(void* data, int count, MPI_Datatype type, int root, MPI_Comm comm) {
  if (!Watched(comm)) ++g_tail_broadcasts;
  return PMPI_Bcast(data, count, type, root, comm);
}

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3) {
    std::fprintf(stderr, "usage: %s --print-variable | (RING_VALUE | none) HOSTS\n", argv[0]);
    return 2;
  }
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  OpenVariable();
  if (std::string(argv[1]) == "--print-variable") {
    std::printf("VARIABLE %d\n", ReadVariable());
  } else {
    MPI_Comm_dup(MPI_COMM_WORLD, &g_watched);
    if (argc != 3) {
      std::fprintf(stderr, "usage: %s (RING_VALUE | none) HOSTS\n", argv[0]);
      return 2;
    }
    RunChecks(argv[1], std::atoi(argv[2]));
    std::printf("rank %d: passed, %d of %d checks failed\n", g_rank, g_failures, g_checks);
  }
  MPI_Finalize();
  return g_failures == 0 ? 0 : 1;
}
