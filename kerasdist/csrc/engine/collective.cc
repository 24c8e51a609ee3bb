#include "collective.h"

#include "kernels.h"

namespace kerasdist {

double Collective::FinishScale(DataType dtype) const {
  const bool divides = request.reduce_op == ReduceOp::kAverage && IsFloatingPoint(dtype);
  return divides ? request.postscale / contributors : request.postscale;
}

void Collective::FinishOutput(int index, void* out, int64_t count) const {
  const DataType dtype = request.tensors[index].dtype;
  if (request.reduce_op == ReduceOp::kAverage && !IsFloatingPoint(dtype)) {
    DivideIntegersInPlace(out, count, dtype, contributors);
  }
  ScaleInPlace(out, count, dtype, FinishScale(dtype));
}

}  // namespace kerasdist
