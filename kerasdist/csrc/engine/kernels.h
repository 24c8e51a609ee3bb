// The loops the engine runs over tensor data: scaling, and combining 16-bit floats. They are
// memory-bound on large tensors when vectorized, and several times slower when not (float16
// through MPI's user-defined reductions measured 8.6 ms per million values here, against
// 1.14 ms for float32 with MPI's builtin SUM), so each is written to vectorize and the x86
// ones pick AVX2/F16C at run time where the CPU has them.
#pragma once

#include <cstdint>

#include "common.h"

namespace kerasdist {

// dst[i] = src[i] * factor for float types (dst may be src); a plain copy for integers and
// for factor 1.
void ScaledCopy(void* dst, const void* src, int64_t count, DataType dtype, double factor);
void ScaleInPlace(void* data, int64_t count, DataType dtype, double factor);
// Integer Average: data[i] /= divisor, truncating toward zero like C and TensorFlow.
void DivideIntegersInPlace(void* data, int64_t count, DataType dtype, int64_t divisor);

// dst[i] = scale * (sources[0][i] op sources[1][i] op ...) for float16 or bfloat16 values,
// accumulated in float32 and rounded to 16 bits once (more accurate than rounding after every
// pairwise step, as a reduction in 16-bit arithmetic would). Average is Sum here: its 1/size
// belongs in `scale`. Min and Max propagate NaN (see Extremum). `dst` may be one of the sources.
void CombineHalves(const uint16_t* const* sources, int source_count, uint16_t* dst, int64_t count,
                   DataType dtype, ReduceOp op, double scale);

// Compression: dst (float16 or bfloat16 `wire`) = src (float32 or float64 `dtype`) * scale,
// rounded to nearest even; and back, dst (`dtype`) = src (`wire`) * scale.
void CompressCopy(uint16_t* dst, DataType wire, const void* src, DataType dtype, int64_t count, double scale);
void DecompressCopy(void* dst, DataType dtype, const uint16_t* src, DataType wire, int64_t count, double scale);

// The Min/Max every rank evaluates alike: a NaN always wins (as NumPy's minimum and maximum
// propagate it) and becomes the one canonical quiet NaN; other values compare by a total
// order in which -0.0 < +0.0, so the result does not depend on the order of the operands.
template <typename F>
F Extremum(F a, F b, bool want_max);

}  // namespace kerasdist
