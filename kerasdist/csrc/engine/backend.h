// How a negotiated collective moves data between ranks: the data half of a Transport
// (control_plane.h). The engine decides what runs, in what order and fused how (the same on every
// rank); a backend only runs one collective on the buffers it is given. MpiBackend moves host
// memory in every job; NcclBackend moves device memory in the NCCL build (over CudaMemory).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"

namespace kerasdist {

class Backend {
 public:
  virtual ~Backend() = default;

  // True when Allreduce and ReduceScatter of `dtype` multiply by `scale` while they combine, so
  // the result needs no pass of its own; otherwise the caller scales and passes 1.
  virtual bool ScalesWhileCombining(DataType dtype) const = 0;

  // `count` values of every rank combined with `op` (Average combines as Sum: its division is
  // the caller's `scale` or pass), from `in` into `out`; `in == out` works in place.
  virtual Status Allreduce(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op, double scale,
                           const std::string& name) = 0;
  // Rank r's `counts[r]` values, concatenated in rank order into `out` on every rank.
  virtual Status Allgather(const void* in, void* out, const std::vector<int64_t>& counts, DataType dtype,
                           const std::string& name) = 0;
  // `count` values of rank `root` into `data` on every rank.
  virtual Status Broadcast(void* data, int64_t count, DataType dtype, int root, const std::string& name) = 0;
  // `in` holds consecutive blocks of counts[r] values; rank r gets block r combined over ranks.
  virtual Status ReduceScatter(const void* in, void* out, const std::vector<int64_t>& counts, DataType dtype,
                               ReduceOp op, double scale, const std::string& name) = 0;
  // send_counts[r] values to rank r from consecutive blocks of `in`, recv_counts[r] values
  // from rank r into consecutive blocks of `out`.
  virtual Status Alltoall(const void* in, const std::vector<int64_t>& send_counts, void* out,
                          const std::vector<int64_t>& recv_counts, DataType dtype, const std::string& name) = 0;

  // The allreduce algorithms worth timing against each other in this job, the configured one first
  // (the engine's Tuner); the same list on every rank. One or none: there is nothing to choose.
  virtual std::vector<AllreduceChoice> AllreduceChoices() const { return {}; }
  // Later allreduces run as `choice`, one of AllreduceChoices(); every rank calls it between the
  // same two cycles.
  virtual void UseAllreduceChoice(AllreduceChoice) {}
  // Where the ranks are (hosts, ranks on each), as a saved tuning choice's key; empty: unknown.
  virtual std::string Layout() const { return ""; }
  // How many allreduce pieces and allgathers ran as the hierarchy across hosts
  // (allreduce_algorithm.h), as kerasdist.engine_times()'s `hierarchical`.
  virtual int64_t HierarchicalCalls() const { return 0; }
};

}  // namespace kerasdist
