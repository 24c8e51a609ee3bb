#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "half.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define KD_X86 1
// The widest loops are compiled twice, for AVX2 and for any x86-64, and the loader picks one.
#define KD_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define KD_X86 0
#define KD_VECTOR_CLONES
#endif

namespace kerasdist {

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
template float Extremum<float>(float, float, bool);
template double Extremum<double>(double, double, bool);

namespace {

// 16-bit values are combined in float32 blocks small enough to stay in L1 between passes.
constexpr int64_t kBlock = 2048;

// ---------------------------------------------------------------- scaling

KD_VECTOR_CLONES void ScaleFloats(float* dst, const float* src, int64_t n, double factor) {
  // In double, as before: the result is the float nearest src * factor, whatever the factor.
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(static_cast<double>(src[i]) * factor);
}

KD_VECTOR_CLONES void ScaleDoubles(double* dst, const double* src, int64_t n, double factor) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * factor;
}

template <typename T>
void DivideTyped(T* p, int64_t n, int64_t divisor) {
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(p[i] / static_cast<T>(divisor));
}

// ---------------------------------------------------------------- 16-bit <-> float32

#if KD_X86
__attribute__((target("avx2,f16c"))) void HalvesToFloatsF16c(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  }
  for (; i < n; ++i) out[i] = HalfToFloat(in[i]);
}

__attribute__((target("avx2,f16c"))) void FloatsToHalvesF16c(const float* in, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i halves = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), halves);
  }
  for (; i < n; ++i) out[i] = FloatToHalf(in[i]);
}

const bool kHasF16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#endif

void HalvesToFloats(const uint16_t* in, float* out, int64_t n) {
#if KD_X86
  if (kHasF16c) return HalvesToFloatsF16c(in, out, n);
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = HalfToFloat(in[i]);
}

void FloatsToHalves(const float* in, uint16_t* out, int64_t n) {
#if KD_X86
  if (kHasF16c) return FloatsToHalvesF16c(in, out, n);
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = FloatToHalf(in[i]);
}

KD_VECTOR_CLONES void BFloat16sToFloats(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = BFloat16ToFloat(in[i]);
}

KD_VECTOR_CLONES void FloatsToBFloat16s(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = FloatToBFloat16(in[i]);
}

void ToFloats(DataType dtype, const uint16_t* in, float* out, int64_t n) {
  dtype == DataType::kFloat16 ? HalvesToFloats(in, out, n) : BFloat16sToFloats(in, out, n);
}

void FromFloats(DataType dtype, const float* in, uint16_t* out, int64_t n) {
  dtype == DataType::kFloat16 ? FloatsToHalves(in, out, n) : FloatsToBFloat16s(in, out, n);
}

// ---------------------------------------------------------------- combining float32 blocks

template <ReduceOp kOp>
inline float Combine(float a, float b) {
  if constexpr (kOp == ReduceOp::kMin) return Extremum(a, b, false);
  if constexpr (kOp == ReduceOp::kMax) return Extremum(a, b, true);
  if constexpr (kOp == ReduceOp::kProduct) return a * b;
  return a + b;  // Sum and Average
}

template <ReduceOp kOp>
KD_VECTOR_CLONES void CombineInto(float* acc, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] = Combine<kOp>(acc[i], x[i]);
}

KD_VECTOR_CLONES void MultiplyFloats(float* acc, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) acc[i] *= factor;
}

template <ReduceOp kOp>
void CombineHalvesWith(const uint16_t* const* sources, int source_count, uint16_t* dst, int64_t count,
                       DataType dtype, double scale) {
  alignas(64) float acc[kBlock];
  alignas(64) float next[kBlock];
  const float factor = static_cast<float>(scale);
  for (int64_t begin = 0; begin < count; begin += kBlock) {
    const int64_t n = std::min(kBlock, count - begin);
    ToFloats(dtype, sources[0] + begin, acc, n);
    for (int s = 1; s < source_count; ++s) {
      ToFloats(dtype, sources[s] + begin, next, n);
      CombineInto<kOp>(acc, next, n);
    }
    if (factor != 1.0f) MultiplyFloats(acc, n, factor);
    FromFloats(dtype, acc, dst + begin, n);
  }
}

