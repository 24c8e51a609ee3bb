// One rank's collective while the engine holds it: the request, the front end's buffers and
// callbacks, and how running it went.
#pragma once

#include <functional>
#include <vector>

#include "common.h"

namespace kerasdist {

// Where a collective's device tensors are, and how to order work after the front end's own.
struct DeviceTensors {
  int ordinal = -1;  // the CUDA device holding inputs and outputs
  // Makes `stream` (a cudaStream_t on that device) wait, without blocking the calling thread,
  // for everything the front end has enqueued on its stream so far: the producers of the inputs,
  // and the last users of memory it has just handed out for an output (its allocator reuses
  // memory in its stream's order). Call it before reading inputs and after each allocation.
  std::function<Status(void* stream)> wait_for_framework;
};

struct Collective {
  Request request;
  std::string signature;  // RequestSignature(request): what the response cache compares
  std::vector<const void*> inputs;
  std::vector<void*> outputs;
  AllocateFn allocate;
  AliasFn alias;
  DoneFn done;
  DeviceTensors device;  // request.device == kGpu only
  Clock::time_point enqueued;
  bool reported = false;  // sent to rank 0 through the slow path
  Status status;          // first failure while running
  // A joined rank's stand-in for another rank's allreduce: zeros in, result dropped.
  bool zeros = false;
  std::vector<char> zero_input, zero_output;
  int contributors = 0;  // ranks whose data went in (an Average divides by it); set when it runs

  void Fail(const Status& s) {
    if (status.ok()) status = s;
  }
  // What a reduced output of `dtype` is multiplied by: the postscale, divided by the
  // contributors for a float Average.
  double FinishScale(DataType dtype) const;
  // Applies FinishScale, or an integer Average's division, to `count` reduced values in `out`.
  void FinishOutput(int index, void* out, int64_t count) const;
};

}  // namespace kerasdist
