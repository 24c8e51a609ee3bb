// The backend for host memory: MPI on the engine's communicator, with the reductions MPI
// cannot do well itself (16-bit floats, Min/Max of floats that agree on NaN), and MPI's own
// allreduce algorithm chosen per call where MPI lets a program choose (allreduce_algorithm.h).
#pragma once

#include <mpi.h>

#include <atomic>
#include <vector>

#include "allreduce_algorithm.h"
#include "backend.h"

namespace kerasdist {

class MpiBackend : public Backend {
 public:
  // `comm` stays the caller's. Allreduces longer than `piece_bytes` run in pieces that long
  // (0: only as MPI's int counts require); `algorithm` says which pieces run as MPICH's ring or
  // as the hierarchy.
  MpiBackend(MPI_Comm comm, int64_t piece_bytes, AllreduceAlgorithm algorithm = AllreduceAlgorithm());

  // 16-bit floats are combined in float32 by this backend, which scales as it rounds.
  bool ScalesWhileCombining(DataType dtype) const override { return IsHalf(dtype); }
  Status Allreduce(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op, double scale,
                   const std::string& name) override;
  Status Allgather(const void* in, void* out, const std::vector<int64_t>& counts, DataType dtype,
                   const std::string& name) override;
  Status Broadcast(void* data, int64_t count, DataType dtype, int root, const std::string& name) override;
  Status ReduceScatter(const void* in, void* out, const std::vector<int64_t>& counts, DataType dtype, ReduceOp op,
                       double scale, const std::string& name) override;
  Status Alltoall(const void* in, const std::vector<int64_t>& send_counts, void* out,
                  const std::vector<int64_t>& recv_counts, DataType dtype, const std::string& name) override;

  std::vector<AllreduceChoice> AllreduceChoices() const override { return algorithm_.Alternatives(); }
  void UseAllreduceChoice(AllreduceChoice choice) override { algorithm_.set_choice(choice); }
  std::string Layout() const override { return algorithm_.Layout(); }
  int64_t HierarchicalCalls() const override { return hierarchical_calls_.load(std::memory_order_relaxed); }

  static bool IsHalf(DataType dtype) { return dtype == DataType::kFloat16 || dtype == DataType::kBFloat16; }

 private:
  // Allreduce of `count` 16-bit floats in place, the result multiplied by `scale`: an alltoall
  // gives each rank one chunk of every rank's buffer, the rank combines them in float32
  // (vectorised) and an allgather returns the combined chunks. The bytes on the wire are those
  // of MPI's own large-message allreduce (reduce-scatter, then allgather), and it runs at
  // memory speed, where MPI's user-defined reductions took 7x the time of a float32 sum.
  int AllreduceHalves(void* data, int count, DataType dtype, ReduceOp op, double scale);
  // Every rank's chunk `rank` of `in` (counts[j] values go to rank j) lands in scratch, then is
  // combined into `out`: the reduce-scatter half of AllreduceHalves.
  int CombineChunks(const void* in, void* out, const std::vector<int>& counts, DataType dtype, ReduceOp op,
                    double scale);

  // Allreduce of `count` values from `in` into `out` (which may be `in`) as the hierarchy:
  // MPI_Reduce_scatter_block within the host gives local rank l slice l of the host's sum, an
  // MPI_Allreduce of the slices across the hosts among the ranks of local rank l gives every
  // such rank the same bits of slice l, and MPI_Allgather within the host hands them round. The
  // slices are equal: MPICH's v-variants (counts per rank) took 5-12x as long here (6 ranks on
  // 2 emulated hosts, 1-16 MiB). The last count % R values are reduced to local rank 0 (shared
  // memory), cross the hosts with its slice and are broadcast within the host, rather than
  // costing a small allreduce of their own across hosts.
  int AllreduceAcrossHosts(const void* in, void* out, int count, DataType dtype, ReduceOp op);
  // Allgather of counts[r] values from every rank r into `out` in rank order, as the hierarchy:
  // each host's block (its ranks' values in host-rank order) is cut into R slices, local rank l
  // allgathers slice l of every host's block across the hosts with the other ranks of local
  // rank l, and an allgather within the host hands every rank all R x H slices, which are then
  // copied to where each rank's values belong in `out`. A host's block thus crosses each link
  // once, 1/R of it from each of its ranks. When a host's ranks send equal counts, slice l is
  // local rank l's own values; otherwise an allgather within the host first gives every rank
  // the host's block to cut its slice from.
  int AllgatherAcrossHosts(const void* in, void* out, const std::vector<int>& counts, DataType dtype);

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  int64_t piece_bytes_;
  AllreduceAlgorithm algorithm_;
  std::vector<uint16_t> scratch_;  // what CombineChunks receives before combining
  std::vector<char> slice_;        // this rank's slice in AllreduceAcrossHosts
  std::vector<char> host_block_;   // AllgatherAcrossHosts: this host's values, when counts differ in it
  std::vector<char> across_;       // AllgatherAcrossHosts: slice l of every host's block
  std::vector<char> gathered_;     // AllgatherAcrossHosts: every slice, before reordering into `out`
  std::atomic<int64_t> hierarchical_calls_{0};  // read by kerasdist.engine_times() from other threads
};

// OK, or an Internal error naming the call and the collective with MPI's own text.
Status MpiStatus(int code, const char* what, const std::string& name);

}  // namespace kerasdist
