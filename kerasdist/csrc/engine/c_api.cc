// The C entry points Python reaches through ctypes (the TF ops reach the engine directly), and
// collectives on caller-owned host memory, through which tests/engine drives the engine alone.
#include "c_api.h"

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <new>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "engine.h"
#include "mpi_control_plane.h"

namespace {

using kerasdist::DataType;
using kerasdist::ReduceOp;
using kerasdist::StatusCode;

static_assert(KERASDIST_UINT8 == int(DataType::kUInt8) && KERASDIST_INT8 == int(DataType::kInt8) &&
              KERASDIST_INT32 == int(DataType::kInt32) && KERASDIST_INT64 == int(DataType::kInt64) &&
              KERASDIST_FLOAT16 == int(DataType::kFloat16) && KERASDIST_BFLOAT16 == int(DataType::kBFloat16) &&
              KERASDIST_FLOAT32 == int(DataType::kFloat32) && KERASDIST_FLOAT64 == int(DataType::kFloat64) &&
              KERASDIST_BOOL == int(DataType::kBool));
static_assert(KERASDIST_AVERAGE == int(ReduceOp::kAverage) && KERASDIST_SUM == int(ReduceOp::kSum) &&
              KERASDIST_MIN == int(ReduceOp::kMin) && KERASDIST_MAX == int(ReduceOp::kMax) &&
              KERASDIST_PRODUCT == int(ReduceOp::kProduct));
static_assert(KERASDIST_OK == int(StatusCode::kOk) && KERASDIST_INVALID_ARGUMENT == int(StatusCode::kInvalidArgument) &&
              KERASDIST_FAILED_PRECONDITION == int(StatusCode::kFailedPrecondition) &&
              KERASDIST_ABORTED == int(StatusCode::kAborted) &&
              KERASDIST_DEADLINE_EXCEEDED == int(StatusCode::kDeadlineExceeded) &&
              KERASDIST_INTERNAL == int(StatusCode::kInternal));

bool ParseInteger(const std::string& text, int64_t low, int64_t high, int64_t* value) {
  char* end = nullptr;
  errno = 0;
  long long parsed = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0 || parsed < low || parsed > high) return false;
  *value = parsed;
  return true;
}

bool ParseNumber(const std::string& text, double* value) {
  char* end = nullptr;
  errno = 0;
  double parsed = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || errno != 0 || !(parsed >= 0)) return false;
  *value = parsed;
  return true;
}

// The engine's knobs by their names in kerasdist/knobs.py. Python checked the values already;
// these parsers only refuse text that is not the field's type.
using Setter = std::function<bool(kerasdist::EngineOptions&, const std::string&)>;

const std::map<std::string, Setter>& Setters() {
  static const auto* setters = new std::map<std::string, Setter>{
      {"fusion_threshold_bytes",
       [](kerasdist::EngineOptions& o, const std::string& t) {
         return ParseInteger(t, 0, INT64_MAX, &o.fusion_threshold_bytes);
       }},
      {"fusion_tuning",
       [](kerasdist::EngineOptions& o, const std::string& t) {
         int64_t value = 0;
         if (!ParseInteger(t, 0, 1, &value)) return false;
         o.fusion_tuning = value == 1;
         return true;
       }},
      {"autotune",
       [](kerasdist::EngineOptions& o, const std::string& t) {
         int64_t value = 0;
         if (!ParseInteger(t, 0, 1, &value)) return false;
         o.autotune = value == 1;
         return true;
       }},
      {"autotune_file",
       [](kerasdist::EngineOptions& o, const std::string& t) {
         o.autotune_file = t;
         return true;
       }},
      {"piggyback_bytes",
       [](kerasdist::EngineOptions& o, const std::string& t) {
         return ParseInteger(t, 0, INT32_MAX, &o.piggyback_bytes);
       }},
      {"cycle_time_ms", [](kerasdist::EngineOptions& o, const std::string& t) { return ParseNumber(t, &o.cycle_time_ms); }},
      {"stall_warning_s",
       [](kerasdist::EngineOptions& o, const std::string& t) { return ParseNumber(t, &o.stall_warning_s); }},
      {"stall_timeout_s",
       [](kerasdist::EngineOptions& o, const std::string& t) { return ParseNumber(t, &o.stall_timeout_s); }},
      {"mismatch_timeout_s",
       [](kerasdist::EngineOptions& o, const std::string& t) { return ParseNumber(t, &o.mismatch_timeout_s); }},
      {"collective_timeout_s",
       [](kerasdist::EngineOptions& o, const std::string& t) { return ParseNumber(t, &o.collective_timeout_s); }},
      {"cache_capacity",
       [](kerasdist::EngineOptions& o, const std::string& t) {
         int64_t value = 0;
         if (!ParseInteger(t, 1, INT32_MAX, &value)) return false;
         o.cache_capacity = static_cast<int>(value);
         return true;
       }},
      {"allreduce_algorithm",
       [](kerasdist::EngineOptions& o, const std::string& t) {
         using kerasdist::AllreduceChoice;
         static const std::map<std::string, AllreduceChoice> kChoices = {
             {"mpi", AllreduceChoice::kMpi},
             {"ring", AllreduceChoice::kRing},
             {"auto", AllreduceChoice::kAuto},
             {"hierarchical", AllreduceChoice::kHierarchical}};
         auto choice = kChoices.find(t);
         if (choice == kChoices.end()) return false;
         o.allreduce_algorithm = choice->second;
         return true;
       }},
      {"timeline_path",
       [](kerasdist::EngineOptions& o, const std::string& t) {
         o.timeline_path = t;
         return true;
       }},
      {"log_level",
       [](kerasdist::EngineOptions& o, const std::string& t) {
         int64_t value = 0;
         if (!ParseInteger(t, 0, 3, &value)) return false;
         o.log_level = static_cast<int>(value);
         return true;
       }},
  };
  return *setters;
}

