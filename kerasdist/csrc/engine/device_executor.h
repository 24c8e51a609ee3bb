// Runs the negotiated collectives whose tensors are in device (GPU) memory. The engine itself
// knows no device API: a build with one (KERASDIST_WITH_NCCL=1) registers DeviceHooks when the
// op library loads. Negotiation stays the engine's, over its control plane, for every device.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "collective.h"
#include "common.h"
#include "control_plane.h"
#include "timeline.h"
#include "watchdog.h"

namespace kerasdist {

class DeviceExecutor {
 public:
  virtual ~DeviceExecutor() = default;
  // Runs each collective with its response, in the order given (the same on every rank), and
  // returns once the results are in the outputs; a failure goes to the collective's status.
  virtual void Run(const std::vector<std::pair<Collective*, const Response*>>& ready) = 0;
};

struct DeviceHooks {
  // Refuses, on the calling rank, a device request this executor cannot run.
  std::function<Status(const Request& request, const DeviceTensors& device)> check;
  // Called by the engine thread when the first device collective has been negotiated: the same
  // cycle on every rank, so creating a communicator here (its id sent over `control_plane`) is
  // collective. `control_plane` and `watchdog` outlive the executor.
  std::function<Status(ControlPlane* control_plane, Watchdog* watchdog, Timeline* timeline,
                       const EngineOptions& options, std::unique_ptr<DeviceExecutor>* executor)>
      create;
};

}  // namespace kerasdist
