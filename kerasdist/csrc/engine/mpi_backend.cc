#include "mpi_backend.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>

#include "kernels.h"

namespace kerasdist {
namespace {

// Min and Max of float32 and float64: [0] float32, [1] float64; [0] Min, [1] Max. MPI's builtin
// MIN/MAX compare with < and >, so a NaN wins or loses depending on which operand it is, and
// ranks that combine in different orders get different answers.
MPI_Op g_float_extrema[2][2];
bool g_ops_created = false;

template <typename F, bool kWantMax>
void CombineExtrema(void* in, void* inout, int* len, MPI_Datatype*) {
  const F* a = static_cast<const F*>(in);
  F* b = static_cast<F*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = Extremum(a[i], b[i], kWantMax);
}

// Created once, after MPI_Init; they live until MPI_Finalize.
void CreateMpiReductions() {
  if (g_ops_created) return;
  MPI_User_function* extrema[2][2] = {{CombineExtrema<float, false>, CombineExtrema<float, true>},
                                      {CombineExtrema<double, false>, CombineExtrema<double, true>}};
  for (int t = 0; t < 2; ++t)
    for (int m = 0; m < 2; ++m) MPI_Op_create(extrema[t][m], /*commute=*/1, &g_float_extrema[t][m]);
  g_ops_created = true;
}

MPI_Datatype ToMpiType(DataType dtype) {
  switch (dtype) {
    case DataType::kUInt8: return MPI_UINT8_T;
    case DataType::kInt8: return MPI_INT8_T;
    case DataType::kInt32: return MPI_INT32_T;
    case DataType::kInt64: return MPI_INT64_T;
    case DataType::kFloat16: case DataType::kBFloat16: return MPI_UINT16_T;
    case DataType::kFloat32: return MPI_FLOAT;
    case DataType::kFloat64: return MPI_DOUBLE;
    case DataType::kBool: return MPI_BYTE;
  }
  return MPI_BYTE;
}

// The MPI reduction for a dtype MPI reduces natively (not float16 or bfloat16).
MPI_Op ToMpiOp(ReduceOp op, DataType dtype) {
  if ((dtype == DataType::kFloat32 || dtype == DataType::kFloat64) &&
      (op == ReduceOp::kMin || op == ReduceOp::kMax)) {
    return g_float_extrema[dtype == DataType::kFloat64][op == ReduceOp::kMax];
  }
  switch (op) {
    case ReduceOp::kAverage: case ReduceOp::kSum: return MPI_SUM;
    case ReduceOp::kMin: return MPI_MIN;
    case ReduceOp::kMax: return MPI_MAX;
    case ReduceOp::kProduct: return MPI_PROD;
  }
  return MPI_SUM;
}

bool EqualCounts(const std::vector<int>& counts) {
  return std::all_of(counts.begin(), counts.end(), [&](int c) { return c == counts[0]; });
}

bool AllEqual(const std::vector<int>& counts) {
  return std::all_of(counts.begin(), counts.end(), [&](int c) { return c == counts[0]; });
}

std::vector<int> Displacements(const std::vector<int>& counts) {
  std::vector<int> displacements(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) displacements[i] = displacements[i - 1] + counts[i - 1];
  return displacements;
}

// MPI_Allgather(v) over `comm` of counts[r] values from its rank r. Equal counts take MPI's
// equal-count call: MPICH's v-variants took 5-12x as long (1-16 MiB, 6 ranks on 2 emulated
// hosts; allreduce_algorithm.h's measurements of the hierarchy).
int GatherInRankOrder(const void* in, void* out, const std::vector<int>& counts, MPI_Datatype type, MPI_Comm comm) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  if (AllEqual(counts)) return MPI_Allgather(in, counts[rank], type, out, counts[rank], type, comm);
  return MPI_Allgatherv(in, counts[rank], type, out, counts.data(), Displacements(counts).data(), type, comm);
}

// MPI counts and displacements are ints: false when `counts` or their sum do not fit.
bool ToIntCounts(const std::vector<int64_t>& counts, std::vector<int>* out) {
  int64_t total = 0;
  for (int64_t c : counts) {
    total += c;
    if (c > INT_MAX || total > INT_MAX) return false;
    out->push_back(static_cast<int>(c));
  }
  return true;
}

Status TooLarge(const std::string& name) {
  return Status::InvalidArgument("kerasdist: '" + name +
                                 "' needs more than 2^31-1 elements in one MPI call; split it");
}

}  // namespace

Status MpiStatus(int code, const char* what, const std::string& name) {
  if (code == MPI_SUCCESS) return Status::OK();
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return Status::Internal(std::string("kerasdist: ") + what + " failed for '" + name + "': " + std::string(text, len));
}