int Fail(const std::string& message, char* error, int error_size) {
  std::strncpy(error, message.c_str(), error_size - 1);
  error[error_size - 1] = '\0';
  return 1;
}

// 0, or the status code with the message in `error`.
int Answer(const kerasdist::Status& status, char* error, int error_size) {
  if (status.ok()) return 0;
  Fail(status.message, error, error_size);
  return static_cast<int>(status.code);
}

// Fusion memory for a front end without its own (the C API alone, as in tests/engine). Outputs
// are copied out of it (see kerasdist_grouped_allreduce), so it is free again once the fused
// allreduce is done.
class HeapFusionBuffer : public kerasdist::FusionBuffer {
 public:
  static std::unique_ptr<kerasdist::FusionBuffer> New(size_t bytes) {
    void* data = ::operator new(bytes, kAlignment, std::nothrow);
    if (!data) return nullptr;  // the engine reports it
    return std::unique_ptr<kerasdist::FusionBuffer>(new HeapFusionBuffer(static_cast<char*>(data), bytes));
  }
  HeapFusionBuffer(const HeapFusionBuffer&) = delete;
  HeapFusionBuffer& operator=(const HeapFusionBuffer&) = delete;
  ~HeapFusionBuffer() override { ::operator delete(data_, kAlignment); }
  char* data() override { return data_; }
  size_t size() const override { return size_; }
  bool InUse() const override { return false; }

 private:
  // Fused tensors start at multiples of 64 bytes from the buffer's start: with the buffer
  // aligned alike, each one is as aligned as in TensorFlow's buffers.
  static constexpr std::align_val_t kAlignment{64};
  HeapFusionBuffer(char* data, size_t size) : data_(data), size_(size) {}
  char* data_;
  size_t size_;
};

bool IsDataType(int value) { return value >= KERASDIST_UINT8 && value <= KERASDIST_BOOL; }
bool IsReduceOp(int value) { return value >= KERASDIST_AVERAGE && value <= KERASDIST_PRODUCT; }

// Fails a call whose arguments are wrong on this rank, and tells the other ranks (as the
// engine does for its own local checks), so that they fail the same call instead of waiting.
int RefuseLocally(const char* name, kerasdist::OpKind kind, const std::string& message, char* error,
                  int error_size) {
  kerasdist_submit_failure(name, static_cast<int>(kind), message.c_str());
  Fail(message, error, error_size);
  return KERASDIST_INVALID_ARGUMENT;
}

// Enqueues `request` and waits until the engine has run it: the caller's buffers outlive it.
kerasdist::Status RunAndWait(kerasdist::Request request, std::vector<const void*> inputs,
                             std::vector<void*> outputs, kerasdist::AllocateFn allocate,
                             kerasdist::AliasFn alias) {
  request.blocking = true;  // the caller waits for it alone
  std::promise<kerasdist::Status> finished;
  std::future<kerasdist::Status> result = finished.get_future();
  kerasdist::Status status = kerasdist::Engine::Get().Enqueue(
      std::move(request), std::move(inputs), std::move(outputs), std::move(allocate), std::move(alias),
      [&finished](const kerasdist::Status& s) { finished.set_value(s); });
  return status.ok() ? result.get() : status;
}

}  // namespace

