#include "common.h"

#include <pthread.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <sstream>

namespace kerasdist {
namespace {

int g_log_level = 2;
int g_log_rank = 0;

}  // namespace

void SetLogging(int level, int rank) {
  g_log_level = level;
  g_log_rank = rank;
}

void NameThisThread(const char* name) {
#ifdef __linux__
  pthread_setname_np(pthread_self(), name);
#else
  (void)name;
#endif
}

void Log(int level, const char* fmt, ...) {
  if (level < g_log_level) return;
  static const char* kNames[] = {"DEBUG", "INFO", "WARNING", "ERROR"};
  char message[2048];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(message, sizeof(message), fmt, args);
  va_end(args);
  std::fprintf(stderr, "[kerasdist rank %d] %s: %s\n", g_log_rank, kNames[std::min(level, 3)], message);
  std::fflush(stderr);
}

size_t DataTypeSize(DataType dtype) {
  switch (dtype) {
    case DataType::kUInt8: case DataType::kInt8: case DataType::kBool: return 1;
    case DataType::kFloat16: case DataType::kBFloat16: return 2;
    case DataType::kInt32: case DataType::kFloat32: return 4;
    case DataType::kInt64: case DataType::kFloat64: return 8;
  }
  return 0;
}

const char* DataTypeName(DataType dtype) {
  switch (dtype) {
    case DataType::kUInt8: return "uint8";
    case DataType::kInt8: return "int8";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kBool: return "bool";
  }
  return "unknown";
}

const char* OpKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kAllreduce: return "allreduce";
    case OpKind::kAllgather: return "allgather";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kReducescatter: return "reducescatter";
    case OpKind::kAlltoall: return "alltoall";
    case OpKind::kJoin: return "join";
  }
  return "unknown";
}

const char* DeviceName(Device device) {
  switch (device) {
    case Device::kCpu: return "CPU";
    case Device::kGpu: return "GPU";
  }
  return "unknown";
}

const char* AllreduceChoiceName(AllreduceChoice choice) {
  switch (choice) {
    case AllreduceChoice::kMpi: return "mpi";
    case AllreduceChoice::kRing: return "ring";
    case AllreduceChoice::kAuto: return "auto";
    case AllreduceChoice::kHierarchical: return "hierarchical";
  }
  return "?";
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kAverage: return "Average";
    case ReduceOp::kSum: return "Sum";
    case ReduceOp::kMin: return "Min";
    case ReduceOp::kMax: return "Max";
    case ReduceOp::kProduct: return "Product";
  }
  return "unknown";
}

bool IsFloatingPoint(DataType dtype) {
  return dtype == DataType::kFloat16 || dtype == DataType::kBFloat16 ||
         dtype == DataType::kFloat32 || dtype == DataType::kFloat64;
}

int64_t NumElements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeString(const Shape& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

}  // namespace kerasdist