MpiBackend::MpiBackend(MPI_Comm comm, int64_t piece_bytes, AllreduceAlgorithm algorithm)
    : comm_(comm), piece_bytes_(piece_bytes), algorithm_(algorithm) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  CreateMpiReductions();
}

Status MpiBackend::Allreduce(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op, double scale,
                             const std::string& name) {
  const size_t item_size = DataTypeSize(dtype);
  // In pieces of `piece_bytes_`: one MPICH allreduce of more than 32 MiB allocates and faults
  // in a scratch buffer that large every call, and 64 MiB in one call took 30 ms here against
  // 18 ms in 16 MiB pieces. MPI counts are ints in any case.
  const int64_t piece_items = piece_bytes_ / static_cast<int64_t>(item_size);
  const int64_t piece = piece_items > 0 ? std::min<int64_t>(piece_items, INT_MAX) : INT_MAX;
  const bool halves = IsHalf(dtype);
  if (halves && in != out) {  // combined in place
    std::memcpy(out, in, count * item_size);
    in = out;
  }
  const bool in_place = in == out;
  for (int64_t offset = 0; offset < count; offset += piece) {
    const size_t at = offset * item_size;
    const int n = static_cast<int>(std::min(piece, count - offset));
    char* piece_out = static_cast<char*>(out) + at;
    const auto reduce = [&] {
      return MPI_Allreduce(in_place ? MPI_IN_PLACE : static_cast<const char*>(in) + at, piece_out, n,
                           ToMpiType(dtype), ToMpiOp(op, dtype), comm_);
    };
    int code;
    if (halves) {  // already reduce-scatter and allgather, at memory speed
      code = AllreduceHalves(piece_out, n, dtype, op, scale);
    } else if (algorithm_.UseHierarchy(int64_t{n} * item_size)) {
      hierarchical_calls_.fetch_add(1, std::memory_order_relaxed);
      code = AllreduceAcrossHosts(in_place ? piece_out : static_cast<const char*>(in) + at, piece_out, n, dtype, op);
    } else if (algorithm_.UseRing(int64_t{n} * item_size)) {  // the same pieces, so the same answer, on every rank
      code = algorithm_.RunAsRing(reduce);
    } else {
      code = reduce();
    }
    Status s = MpiStatus(code, "allreduce", name);
    if (!s.ok()) return s;
  }
  return Status::OK();
}

Status MpiBackend::Allgather(const void* in, void* out, const std::vector<int64_t>& counts, DataType dtype,
                             const std::string& name) {
  std::vector<int> icounts;
  if (!ToIntCounts(counts, &icounts)) return TooLarge(name);
  int64_t total = 0;
  for (int c : icounts) total += c;
  if (algorithm_.UseHierarchyForAllgather(total * static_cast<int64_t>(DataTypeSize(dtype)))) {
    hierarchical_calls_.fetch_add(1, std::memory_order_relaxed);
    return MpiStatus(AllgatherAcrossHosts(in, out, icounts, dtype), "allgather", name);
  }
  return MpiStatus(GatherInRankOrder(in, out, icounts, ToMpiType(dtype), comm_), "allgather", name);
}

Status MpiBackend::Broadcast(void* data, int64_t count, DataType dtype, int root, const std::string& name) {
  if (count > INT_MAX) return TooLarge(name);
  return MpiStatus(MPI_Bcast(data, static_cast<int>(count), ToMpiType(dtype), root, comm_), "broadcast", name);
}

Status MpiBackend::ReduceScatter(const void* in, void* out, const std::vector<int64_t>& counts, DataType dtype,
                                 ReduceOp op, double scale, const std::string& name) {
  std::vector<int> icounts;
  if (!ToIntCounts(counts, &icounts)) return TooLarge(name);
  int code;
  if (IsHalf(dtype)) {
    code = CombineChunks(in, out, icounts, dtype, op, scale);
  } else if (AllEqual(icounts)) {  // the equal-count call, as in Allgather
    code = MPI_Reduce_scatter_block(in, out, icounts[0], ToMpiType(dtype), ToMpiOp(op, dtype), comm_);
  } else {
    code = MPI_Reduce_scatter(in, out, icounts.data(), ToMpiType(dtype), ToMpiOp(op, dtype), comm_);
  }
  return MpiStatus(code, "reducescatter", name);
}

Status MpiBackend::Alltoall(const void* in, const std::vector<int64_t>& send_counts, void* out,
                            const std::vector<int64_t>& recv_counts, DataType dtype, const std::string& name) {
  std::vector<int> scounts, rcounts;
  if (!ToIntCounts(send_counts, &scounts) || !ToIntCounts(recv_counts, &rcounts)) return TooLarge(name);
  const MPI_Datatype type = ToMpiType(dtype);
  return MpiStatus(MPI_Alltoallv(in, scounts.data(), Displacements(scounts).data(), type, out, rcounts.data(),
                                 Displacements(rcounts).data(), type, comm_),
                   "alltoall", name);
}

