// Device collectives over NCCL: the hooks the NCCL build's front end registers with the engine.
#pragma once

#include "../engine/device_hooks.h"

namespace kerasdist {

// Checks device requests against what NCCL can run; on the first device collective, creates the
// NCCL communicator and a stream, and gives the engine NcclBackend over CUDA memory (copies on
// that stream, one preallocated fusion buffer that outputs are copied out of).
DeviceHooks NcclDeviceHooks();

}  // namespace kerasdist
