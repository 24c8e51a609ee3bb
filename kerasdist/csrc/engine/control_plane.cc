#include "control_plane.h"

#include <thread>

namespace kerasdist {

Status AllRanksAgree(ControlPlane* control_plane, bool ok, bool* every_rank) {
  uint64_t word = ok ? 1 : 0;
  Status status = control_plane->StartBitwiseAnd(&word, 1, nullptr, 0);
  for (bool done = false; status.ok() && !done;) {
    status = control_plane->TestBitwiseAnd(&done);
    if (!done) std::this_thread::yield();
  }
  *every_rank = status.ok() && word == 1;
  return status;
}

}  // namespace kerasdist
