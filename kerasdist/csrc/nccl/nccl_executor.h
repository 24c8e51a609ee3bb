// Device collectives over NCCL: the hooks the NCCL build's front end registers with the engine.
#pragma once

#include "../engine/device_executor.h"

namespace kerasdist {

// Checks device requests against what NCCL can run and creates the executor, which fuses
// allreduces into a device buffer and runs every collective on a stream of its own.
DeviceHooks NcclDeviceHooks();

}  // namespace kerasdist