int MpiBackend::AllreduceAcrossHosts(const void* in, void* out, int count, DataType dtype, ReduceOp op) {
  const int local = algorithm_.ranks_per_host();
  const int slice = count / local;
  const int tail = count - slice * local;  // fewer than `local`: local rank 0 carries them across
  const bool carries_tail = algorithm_.host_rank() == 0;
  const int mine = slice + (carries_tail ? tail : 0);
  const size_t item_size = DataTypeSize(dtype);
  const size_t at = static_cast<size_t>(slice) * local * item_size;
  slice_.resize(static_cast<size_t>(slice + tail) * item_size);
  char* const tail_of_slice = slice_.data() + static_cast<size_t>(slice) * item_size;
  const MPI_Comm host = algorithm_.host_comm();
  const MPI_Datatype type = ToMpiType(dtype);
  const MPI_Op mpi_op = ToMpiOp(op, dtype);
  int code = MPI_Reduce_scatter_block(in, slice_.data(), slice, type, mpi_op, host);
  if (code == MPI_SUCCESS && tail > 0) {
    std::memcpy(tail_of_slice, static_cast<const char*>(in) + at, tail * item_size);
    code = MPI_Reduce(carries_tail ? MPI_IN_PLACE : tail_of_slice, tail_of_slice, tail, type, mpi_op, 0, host);
  }
  if (code != MPI_SUCCESS) return code;
  // Every rank of one allreduce across hosts has the same local rank, so the same `mine`.
  const auto across = [&] {
    return MPI_Allreduce(MPI_IN_PLACE, slice_.data(), mine, type, mpi_op, algorithm_.across_comm());
  };
  code = algorithm_.UseRingAcross(int64_t{mine} * static_cast<int64_t>(item_size)) ? algorithm_.RunAsRing(across)
                                                                                      : across();
  if (code == MPI_SUCCESS) code = MPI_Allgather(slice_.data(), slice, type, out, slice, type, host);
  if (code != MPI_SUCCESS || tail == 0) return code;
  char* const tail_out = static_cast<char*>(out) + at;
  if (carries_tail) std::memcpy(tail_out, tail_of_slice, tail * item_size);
  return MPI_Bcast(tail_out, tail, type, 0, host);
}

int MpiBackend::AllgatherAcrossHosts(const void* in, void* out, const std::vector<int>& counts, DataType dtype) {
  const std::vector<int>& host_of = algorithm_.host_of_rank();
  const std::vector<int>& local_of = algorithm_.host_rank_of_rank();
  const int hosts = algorithm_.hosts();
  const int local = algorithm_.ranks_per_host();
  const int my_host = host_of[rank_];
  const int my_local = algorithm_.host_rank();
  const size_t item_size = DataTypeSize(dtype);
  const MPI_Datatype type = ToMpiType(dtype);
  // members[h][k]: the rank of local rank k on host h; offset[r]: where rank r's values start
  // in its host's block, and displacement[r] in `out`.
  std::vector<std::vector<int>> members(hosts, std::vector<int>(local));
  for (int r = 0; r < size_; ++r) members[host_of[r]][local_of[r]] = r;
  const std::vector<int> displacement = Displacements(counts);
  std::vector<int64_t> offset(size_), block(hosts, 0);
  for (int h = 0; h < hosts; ++h) {
    for (int r : members[h]) {
      offset[r] = block[h];
      block[h] += counts[r];
    }
  }
  // Slice k of host h's block: [slice_start(h, k), slice_start(h, k + 1)), lengths within 1 of each
  // other, and rank members[h][k]'s own values when the host's ranks send equal counts.
  const auto slice_start = [&](int h, int k) { return block[h] * k / local; };
  const auto slice_length = [&](int h, int k) { return static_cast<int>(slice_start(h, k + 1) - slice_start(h, k)); };
  // across_hosts[k][j]: the host of rank j of the communicator across hosts of local rank k,
  // which orders its ranks as the job does (AllreduceAlgorithm::Make).
  std::vector<std::vector<int>> across_hosts(local);
  for (int r = 0; r < size_; ++r) across_hosts[local_of[r]].push_back(host_of[r]);

  const MPI_Comm host = algorithm_.host_comm();
  std::vector<int> host_counts(local);
  for (int k = 0; k < local; ++k) host_counts[k] = counts[members[my_host][k]];
  const char* my_slice = static_cast<const char*>(in);
  if (!AllEqual(host_counts)) {
    host_block_.resize(static_cast<size_t>(block[my_host]) * item_size);
    const int code = GatherInRankOrder(in, host_block_.data(), host_counts, type, host);
    if (code != MPI_SUCCESS) return code;
    my_slice = host_block_.data() + static_cast<size_t>(slice_start(my_host, my_local)) * item_size;
  }
  // Every rank of one allgather across hosts has the same local rank, so the same counts.
  std::vector<int> across_counts(hosts);
  int64_t across_total = 0;
  for (int j = 0; j < hosts; ++j) across_total += across_counts[j] = slice_length(across_hosts[my_local][j], my_local);
  across_.resize(static_cast<size_t>(across_total) * item_size);
  int code = GatherInRankOrder(my_slice, across_.data(), across_counts, type, algorithm_.across_comm());
  if (code != MPI_SUCCESS) return code;
  std::vector<int> gathered_counts(local, 0);
  int64_t total = 0;
  for (int k = 0; k < local; ++k) {
    for (int h : across_hosts[k]) gathered_counts[k] += slice_length(h, k);
    total += gathered_counts[k];
  }
  gathered_.resize(static_cast<size_t>(total) * item_size);
  code = GatherInRankOrder(across_.data(), gathered_.data(), gathered_counts, type, host);
  if (code != MPI_SUCCESS) return code;
  // gathered_ holds, for local rank k in turn, slice k of each host in across_hosts[k]'s order;
  // each piece of a slice goes to the rank whose values it holds.
  const char* from = gathered_.data();
  for (int k = 0; k < local; ++k) {
    for (int h : across_hosts[k]) {
      const int64_t begin = slice_start(h, k), end = slice_start(h, k + 1);
      for (int r : members[h]) {
        const int64_t first = std::max(begin, offset[r]), last = std::min(end, offset[r] + counts[r]);
        if (first >= last) continue;
        std::memcpy(static_cast<char*>(out) + (displacement[r] + (first - offset[r])) * item_size,
                    from + (first - begin) * item_size, (last - first) * item_size);
      }
      from += (end - begin) * item_size;
    }
  }
  return MPI_SUCCESS;
}

