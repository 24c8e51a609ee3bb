#include "collective.h"

#include <new>

#include "kernels.h"
#include "watchdog.h"

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

void* StandInOutput(size_t bytes, std::vector<char>* memory, const std::string& name) {
  try {
    memory->resize(bytes);
  } catch (const std::bad_alloc&) {
    EndJob("rank could not allocate " + std::to_string(bytes) + " bytes for the output of '" + name +
           "', which every rank had agreed to run, so the other ranks would wait in it for ever");
  }
  return memory->data();
}

}  // namespace kerasdist