extern "C" {

// Starts the engine with its knobs given as `count` name/value texts, every one exactly once.
// Returns 0 on success; otherwise writes a message into `error`.
int kerasdist_start(int count, const char* const* names, const char* const* values, char* error,
                    int error_size) {
  kerasdist::EngineOptions options;
  std::set<std::string> given;
  for (int i = 0; i < count; ++i) {
    const std::string name = names[i];
    auto setter = Setters().find(name);
    if (setter == Setters().end()) return Fail("kerasdist: the engine has no setting " + name, error, error_size);
    if (!given.insert(name).second) return Fail("kerasdist: engine setting " + name + " given twice", error, error_size);
    if (!setter->second(options, values[i])) {
      return Fail("kerasdist: engine setting " + name + "=" + values[i] + " is not valid", error, error_size);
    }
  }
  for (const auto& entry : Setters()) {
    if (!given.count(entry.first)) {
      return Fail("kerasdist: engine setting " + entry.first + " was not given", error, error_size);
    }
  }
  kerasdist::Engine& engine = kerasdist::Engine::Get();
  // The op library registers TensorFlow-backed buffers when it loads; without it, heap ones.
  if (!engine.has_fusion_buffer_factory()) engine.SetFusionBufferFactory(HeapFusionBuffer::New);
  kerasdist::Status status = engine.Start(options, kerasdist::MakeMpiTransport);
  return status.ok() ? 0 : Fail(status.message, error, error_size);
}

void kerasdist_shutdown() { kerasdist::Engine::Get().Shutdown(); }

// Tells the other ranks that this rank could not run the collective `name` (bad input found
// before it reached the engine), so that they fail it too instead of waiting for this rank.
void kerasdist_submit_failure(const char* name, int op_kind, const char* message) {
  kerasdist::Request request;
  request.name = name;
  request.kind = static_cast<kerasdist::OpKind>(op_kind);
  request.error = message;
  kerasdist::Engine::Get().SubmitFailure(std::move(request));
}

// Blocks until every rank has joined (see Engine: joined ranks take part in the others'
// allreduces with zeros meanwhile); writes the rank that joined last. Returns 0, or the failing
// StatusCode with a message in `error`. Python calls it with the GIL released (ctypes).
int kerasdist_join(int* last_joined_rank, char* error, int error_size) {
  kerasdist::Request request;
  request.name = "kerasdist.join";
  request.kind = kerasdist::OpKind::kJoin;
  int32_t last = -1;
  kerasdist::Status status = RunAndWait(std::move(request), {}, {&last}, nullptr, nullptr);
  if (status.ok()) *last_joined_rank = last;
  return Answer(status, error, error_size);
}

// 1 when the engine gave up waiting for other ranks: its communicator is then unusable.
int kerasdist_stalled() { return kerasdist::Engine::Get().stalled() ? 1 : 0; }

int kerasdist_engine_times(const char** names, double* values, int capacity) {
  using kerasdist::Phase;
  const kerasdist::PhaseClock& clock = kerasdist::Engine::Get().phases();
  std::vector<std::pair<const char*, double>> entries;
  for (int p = 0; p < static_cast<int>(Phase::kCount); ++p) {
    entries.push_back({kerasdist::PhaseName(static_cast<Phase>(p)), clock.seconds(static_cast<Phase>(p))});
  }
  entries.push_back({"pickup", clock.pickup_seconds()});
  entries.push_back({"cycles", static_cast<double>(clock.cycles())});
  entries.push_back({"collectives", static_cast<double>(clock.collectives())});
  entries.push_back({"rode", static_cast<double>(clock.riders())});
  entries.push_back({"hierarchical", static_cast<double>(kerasdist::Engine::Get().hierarchical_calls())});
  const int count = static_cast<int>(entries.size());
  for (int i = 0; i < count && i < capacity; ++i) {
    names[i] = entries[i].first;
    values[i] = entries[i].second;
  }
  return count;
}

// Allreduces `tensor_count` tensors of one dtype as one request (fused when the fusion threshold
// allows) and waits for the results: outputs[i] receives counts[i] reduced values, and may be
// inputs[i]. `wire_dtype` is `dtype`, or float16/bfloat16 to send float32/float64 compressed.
int kerasdist_grouped_allreduce(const char* name, int tensor_count, const void* const* inputs, void* const* outputs,
                                const int64_t* counts, int dtype, int wire_dtype, int reduce_op, double prescale,
                                double postscale, char* error, int error_size) {
  const auto kind = kerasdist::OpKind::kAllreduce;
  const std::string quoted = std::string("'") + name + "'";
  if (tensor_count < 1) return RefuseLocally(name, kind, "kerasdist: " + quoted + " has no tensors", error, error_size);
  if (!IsDataType(dtype) || !IsDataType(wire_dtype) || !IsReduceOp(reduce_op)) {
    return RefuseLocally(name, kind, "kerasdist: " + quoted + " has an unknown dtype or reduce op", error, error_size);
  }
  const bool compressible = dtype == KERASDIST_FLOAT32 || dtype == KERASDIST_FLOAT64;
  if (wire_dtype != dtype && !(compressible && (wire_dtype == KERASDIST_FLOAT16 || wire_dtype == KERASDIST_BFLOAT16))) {
    return RefuseLocally(name, kind,
                         "kerasdist: " + quoted + ": only float32/float64 travel compressed, as float16 or bfloat16",
                         error, error_size);
  }
  kerasdist::Request request;
  request.name = name;
  request.kind = kind;
  request.reduce_op = static_cast<ReduceOp>(reduce_op);
  request.prescale = prescale;
  request.postscale = postscale;
  for (int i = 0; i < tensor_count; ++i) {
    if (counts[i] < 0) {
      return RefuseLocally(name, kind, "kerasdist: " + quoted + " has a negative count", error, error_size);
    }
    kerasdist::TensorSpec spec;
    spec.dtype = static_cast<DataType>(dtype);
    spec.wire = static_cast<DataType>(wire_dtype);
    spec.shape = {counts[i]};
    request.tensors.push_back(spec);
  }
  std::vector<void*> results(outputs, outputs + tensor_count);
  kerasdist::AllocateFn allocate = [results](int index, const kerasdist::Shape&, void** data) {
    *data = results[index];
    return kerasdist::Status::OK();
  };
  // A fused result stays in the fusion buffer; the caller's memory gets a copy of it.
  const size_t item_size = kerasdist::DataTypeSize(static_cast<DataType>(dtype));
  kerasdist::AliasFn alias = [results, item_size](int index, kerasdist::FusionBuffer* buffer, size_t offset,
                                                  const kerasdist::Shape& shape) {
    std::memcpy(results[index], buffer->data() + offset, kerasdist::NumElements(shape) * item_size);
    return kerasdist::Status::OK();
  };
  kerasdist::Status status = RunAndWait(std::move(request), std::vector<const void*>(inputs, inputs + tensor_count),
                                        {}, std::move(allocate), std::move(alias));
  return Answer(status, error, error_size);
}

// Broadcasts `count` values of `buffer` from `root_rank` into `buffer` on every other rank.
int kerasdist_broadcast(const char* name, void* buffer, int64_t count, int dtype, int root_rank, char* error,
                        int error_size) {
  const auto kind = kerasdist::OpKind::kBroadcast;
  if (!IsDataType(dtype) || count < 0) {
    return RefuseLocally(name, kind, std::string("kerasdist: '") + name + "' has an unknown dtype or a negative count",
                         error, error_size);
  }
  kerasdist::Request request;
  request.name = name;
  request.kind = kind;
  request.root_rank = root_rank;
  kerasdist::TensorSpec spec;
  spec.dtype = spec.wire = static_cast<DataType>(dtype);
  spec.shape = {count};
  request.tensors.push_back(spec);
  return Answer(RunAndWait(std::move(request), {buffer}, {buffer}, nullptr, nullptr), error, error_size);
}

// Gathers every rank's `rows` x `row_elements` values (rows may differ between ranks) into
// `output`, in rank order, and writes the number of rows gathered. A result of more than
// `output_capacity_rows` rows fails with kInvalidArgument on this rank only, after the rows
// were counted.
int kerasdist_allgather(const char* name, const void* input, int64_t rows, int64_t row_elements, int dtype,
                        void* output, int64_t output_capacity_rows, int64_t* gathered_rows, char* error,
                        int error_size) {
  const auto kind = kerasdist::OpKind::kAllgather;
  if (!IsDataType(dtype) || rows < 0 || row_elements < 0) {
    return RefuseLocally(name, kind, std::string("kerasdist: '") + name + "' has an unknown dtype or a negative size",
                         error, error_size);
  }
  kerasdist::Request request;
  request.name = name;
  request.kind = kind;
  kerasdist::TensorSpec spec;
  spec.dtype = spec.wire = static_cast<DataType>(dtype);
  spec.shape = {rows, row_elements};
  request.tensors.push_back(spec);
  int64_t total_rows = -1;
  // A result that does not fit lands here instead: failing the allocation would leave the
  // other ranks inside the gather without this one.
  std::vector<char> overflow;
  kerasdist::AllocateFn allocate = [&](int, const kerasdist::Shape& shape, void** data) {
    total_rows = shape[0];
    if (total_rows <= output_capacity_rows) {
      *data = output;
    } else {
      overflow.resize(kerasdist::NumElements(shape) * kerasdist::DataTypeSize(spec.dtype));
      *data = overflow.data();
    }
    return kerasdist::Status::OK();
  };
  kerasdist::Status status = RunAndWait(std::move(request), {input}, {}, std::move(allocate), nullptr);
  if (status.ok()) *gathered_rows = total_rows;
  if (status.ok() && total_rows > output_capacity_rows) {
    status = kerasdist::Status::InvalidArgument("kerasdist: allgather '" + std::string(name) + "' gathered " +
                                                std::to_string(total_rows) + " rows; the output holds " +
                                                std::to_string(output_capacity_rows));
  }
  return Answer(status, error, error_size);
}

}  // extern "C"
