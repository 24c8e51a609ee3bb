// Which of MPI's own algorithms the engine's MPI_Allreduce calls run. MPICH picks by message size
// and rank count, not by where the ranks are: at 3 and 4 ranks on hosts joined by 1 Gbit/s TCP, a
// 12 MiB Sum took 375-407 ms its way against 145-171 ms as its ring (the link allows 134 ms),
// since recursive halving first folds a rank count that is not a power of two with whole-buffer
// exchanges. MPICH lets a program change its choice between calls through the MPI tool
// interface: the control variable MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM. This class finds it and
// its `ring` value at start, decides per call whether ring should run, and sets the variable to
// ring around those calls only. An MPI without that variable or value (Open MPI) keeps its own
// choice everywhere.
//
// With several hosts of several ranks each, an allreduce can also run as a hierarchy: a
// reduce-scatter within each host (shared memory), an allreduce of each rank's slice across the
// hosts among the ranks of equal local rank, and an allgather within each host. Only 1/R of the
// buffer then crosses hosts per rank, where MPI's own choice over all ranks moves whole buffers
// between hosts when the rank count is not a power of two. Allgathers follow the same choice
// (MpiBackend::AllgatherAcrossHosts): each host's block crosses each link once, 1/R of it from
// each of its ranks.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"
#include "tuner.h"

namespace kerasdist {

class AllreduceAlgorithm {
 public:
  // Under kAuto, calls run as ring when the job spans at least kRingFromHosts hosts and they are
  // at least kRingFromBytes long, or kRingFromBytesPowerOfTwo when the ranks are a power of two
  // (docs/network.md, "Past two hosts"). MPICH folds a rank count that is not a power of two with
  // whole-buffer exchanges, so there its large-message choice puts twice a ring's bytes on one
  // link (3 hosts: ring 1.4-2.8x as fast from 64 KiB to 16 MiB). At 4 hosts its choice moves a
  // ring's bytes in fewer steps: ring took 1.5x as long from 1 to 4 MiB, and won only at 12 MiB.
  static constexpr int64_t kRingFromBytes = int64_t{64} << 10;
  static constexpr int64_t kRingFromBytesPowerOfTwo = int64_t{12} << 20;
  static constexpr int kRingFromHosts = 3;
  // Under kAuto, calls of at least kHierarchyFromBytes run as the hierarchy wherever it is
  // available (docs/network.md, "Several ranks per host"). On emulated hosts at 1 Gbit/s (four
  // runs, load 1-31 on 2 cores), from 4 MiB it was ahead of the faster flat choice or within 8 %
  // in every job but one (2x3: 1.0-1.7x MPI's choice; 3x2: 1.4-2.8x MPI's choice, 0.9-3.1x raw
  // MPICH's ring, which auto ran there before); the one, at load 9-31, took 2x MPI's time at 4
  // and 16 MiB and half of it at 12 MiB. At 1 MiB and below the load set the times: the hierarchy
  // was 3x ahead of the ring in one run at 3x2 and half as fast in another, so auto keeps what it
  // ran before there.
  static constexpr int64_t kHierarchyFromBytes = int64_t{4} << 20;
  // Under kAuto, allgathers of at least kAllgatherHierarchyFromBytes (all ranks' values together)
  // run as the hierarchy wherever it is available. On emulated hosts at 1 Gbit/s (two runs, load
  // 2-7 on 2 cores, equal counts, each host's ranks consecutive), against MPI's allgather through
  // kerasdist: at 2x3 1.2-1.5x as fast from 4 MiB to 16 MiB, at 3x2 0.96-1.08x; at 1 MiB 0.8-1.2x.
  // Below 4 MiB the saving is a few ms at best and the load decides it.
  static constexpr int64_t kAllgatherHierarchyFromBytes = int64_t{4} << 20;

  // MPI's own choice everywhere: what a backend without a communicator of its own uses.
  AllreduceAlgorithm() = default;

  // Collective over `comm` (every rank calls it, with its own `choice`): finds the variable,
  // counts the hosts (MPI_Comm_split_type, shared memory) and checks that every rank was given
  // the same choice and found the same variable, so that every rank decides alike. Under kAuto
  // and kHierarchical, when every one of 2 or more hosts holds the same number (2 or more) of
  // ranks, it also makes the communicators of the hierarchy (never freed: MPI_Finalize takes them).
  static Status Make(MPI_Comm comm, AllreduceChoice choice, AllreduceAlgorithm* algorithm);

  // Under kAuto, the choices the engine's Tuner may time against kAuto (its own first): MPI's
  // own, MPICH's ring where kAuto could run it and runs something else from 64 KiB, the hierarchy
  // where it is available. Empty when
  // the configured choice is not kAuto or there is nothing else to run. A tuned choice applies to
  // calls of at least Tuner::kTimedFromBytes, the ones the tuner times; smaller calls, whose time
  // is their latency, run as kAuto does.
  std::vector<AllreduceChoice> Alternatives() const;
  // Calls from Tuner::kTimedFromBytes on run as `choice`, one of Alternatives().
  void set_choice(AllreduceChoice choice) { tuned_ = choice; }

