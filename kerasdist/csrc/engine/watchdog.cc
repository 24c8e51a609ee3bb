#include "watchdog.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <sstream>
#include <system_error>
#include <thread>

namespace kerasdist {
namespace {

std::atomic<void (*)()> g_abort_job{nullptr};

}  // namespace

void SetJobAbort(void (*abort_job)()) { g_abort_job = abort_job; }

void EndJob(const std::string& message) {
  // kerasdist-run watches for "so that the launcher ends the job" (output.py RANK_ENDS_JOB).
  Log(3, "kerasdist: %s. Ending this rank with status 1 so that the launcher ends the job.", message.c_str());
  // The job's abort (MPI_Abort on the world) asks the launcher to end every rank. A plain exit
  // with status 1 left it to notice: MPICH's hydra missed that in about 1 job in 20 (it reaped the
  // rank before seeing its PMI connection close, then never signalled the others), and a frozen
  // peer kept the job alive for ever. MPICH sends the world's abort to the launcher and to no
  // other rank; it then calls exit(), whose destructors could wait on a thread stuck in MPI, and
  // another MPI might wait elsewhere: hence the backstop.
  try {
    std::thread([] {
      std::this_thread::sleep_for(std::chrono::seconds(5));
      std::_Exit(1);
    }).detach();
  } catch (const std::system_error&) {
    // No thread to spare (EndJob also ends a rank out of memory): abort without the backstop.
  }
  // Hydra drops what a rank wrote but it has not yet read once an abort arrives (5 of 60 jobs lost
  // the line written just before; 0 of 60 with half a second between): give it time to read.
  std::this_thread::sleep_for(std::chrono::seconds(1));
  if (auto abort_job = g_abort_job.load()) abort_job();
  std::_Exit(1);
}

Watchdog::Watchdog(double timeout_s, std::string rank_and_host)
    : timeout_s_(timeout_s), rank_and_host_(std::move(rank_and_host)) {
  if (timeout_s_ > 0) thread_ = std::thread(&Watchdog::Watch, this);
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Watchdog::Arm(const char* what, const std::string* name, const char* why) {
  if (timeout_s_ <= 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = true;
  since_ = Clock::now();
  what_ = what;
  name_ = name;
  why_ = why;
}

void Watchdog::Disarm() {
  if (timeout_s_ <= 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = false;
}

void Watchdog::Watch() {
  NameThisThread("kd_watchdog");
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    cv_.wait_for(lock, std::chrono::milliseconds(500));
    if (!armed_ || Seconds(Clock::now() - since_) < timeout_s_) continue;
    std::ostringstream message;
    message.precision(1);
    message << std::fixed << what_ << (name_ ? " '" + *name_ + "'" : "") << " on rank " << rank_and_host_ << " has not finished after " << Seconds(Clock::now() - since_)
            << " s (KERASDIST_COLLECTIVE_TIMEOUT_S) " << why_ << ": a rank or the network between the ranks is gone";
    EndJob(message.str());
  }
}

Status WatchedBackend::Allreduce(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op, double scale,
                                 const std::string& name) {
  return Watched("allreduce", name, [&] { return inner_->Allreduce(in, out, count, dtype, op, scale, name); });
}

Status WatchedBackend::Allgather(const void* in, void* out, const std::vector<int64_t>& counts, DataType dtype,
                                 const std::string& name) {
  return Watched("allgather", name, [&] { return inner_->Allgather(in, out, counts, dtype, name); });
}

Status WatchedBackend::Broadcast(void* data, int64_t count, DataType dtype, int root, const std::string& name) {
  return Watched("broadcast", name, [&] { return inner_->Broadcast(data, count, dtype, root, name); });
}

Status WatchedBackend::ReduceScatter(const void* in, void* out, const std::vector<int64_t>& counts, DataType dtype,
                                     ReduceOp op, double scale, const std::string& name) {
  return Watched("reducescatter", name,
                 [&] { return inner_->ReduceScatter(in, out, counts, dtype, op, scale, name); });
}

Status WatchedBackend::Alltoall(const void* in, const std::vector<int64_t>& send_counts, void* out,
                                const std::vector<int64_t>& recv_counts, DataType dtype, const std::string& name) {
  return Watched("alltoall", name,
                 [&] { return inner_->Alltoall(in, send_counts, out, recv_counts, dtype, name); });
}

}  // namespace kerasdist
