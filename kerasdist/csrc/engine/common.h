// Types shared by every part of the engine. The engine knows nothing of TensorFlow:
// a tensor is a pointer, a dtype and a shape, plus callbacks to the front end.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace kerasdist {

// Values are part of the Python/TF ABI (ops pass them as ints): append only.
enum class DataType : uint8_t {
  kUInt8 = 0, kInt8 = 1, kInt32 = 2, kInt64 = 3,
  kFloat16 = 4, kBFloat16 = 5, kFloat32 = 6, kFloat64 = 7, kBool = 8,
};
enum class OpKind : uint8_t {
  kAllreduce = 0, kAllgather = 1, kBroadcast = 2, kReducescatter = 3, kAlltoall = 4,
  kJoin = 5,  // this rank has no more data (kerasdist.join); never cached, never fused
};
enum class ReduceOp : uint8_t { kAverage = 0, kSum = 1, kMin = 2, kMax = 3, kProduct = 4 };
// Where a request's tensors live. Negotiated: a tensor on a GPU on one rank and in host memory
// on another cannot meet in one collective (NCCL moves device memory, MPI host memory).
enum class Device : uint8_t { kCpu = 0, kGpu = 1 };
// Which algorithm the engine's MPI allreduces run (KERASDIST_ALLREDUCE_ALGORITHM): MPI's own
// choice, MPICH's ring, ring or the hierarchy where the hosts and the size make them faster, or
// the hierarchy (within hosts, across, within) wherever the layout allows it (allreduce_algorithm.h).
enum class AllreduceChoice : uint8_t { kMpi = 0, kRing = 1, kAuto = 2, kHierarchical = 3 };

using Clock = std::chrono::steady_clock;
inline double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// To stderr, prefixed with the rank, when `level` (0 debug, 1 info, 2 warning, 3 error) reaches
// the one SetLogging chose.
void Log(int level, const char* fmt, ...);
void SetLogging(int level, int rank);
// Names the calling thread (`top -H`, /proc/<pid>/task/<tid>/comm; at most 15 characters) where
// the platform allows it, so that tools and the benchmarks can tell the engine's threads apart.
void NameThisThread(const char* name);

size_t DataTypeSize(DataType dtype);
const char* DataTypeName(DataType dtype);
const char* OpKindName(OpKind kind);
const char* ReduceOpName(ReduceOp op);
const char* DeviceName(Device device);
const char* AllreduceChoiceName(AllreduceChoice choice);  // as KERASDIST_ALLREDUCE_ALGORITHM spells it
bool IsFloatingPoint(DataType dtype);

enum class StatusCode : uint8_t {
  kOk = 0, kInvalidArgument = 1, kFailedPrecondition = 2, kAborted = 3,
  kDeadlineExceeded = 4, kInternal = 5,
};

struct Status {
  StatusCode code = StatusCode::kOk;
  std::string message;