int MpiBackend::CombineChunks(const void* in, void* out, const std::vector<int>& counts, DataType dtype, ReduceOp op,
                              double scale) {
  const int mine = counts[rank_];
  scratch_.resize(static_cast<size_t>(mine) * size_);
  int code;
  if (EqualCounts(counts)) {
    code = MPI_Alltoall(in, mine, MPI_UINT16_T, scratch_.data(), mine, MPI_UINT16_T, comm_);
  } else {
    const std::vector<int> send_displacements = Displacements(counts);
    const std::vector<int> receive_counts(size_, mine);
    const std::vector<int> receive_displacements = Displacements(receive_counts);
    code = MPI_Alltoallv(in, counts.data(), send_displacements.data(), MPI_UINT16_T, scratch_.data(),
                         receive_counts.data(), receive_displacements.data(), MPI_UINT16_T, comm_);
  }
  if (code != MPI_SUCCESS) return code;
  std::vector<const uint16_t*> sources(size_);
  for (int i = 0; i < size_; ++i) sources[i] = scratch_.data() + static_cast<size_t>(i) * mine;
  CombineHalves(sources.data(), size_, static_cast<uint16_t*>(out), mine, dtype, op, scale);
  return MPI_SUCCESS;
}

int MpiBackend::AllreduceHalves(void* data, int count, DataType dtype, ReduceOp op, double scale) {
  // In pieces whose alltoall, combine and allgather stay in cache: a 16 MiB float32 tensor's
  // 8 MiB of float16 took 7.9 ms in one piece here, 5.3 ms in pieces of 256K values. Pieces are
  // a multiple of the ranks, so that all but the last split evenly and take MPI's plain
  // Alltoall and Allgather: over shared memory MPICH's v-variants took 1.7x and 2.5x as long.
  const int kPiece = std::max(size_, (256 << 10) / size_ * size_);
  std::vector<int> counts(size_);
  for (int begin = 0; begin < count; begin += kPiece) {
    const int n = std::min(kPiece, count - begin);
    for (int i = 0; i < size_; ++i) counts[i] = n / size_ + (i < n % size_ ? 1 : 0);
    const std::vector<int> displacements = Displacements(counts);
    uint16_t* values = static_cast<uint16_t*>(data) + begin;
    int code = CombineChunks(values, values + displacements[rank_], counts, dtype, op, scale);
    if (code == MPI_SUCCESS) {
      code = EqualCounts(counts) ? MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, values, counts[0], MPI_UINT16_T,
                                                 comm_)
                                 : MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, values, counts.data(),
                                                  displacements.data(), MPI_UINT16_T, comm_);
    }
    if (code != MPI_SUCCESS) return code;
  }
  return MPI_SUCCESS;
}

}  // namespace kerasdist
