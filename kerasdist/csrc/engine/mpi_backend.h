// MPI specifics: datatype and reduction mapping (with our own reductions for the 16-bit
// float types MPI lacks) and the scaling applied around a reduction.
#pragma once

#include <mpi.h>

#include "common.h"

namespace kerasdist {

// Creates the user-defined reductions for 16-bit floats once, after MPI_Init. They live
// until MPI_Finalize.
void CreateMpiReductions();

MPI_Datatype ToMpiType(DataType dtype);
MPI_Op ToMpiOp(ReduceOp op, DataType dtype);

// data[i] *= factor for float types (no-op for factor == 1).
void ScaleInPlace(void* data, int64_t count, DataType dtype, double factor);
// dst[i] = src[i] * factor for float types; plain copy otherwise.
void ScaledCopy(void* dst, const void* src, int64_t count, DataType dtype, double factor);
// Integer Average: data[i] /= divisor, truncating toward zero like C and TensorFlow.
void DivideIntegersInPlace(void* data, int64_t count, DataType dtype, int64_t divisor);

std::string MpiErrorString(int code);

}  // namespace kerasdist
