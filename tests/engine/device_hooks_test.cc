// How the engine routes device (GPU) collectives, checked without a GPU: a stand-in device
// registered through DeviceHooks (MPI on a communicator of its own, over host memory that orders
// after the front end as CUDA memory does), so that this program can check
// that negotiation carries the device (a tensor on a GPU on one rank and on the CPU on another
// fails on every rank), that GPU requests reach the executor and CPU ones do not, that the
// executor is created once, on every rank in the same cycle, that it waits for each input's
// producer before reading, and that a request the hooks refuse on one rank fails on all.
// Run under mpiexec; prints one line per failed check. tests/engine/test_device_hooks.py builds it.
#include <mpi.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <future>
#include <string>
#include <vector>

#include "engine.h"
#include "host_memory.h"
#include "mpi_backend.h"
#include "mpi_control_plane.h"

namespace kd = kerasdist;

namespace {

int g_rank = 0;
int g_size = 1;
int g_checks = 0, g_failures = 0;

void Check(bool ok, const std::string& what) {
  ++g_checks;
  if (ok) return;
  std::printf("rank %d: FAILED: %s\n", g_rank, what.c_str());
  std::fflush(stdout);
  ++g_failures;
}

char g_stream;  // what the stand-in memory passes as its "stream"
std::atomic<int> g_created{0};
std::vector<std::string> g_ran_on_device;  // engine thread only, read after each wait

MPI_Comm g_device_comm;  // the stand-in backend's own, as NCCL's communicator would be

// The stand-in device: MPI on a communicator of its own, over host memory that orders after the
// front end as CUDA memory does (through the collective's wait_for_framework).
class RecordingBackend : public kd::MpiBackend {
 public:
  RecordingBackend() : kd::MpiBackend(g_device_comm, 0) {}
  kd::Status Allreduce(const void* in, void* out, int64_t count, kd::DataType dtype, kd::ReduceOp op, double scale,
                       const std::string& name) override {
    g_ran_on_device.push_back(name);
    return kd::MpiBackend::Allreduce(in, out, count, dtype, op, scale, name);
  }
};

class StreamOrderedMemory : public kd::HostMemory {
 public:
  StreamOrderedMemory() : kd::HostMemory(0, nullptr) {}
  kd::Status OrderAfterFrontEnd(kd::Collective* c) override {
    return c->device.wait_for_framework ? c->device.wait_for_framework(&g_stream) : kd::Status::OK();
  }
};

kd::DeviceHooks StandInHooks() {
  kd::DeviceHooks hooks;
  hooks.check = [](const kd::Request& request, const kd::DeviceTensors& device) {
    if (device.ordinal != g_rank) return kd::Status::Internal("the kernel's device ordinal did not arrive");
    if (request.name == "refused_on_rank_0" && g_rank == 0) return kd::Status::InvalidArgument("refused by the hooks");
    return kd::Status::OK();
  };
  hooks.create = [](kd::ControlPlane* control_plane, kd::Watchdog*, const kd::EngineOptions&,
                    std::unique_ptr<kd::Backend>* backend, std::unique_ptr<kd::TensorMemory>* memory) {
    ++g_created;
    // Collective here, as NCCL's setup is: a rank that had not come in this cycle would hang it.
    bool every_rank = false;
    kd::Status agreed = kd::AllRanksAgree(control_plane, true, &every_rank);
    if (!agreed.ok()) return agreed;
    if (!every_rank) return kd::Status::Internal("AllRanksAgree: not every rank agreed");
    *backend = std::make_unique<RecordingBackend>();
    *memory = std::make_unique<StreamOrderedMemory>();
    return kd::Status::OK();
  };
  return hooks;
}

struct Call {
  std::vector<float> input, output;
  std::promise<kd::Status> done;
  std::future<kd::Status> result = done.get_future();
  bool waited_for_inputs = false;
  kd::Status enqueued;
};

// An allreduce (Sum) of four floats, rank + 1 each, on `device`.
void Enqueue(Call* call, const std::string& name, kd::Device device) {
  call->input.assign(4, static_cast<float>(g_rank + 1));
  call->output.assign(4, 0.0f);
  kd::Request request;
  request.name = name;
  request.kind = kd::OpKind::kAllreduce;
  request.reduce_op = kd::ReduceOp::kSum;
  request.tensors.push_back({kd::DataType::kFloat32, {4}, kd::DataType::kFloat32});
  request.device = device;
  kd::DeviceTensors tensors;
  if (device == kd::Device::kGpu) {
    tensors.ordinal = g_rank;
    tensors.wait_for_framework = [call](void* stream) {
      call->waited_for_inputs = stream == &g_stream;
      return kd::Status::OK();
    };
  }
  auto allocate = [call](int, const kd::Shape&, void** data) {
    *data = call->output.data();
    return kd::Status::OK();
  };
  auto alias = [](int, kd::FusionBuffer*, size_t, const kd::Shape&) { return kd::Status::OK(); };
  auto done = [call](const kd::Status& s) { call->done.set_value(s); };
  call->enqueued = kd::Engine::Get().Enqueue(request, {call->input.data()}, {}, allocate, alias, done, tensors);
  if (!call->enqueued.ok()) call->done.set_value(call->enqueued);
}

kd::Status Wait(Call* call, const std::string& name) {
  if (call->result.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    std::printf("rank %d: FAILED: '%s' did not complete in 60 s\n", g_rank, name.c_str());
    std::fflush(stdout);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  return call->result.get();
}

bool Summed(const Call& call) {
  const float expected = g_size * (g_size + 1) / 2.0f;
  for (float v : call.output) {
    if (v != expected) return false;
  }
  return true;
}

void CheckDeviceCollectivesReachTheExecutor() {
  Call gpu, cpu;
  Enqueue(&gpu, "on_gpu", kd::Device::kGpu);
  Enqueue(&cpu, "on_cpu", kd::Device::kCpu);
  const kd::Status gpu_status = Wait(&gpu, "on_gpu"), cpu_status = Wait(&cpu, "on_cpu");
  Check(gpu_status.ok() && Summed(gpu), "GPU allreduce through the executor: " + gpu_status.message);
  Check(cpu_status.ok() && Summed(cpu), "CPU allreduce beside it: " + cpu_status.message);
  Check(gpu.waited_for_inputs, "the executor did not wait for the GPU inputs on its stream");
  Check(g_ran_on_device == std::vector<std::string>{"on_gpu"}, "the executor ran other than exactly 'on_gpu'");
  Call again;
  Enqueue(&again, "on_gpu_again", kd::Device::kGpu);
  const kd::Status again_status = Wait(&again, "on_gpu_again");
  Check(again_status.ok() && Summed(again), "a second GPU allreduce: " + again_status.message);
  Check(g_created == 1, "the executor was created " + std::to_string(g_created.load()) + " times, not once");
}

void CheckMismatchedDevicesFailEverywhere() {
  Call call;
  Enqueue(&call, "mismatched", g_rank == 0 ? kd::Device::kGpu : kd::Device::kCpu);
  const kd::Status s = Wait(&call, "mismatched");
  const std::string expected = "kerasdist: mismatched device for 'mismatched': rank 0 sent a tensor on GPU; rank";
  Check(s.code == kd::StatusCode::kFailedPrecondition && s.message.rfind(expected, 0) == 0,
        "mismatched devices gave: " + s.message);
}

void CheckARefusalOnOneRankFailsAll() {
  Call call;
  Enqueue(&call, "refused_on_rank_0", kd::Device::kGpu);
  const kd::Status s = Wait(&call, "refused_on_rank_0");
  if (g_rank == 0) {
    Check(call.enqueued.code == kd::StatusCode::kInvalidArgument, "rank 0's refusal: " + call.enqueued.message);
  } else {
    Check(!s.ok() && s.message.find("refused by the hooks") != std::string::npos,
          "the other ranks learned of rank 0's refusal: " + s.message);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  MPI_Comm_dup(MPI_COMM_WORLD, &g_device_comm);
  std::printf("LAUNCH_PID rank=%d pid=%d\n", g_rank, static_cast<int>(getpid()));
  std::fflush(stdout);
  kd::Engine::Get().SetDeviceHooks(StandInHooks());
  kd::EngineOptions options;
  options.cycle_time_ms = 1;
  options.stall_timeout_s = 0;
  options.mismatch_timeout_s = 5;
  options.collective_timeout_s = 60;
  options.cache_capacity = 64;
  options.log_level = 2;
  const kd::Status started = kd::Engine::Get().Start(options, kd::MakeMpiTransport);
  Check(started.ok(), "Start: " + started.message);
  if (started.ok()) {
    CheckDeviceCollectivesReachTheExecutor();
    if (g_size > 1) {
      CheckMismatchedDevicesFailEverywhere();
      CheckARefusalOnOneRankFailsAll();
    }
    kd::Engine::Get().Shutdown();
  }
  MPI_Finalize();
  std::printf("rank %d: %s, %d of %d checks failed\n", g_rank, g_failures > 0 ? "FAILED" : "passed", g_failures,
              g_checks);
  return g_failures > 0 ? 1 : 0;
}
