// How a build with a device API (KERASDIST_WITH_NCCL=1) runs collectives of tensors in device
// (GPU) memory. The engine itself knows no device API: such a build registers DeviceHooks when
// the op library loads, and they give the engine a backend and the memory it works in, which the
// engine runs with the same Executor as host tensors. Negotiation stays the engine's, over its
// control plane, for every device.
#pragma once

#include <functional>
#include <memory>

#include "backend.h"
#include "collective.h"
#include "common.h"
#include "control_plane.h"
#include "tensor_memory.h"
#include "watchdog.h"

namespace kerasdist {

struct DeviceHooks {
  // Refuses, on the calling rank, a device request this build cannot run.
  std::function<Status(const Request& request, const DeviceTensors& device)> check;
  // Called by the engine thread when the first device collective has been negotiated: the same
  // cycle on every rank, so creating a communicator here (its id sent over `control_plane`) is
  // collective. `control_plane` and `watchdog` outlive what it makes; the engine watches the
  // backend's calls.
  std::function<Status(ControlPlane* control_plane, Watchdog* watchdog, const EngineOptions& options,
                       std::unique_ptr<Backend>* backend, std::unique_ptr<TensorMemory>* memory)>
      create;
};

}  // namespace kerasdist
