#include "mpi_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "half.h"

namespace kerasdist {
namespace {

// [0] float16, [1] bfloat16; index by ReduceOp (Average and Sum share the sum).
MPI_Op g_half_ops[2][5];
// Min and Max of float32 and float64: [0] float32, [1] float64; [0] Min, [1] Max.
MPI_Op g_float_extrema[2][2];
bool g_ops_created = false;

// Min and Max that every rank evaluates alike. MPI's builtin MIN/MAX compare with < and >, so a
// NaN wins or loses depending on which operand it is, and ranks that combine in different orders
// get different answers. Here a NaN always wins (as NumPy's minimum and maximum propagate it),
// becoming the one canonical quiet NaN, and other values compare by a total order in which
// -0.0 < +0.0, so the result does not depend on the order of the operands.
template <typename F>
F Extremum(F a, F b, bool want_max) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<F>::quiet_NaN();
  using Bits = std::conditional_t<sizeof(F) == 4, int32_t, int64_t>;
  auto key = [](F x) {
    Bits bits;
    std::memcpy(&bits, &x, sizeof(F));
    return bits < 0 ? bits ^ std::numeric_limits<Bits>::max() : bits;  // negatives: reversed order
  };
  return (want_max ? key(a) > key(b) : key(a) < key(b)) ? a : b;
}

template <typename F, bool kWantMax>
void CombineExtrema(void* in, void* inout, int* len, MPI_Datatype*) {
  const F* a = static_cast<const F*>(in);
  F* b = static_cast<F*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = Extremum(a[i], b[i], kWantMax);
}

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
KD_HALF_REDUCTION(HalfMin, HalfToFloat, FloatToHalf, Extremum(x, y, false))
KD_HALF_REDUCTION(HalfMax, HalfToFloat, FloatToHalf, Extremum(x, y, true))
KD_HALF_REDUCTION(HalfProd, HalfToFloat, FloatToHalf, x * y)
KD_HALF_REDUCTION(BHalfSum, BFloat16ToFloat, FloatToBFloat16, x + y)
KD_HALF_REDUCTION(BHalfMin, BFloat16ToFloat, FloatToBFloat16, Extremum(x, y, false))
KD_HALF_REDUCTION(BHalfMax, BFloat16ToFloat, FloatToBFloat16, Extremum(x, y, true))
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
  if (g_ops_created) return;
  MPI_User_function* fns[2][5] = {
      {HalfSum, HalfSum, HalfMin, HalfMax, HalfProd},
      {BHalfSum, BHalfSum, BHalfMin, BHalfMax, BHalfProd}};
  for (int t = 0; t < 2; ++t)
    for (int op = 0; op < 5; ++op) MPI_Op_create(fns[t][op], /*commute=*/1, &g_half_ops[t][op]);
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

MPI_Op ToMpiOp(ReduceOp op, DataType dtype) {
  if (dtype == DataType::kFloat16) return g_half_ops[0][static_cast<int>(op)];
  if (dtype == DataType::kBFloat16) return g_half_ops[1][static_cast<int>(op)];
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
