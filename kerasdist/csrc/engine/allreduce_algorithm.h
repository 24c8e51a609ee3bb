// Which of MPI's own algorithms the engine's MPI_Allreduce calls run. MPICH picks by message size
// and rank count, not by where the ranks are: at 3 and 4 ranks on hosts joined by 1 Gbit/s TCP, a
// 12 MiB Sum took 375-407 ms its way against 145-171 ms as its ring (the link allows 134 ms),
// since recursive halving first folds a rank count that is not a power of two with whole-buffer
// exchanges. MPICH lets a program change its choice between calls through the MPI tool
// interface: the control variable MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM. This class finds it and
// its `ring` value at start, decides per call whether ring should run, and sets the variable to
// ring around those calls only. An MPI without that variable or value (Open MPI) keeps its own
// choice everywhere.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>

#include "common.h"

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

  // MPI's own choice everywhere: what a backend without a communicator of its own uses.
  AllreduceAlgorithm() = default;

  // Collective over `comm` (every rank calls it, with its own `choice`): finds the variable,
  // counts the hosts (MPI_Comm_split_type, shared memory) and checks that every rank was given
  // the same choice and found the same variable, so that every rank decides alike.
  static Status Make(MPI_Comm comm, AllreduceChoice choice, AllreduceAlgorithm* algorithm);

  // Whether an MPI_Allreduce of `bytes` should run as ring: the same answer on every rank, which
  // knows the same bytes, ranks and hosts.
  bool UseRing(int64_t bytes) const {
    if (!ring_available_ || choice_ == AllreduceChoice::kMpi) return false;
    if (choice_ == AllreduceChoice::kRing) return true;
    const bool power_of_two = (ranks_ & (ranks_ - 1)) == 0;
    return hosts_ >= kRingFromHosts && bytes >= (power_of_two ? kRingFromBytesPowerOfTwo : kRingFromBytes);
  }
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
  int hosts() const { return hosts_; }
  // One line for the log: the choice, the hosts and what runs.
  std::string Describe() const;

 private:
  AllreduceChoice choice_ = AllreduceChoice::kMpi;
  bool ring_available_ = false;
  MPI_T_cvar_handle handle_ = MPI_T_CVAR_HANDLE_NULL;
  int ring_value_ = 0;
  int ranks_ = 1;
  int hosts_ = 1;
  int ranks_per_host_ = 0;  // 0: hosts hold different numbers of ranks
};

}  // namespace kerasdist