  // Whether an allreduce of `bytes` should run as the hierarchy: the same answer on every rank.
  bool UseHierarchy(int64_t bytes) const {
    if (!hierarchy_available()) return false;
    const AllreduceChoice choice = ChoiceFor(bytes);
    return choice == AllreduceChoice::kHierarchical || (choice == AllreduceChoice::kAuto && bytes >= kHierarchyFromBytes);
  }
  // Whether an allgather of `total_bytes` (every rank's values together) should run as the
  // hierarchy: the same answer on every rank. The tuner times allreduces only and leaves it be.
  bool UseHierarchyForAllgather(int64_t total_bytes) const {
    return hierarchy_available() && (choice_ == AllreduceChoice::kHierarchical ||
                                     (choice_ == AllreduceChoice::kAuto && total_bytes >= kAllgatherHierarchyFromBytes));
  }
  // Whether an MPI_Allreduce of `bytes` over all ranks should run as ring: the same answer on
  // every rank, which knows the same bytes, ranks and hosts. kHierarchical where the hierarchy is
  // not available falls back to what kAuto runs.
  bool UseRing(int64_t bytes) const {
    const AllreduceChoice choice = ChoiceFor(bytes);
    if (!ring_available_ || choice == AllreduceChoice::kMpi) return false;
    if (choice == AllreduceChoice::kRing) return true;
    return RingPays(ranks_, bytes);
  }
  // Whether the hierarchy's allreduce of a `bytes` slice across the hosts should run as ring:
  // the same answer on every rank of that allreduce (one rank per host, slices of one length).
  bool UseRingAcross(int64_t bytes) const { return ring_available_ && RingPays(hosts_, bytes); }
  // Runs `allreduce` (which returns an MPI error code) with the variable set to ring, then puts
  // back the value it held. The variable is the process's: an MPI_Allreduce that another thread
  // of this process starts meanwhile runs as ring too.
  template <typename Call>
  int RunAsRing(Call allreduce) {
    int held = 0;
    int code = MPI_T_cvar_read(handle_, &held);
    if (code == MPI_SUCCESS) code = MPI_T_cvar_write(handle_, &ring_value_);
    if (code != MPI_SUCCESS) return code;
    code = allreduce();
    const int restored = MPI_T_cvar_write(handle_, &held);
    return code != MPI_SUCCESS ? code : restored;
  }

  bool ring_available() const { return ring_available_; }
  bool hierarchy_available() const { return host_comm_ != MPI_COMM_NULL; }
  int hosts() const { return hosts_; }
  int ranks_per_host() const { return ranks_per_host_; }
  // The hierarchy's communicators: this rank's host, and the ranks of its local rank on every host.
  MPI_Comm host_comm() const { return host_comm_; }
  MPI_Comm across_comm() const { return across_comm_; }
  int host_rank() const { return host_rank_; }
  // Where every rank of the job sits: its host (hosts numbered in the order of their lowest
  // rank) and its rank within that host. MPI places ranks as it likes: MPICH's emulated hosts
  // take them round-robin, a host file in blocks. Empty without the hierarchy.
  const std::vector<int>& host_of_rank() const { return host_of_rank_; }
  const std::vector<int>& host_rank_of_rank() const { return host_rank_of_rank_; }
  // One line for the log: the choice, the hosts and what runs.
  std::string Describe() const;
  // The hosts and the ranks on each, e.g. "3 hosts x 2 ranks".
  std::string Layout() const;

 private:
  AllreduceChoice choice_ = AllreduceChoice::kMpi;  // configured
  AllreduceChoice tuned_ = AllreduceChoice::kMpi;   // under kAuto, what the Tuner chose for timed sizes
  bool ring_available_ = false;
  MPI_T_cvar_handle handle_ = MPI_T_CVAR_HANDLE_NULL;
  int ring_value_ = 0;
  int ranks_ = 1;
  int hosts_ = 1;
  int ranks_per_host_ = 0;  // 0: hosts hold different numbers of ranks
  MPI_Comm host_comm_ = MPI_COMM_NULL;    // null: no hierarchy
  MPI_Comm across_comm_ = MPI_COMM_NULL;
  int host_rank_ = 0;
  std::vector<int> host_of_rank_;
  std::vector<int> host_rank_of_rank_;

  // From how many bytes ring beats MPI's own choice over `ranks` ranks on kRingFromHosts or more
  // hosts (kRingFromBytes above): over all ranks, or across hosts with one rank of each.
  static int64_t RingFrom(int ranks) {
    return (ranks & (ranks - 1)) == 0 ? kRingFromBytesPowerOfTwo : kRingFromBytes;
  }
  bool RingPays(int ranks, int64_t bytes) const { return hosts_ >= kRingFromHosts && bytes >= RingFrom(ranks); }
  AllreduceChoice ChoiceFor(int64_t bytes) const {
    return choice_ == AllreduceChoice::kAuto && bytes >= Tuner::kTimedFromBytes ? tuned_ : choice_;
  }
};

}  // namespace kerasdist