  bool ok() const { return code == StatusCode::kOk; }
  static Status OK() { return {}; }
  static Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status FailedPrecondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
  static Status Aborted(std::string m) { return {StatusCode::kAborted, std::move(m)}; }
  static Status DeadlineExceeded(std::string m) { return {StatusCode::kDeadlineExceeded, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
};

using Shape = std::vector<int64_t>;
int64_t NumElements(const Shape& shape);
std::string ShapeString(const Shape& shape);

struct TensorSpec {
  DataType dtype = DataType::kFloat32;
  Shape shape;
  // What travels: `dtype` itself, or float16/bfloat16 for a compressed float32/float64 allreduce
  // (converted on the way in and back on the way out). Set it whenever `dtype` is set.
  DataType wire = DataType::kFloat32;
  bool compressed() const { return wire != dtype; }
  bool operator==(const TensorSpec& o) const { return dtype == o.dtype && shape == o.shape && wire == o.wire; }
};

// What one rank asks for. Every rank must send an equal Request for the same name, except
// where an op allows differences (allgather: dim 0; alltoall: dim 0 and splits).
struct Request {
  std::string name;
  OpKind kind = OpKind::kAllreduce;
  ReduceOp reduce_op = ReduceOp::kSum;
  int32_t root_rank = 0;
  double prescale = 1.0;
  double postscale = 1.0;
  std::vector<TensorSpec> tensors;  // more than one for a grouped allreduce
  std::vector<int64_t> splits;      // alltoall: rows sent to each rank
  Device device = Device::kCpu;
  // The caller's thread waits for this request alone (an eager call): a rank whose pending
  // requests are all blocking can submit nothing else until one of them completes.
  bool blocking = false;
  // Non-empty: this rank could not run the collective (bad input). The request carries no
  // data; negotiating it tells the other ranks, which then fail the same call with this text.
  std::string error;
  // Inside a tf.function: which call of that function this rank is in (the front end counts
  // the calls per function). A graph names its collectives once per trace, so without it a call
  // skipped on one rank (under tf.cond) would pair the next call's request with the others'
  // current one. -1 for eager calls, whose names already differ per call.
  int64_t execution = -1;
  // Seconds this rank had waited for the request when it sent it to rank 0.
  double waited_s = 0.0;
};

// Rank 0's answer for one name, identical on every rank.
struct Response {
  std::string name;
  Status status;
  int32_t cache_id = -1;                 // >= 0 when later repeats may take the fast path
  std::vector<int64_t> rank_rows;        // allgather: dim 0 of every rank
  std::vector<int64_t> alltoall_rows;    // alltoall: size x size, [src * size + dst] rows
  // While some ranks have joined: an allreduce that the joined ranks never submitted runs with
  // zeros from them. `zero_ranks` are those ranks, `spec` the request they run (WriteRequest
  // bytes of a rank that did submit it), `contributors` the ranks whose data went in (Average
  // divides by it). 0 contributors: every rank's data went in.
  int32_t contributors = 0;
  std::vector<int64_t> zero_ranks;
  std::string spec;
  int32_t last_joined_rank = -1;  // join: the rank whose join came last
};

// Every field is set by name from kerasdist/knobs.py, which owns the defaults and the checks
// (c_api.cc refuses a start that does not name each one), so no default is written here.
struct EngineOptions {
  int64_t fusion_threshold_bytes = 0;  // 0 disables fusion
  bool autotune = false;               // rank 0 may choose the allreduce algorithm (tuner.h)
  bool fusion_tuning = false;          // with autotune, rank 0 may pick 1 MiB groups instead
  std::string autotune_file;           // rank 0 reads and writes its choice there when set
  double cycle_time_ms = 0.0;          // coalescing window after work arrives
  int64_t piggyback_bytes = 0;         // small allreduces up to this size ride with negotiation; 0: never
  double stall_warning_s = 0.0;        // 0 disables warnings
  double stall_timeout_s = 0.0;        // 0: wait forever
  double mismatch_timeout_s = 0.0;     // every rank blocked in a different call; 0: never
  double collective_timeout_s = 0.0;   // an agreed collective without progress ends the job; 0: never
  int cache_capacity = 0;              // requests that may take the fast path
  AllreduceChoice allreduce_algorithm = AllreduceChoice::kMpi;
  std::string timeline_path;           // written by rank 0 when set
  int log_level = 0;                   // 0 debug, 1 info, 2 warning, 3 error
};

// Memory the front end owns, lent to the engine for fused allreduces. The results stay in it
// and the outputs become views of it, so nothing is copied out.
class FusionBuffer {
 public:
  virtual ~FusionBuffer() = default;
  virtual char* data() = 0;
  virtual size_t size() const = 0;
  // True while an output that views this buffer is still alive: it must not be reused yet.
  virtual bool InUse() const = 0;
};
using FusionBufferFactory = std::function<std::unique_ptr<FusionBuffer>(size_t bytes)>;

// Front-end hooks, called from the engine thread. `allocate` gives an output its own memory
// once its shape is known (an allreduce output may reuse its input's); `alias` makes an output
// a view of a fusion buffer, starting at `offset`; `done` is called exactly once.
using AllocateFn = std::function<Status(int output_index, const Shape& shape, void** data)>;
using AliasFn = std::function<Status(int output_index, FusionBuffer* buffer, size_t offset, const Shape& shape)>;
using DoneFn = std::function<void(const Status&)>;

}  // namespace kerasdist
