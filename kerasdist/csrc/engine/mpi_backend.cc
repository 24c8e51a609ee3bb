#include "mpi_backend.h"

#include <algorithm>
#include <cstring>

#include "half.h"

namespace kerasdist {
namespace {

// [0] float16, [1] bfloat16; index by ReduceOp (Average and Sum share the sum).
MPI_Op g_half_ops[2][5];
bool g_half_ops_created = false;

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float), typename Combine>
void CombineHalves(void* in, void* inout, int* len, Combine combine) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = FromF(combine(ToF(a[i]), ToF(b[i])));
}

#define KD_HALF_REDUCTION(fn_name, ToF, FromF, expr)                              \
  void fn_name(void* in, void* inout, int* len, MPI_Datatype*) {                 \
    CombineHalves<ToF, FromF>(in, inout, len, [](float x, float y) { return expr; }); \
  }
KD_HALF_REDUCTION(HalfSum, HalfToFloat, FloatToHalf, x + y)
KD_HALF_REDUCTION(HalfMin, HalfToFloat, FloatToHalf, std::min(x, y))
KD_HALF_REDUCTION(HalfMax, HalfToFloat, FloatToHalf, std::max(x, y))
KD_HALF_REDUCTION(HalfProd, HalfToFloat, FloatToHalf, x * y)
KD_HALF_REDUCTION(BHalfSum, BFloat16ToFloat, FloatToBFloat16, x + y)
KD_HALF_REDUCTION(BHalfMin, BFloat16ToFloat, FloatToBFloat16, std::min(x, y))
KD_HALF_REDUCTION(BHalfMax, BFloat16ToFloat, FloatToBFloat16, std::max(x, y))
KD_HALF_REDUCTION(BHalfProd, BFloat16ToFloat, FloatToBFloat16, x * y)
#undef KD_HALF_REDUCTION

template <typename T>
void ScaleTyped(T* dst, const T* src, int64_t n, double factor) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * factor);
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void ScaleHalves(uint16_t* dst, const uint16_t* src, int64_t n, double factor) {
  const float f = static_cast<float>(factor);
  for (int64_t i = 0; i < n; ++i) dst[i] = FromF(ToF(src[i]) * f);
}

}  // namespace

void CreateMpiReductions() {
  if (g_half_ops_created) return;
  MPI_User_function* fns[2][5] = {
      {HalfSum, HalfSum, HalfMin, HalfMax, HalfProd},
      {BHalfSum, BHalfSum, BHalfMin, BHalfMax, BHalfProd}};
  for (int t = 0; t < 2; ++t)
    for (int op = 0; op < 5; ++op) MPI_Op_create(fns[t][op], /*commute=*/1, &g_half_ops[t][op]);
  g_half_ops_created = true;
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

MPI_Op ToMpiOp(ReduceOp op, DataType dtype) {
  if (dtype == DataType::kFloat16) return g_half_ops[0][static_cast<int>(op)];
  if (dtype == DataType::kBFloat16) return g_half_ops[1][static_cast<int>(op)];
  switch (op) {
    case ReduceOp::kAverage: case ReduceOp::kSum: return MPI_SUM;
    case ReduceOp::kMin: return MPI_MIN;
    case ReduceOp::kMax: return MPI_MAX;
    case ReduceOp::kProduct: return MPI_PROD;
  }
  return MPI_SUM;
}

void ScaledCopy(void* dst, const void* src, int64_t n, DataType dtype, double factor) {
  if (factor == 1.0 || !IsFloatingPoint(dtype)) {
    if (dst != src) std::memcpy(dst, src, n * DataTypeSize(dtype));
    return;
  }
  switch (dtype) {
    case DataType::kFloat32:
      ScaleTyped(static_cast<float*>(dst), static_cast<const float*>(src), n, factor); break;
    case DataType::kFloat64:
      ScaleTyped(static_cast<double*>(dst), static_cast<const double*>(src), n, factor); break;
    case DataType::kFloat16:
      ScaleHalves<HalfToFloat, FloatToHalf>(static_cast<uint16_t*>(dst),
                                             static_cast<const uint16_t*>(src), n, factor);
      break;
    case DataType::kBFloat16:
      ScaleHalves<BFloat16ToFloat, FloatToBFloat16>(static_cast<uint16_t*>(dst),
                                                     static_cast<const uint16_t*>(src), n, factor);
      break;
    default: break;
  }
}

void ScaleInPlace(void* data, int64_t n, DataType dtype, double factor) {
  if (factor != 1.0) ScaledCopy(data, data, n, dtype, factor);
}

template <typename T>
static void DivideTyped(T* p, int64_t n, int64_t divisor) {
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(p[i] / static_cast<T>(divisor));
}

void DivideIntegersInPlace(void* data, int64_t n, DataType dtype, int64_t divisor) {
  switch (dtype) {
    case DataType::kUInt8: DivideTyped(static_cast<uint8_t*>(data), n, divisor); break;
    case DataType::kInt8: DivideTyped(static_cast<int8_t*>(data), n, divisor); break;
    case DataType::kInt32: DivideTyped(static_cast<int32_t*>(data), n, divisor); break;
    case DataType::kInt64: DivideTyped(static_cast<int64_t*>(data), n, divisor); break;
    default: break;
  }
}

std::string MpiErrorString(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, len);
}

}  // namespace kerasdist