KD_VECTOR_CLONES void DoublesToFloats(const double* in, float* out, int64_t n, double scale) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i] * scale);
}

KD_VECTOR_CLONES void FloatsToDoubles(const float* in, double* out, int64_t n, double scale) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<double>(in[i]) * scale;
}

}  // namespace

void CompressCopy(uint16_t* dst, DataType wire, const void* src, DataType dtype, int64_t count, double scale) {
  alignas(64) float block[kBlock];
  for (int64_t begin = 0; begin < count; begin += kBlock) {
    const int64_t n = std::min(kBlock, count - begin);
    const float* floats = block;
    if (dtype == DataType::kFloat64) {
      DoublesToFloats(static_cast<const double*>(src) + begin, block, n, scale);
    } else if (scale != 1.0) {
      ScaleFloats(block, static_cast<const float*>(src) + begin, n, scale);
    } else {
      floats = static_cast<const float*>(src) + begin;  // converted straight from the input
    }
    FromFloats(wire, floats, dst + begin, n);
  }
}

void DecompressCopy(void* dst, DataType dtype, const uint16_t* src, DataType wire, int64_t count, double scale) {
  alignas(64) float block[kBlock];
  for (int64_t begin = 0; begin < count; begin += kBlock) {
    const int64_t n = std::min(kBlock, count - begin);
    if (dtype == DataType::kFloat64) {
      ToFloats(wire, src + begin, block, n);
      FloatsToDoubles(block, static_cast<double*>(dst) + begin, n, scale);
    } else {
      float* out = static_cast<float*>(dst) + begin;
      ToFloats(wire, src + begin, out, n);
      if (scale != 1.0) ScaleFloats(out, out, n, scale);
    }
  }
}

void ScaledCopy(void* dst, const void* src, int64_t count, DataType dtype, double factor) {
  if (factor == 1.0 || !IsFloatingPoint(dtype)) {
    if (dst != src) std::memmove(dst, src, count * DataTypeSize(dtype));
    return;
  }
  switch (dtype) {
    case DataType::kFloat32:
      return ScaleFloats(static_cast<float*>(dst), static_cast<const float*>(src), count, factor);
    case DataType::kFloat64:
      return ScaleDoubles(static_cast<double*>(dst), static_cast<const double*>(src), count, factor);
    case DataType::kFloat16: case DataType::kBFloat16: {
      const uint16_t* from = static_cast<const uint16_t*>(src);
      return CombineHalves(&from, 1, static_cast<uint16_t*>(dst), count, dtype, ReduceOp::kSum, factor);
    }
    default: return;
  }
}

void ScaleInPlace(void* data, int64_t count, DataType dtype, double factor) {
  if (factor != 1.0) ScaledCopy(data, data, count, dtype, factor);
}

void DivideIntegersInPlace(void* data, int64_t count, DataType dtype, int64_t divisor) {
  switch (dtype) {
    case DataType::kUInt8: return DivideTyped(static_cast<uint8_t*>(data), count, divisor);
    case DataType::kInt8: return DivideTyped(static_cast<int8_t*>(data), count, divisor);
    case DataType::kInt32: return DivideTyped(static_cast<int32_t*>(data), count, divisor);
    case DataType::kInt64: return DivideTyped(static_cast<int64_t*>(data), count, divisor);
    default: return;
  }
}

void CombineHalves(const uint16_t* const* sources, int source_count, uint16_t* dst, int64_t count,
                   DataType dtype, ReduceOp op, double scale) {
  switch (op) {
    case ReduceOp::kMin: return CombineHalvesWith<ReduceOp::kMin>(sources, source_count, dst, count, dtype, scale);
    case ReduceOp::kMax: return CombineHalvesWith<ReduceOp::kMax>(sources, source_count, dst, count, dtype, scale);
    case ReduceOp::kProduct:
      return CombineHalvesWith<ReduceOp::kProduct>(sources, source_count, dst, count, dtype, scale);
    case ReduceOp::kSum: case ReduceOp::kAverage:
      return CombineHalvesWith<ReduceOp::kSum>(sources, source_count, dst, count, dtype, scale);
  }
}

}  // namespace kerasdist
