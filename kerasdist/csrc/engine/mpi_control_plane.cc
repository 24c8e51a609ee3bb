#include "mpi_control_plane.h"

#include <cstring>

#include "mpi_backend.h"
#include "watchdog.h"

namespace kerasdist {
namespace {

// Point-to-point tags of the stall inspector's messages on the engine's communicator.
constexpr int kTagOf[] = {17, 18};  // by StallMessage

void AbortWorld() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  // MPI_Abort on the world asks the launcher to end every rank (see EndJob).
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, 1);
}

// MPI_Op of an AND with sums (MpiControlPlane::exchange_): ANDs the words and adds the floats of
// each element of `in` into `inout`. Commutative in both parts, so every rank's result is the same.
void AndWordsAddFloats(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* theirs = static_cast<const uint64_t*>(in);
  auto* mine = static_cast<uint64_t*>(inout);
  for (int element = 0; element < *len; ++element) {
    const uint64_t words = mine[0], floats = mine[1];
    for (uint64_t w = 0; w < words; ++w) mine[2 + w] &= theirs[2 + w];
    const auto* their_sums = reinterpret_cast<const float*>(theirs + 2 + words);
    auto* sums = reinterpret_cast<float*>(mine + 2 + words);
    for (uint64_t f = 0; f < floats; ++f) sums[f] += their_sums[f];
    const uint64_t element_words = 2 + words + (floats + 1) / 2;
    theirs += element_words;
    mine += element_words;
  }
}

}  // namespace

MpiControlPlane::MpiControlPlane(MPI_Comm comm) : comm_(comm) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  for (Outbox& outbox : outboxes_) {
    outbox.requests.assign(size_, MPI_REQUEST_NULL);
    outbox.values = std::make_unique<int64_t[]>(size_);
  }
  MPI_Op_create(AndWordsAddFloats, /*commute=*/1, &and_with_sum_);
}

MpiControlPlane::~MpiControlPlane() {
  for (Outbox& outbox : outboxes_) {
    bool undelivered = false;
    for (MPI_Request& request : outbox.requests) {
      if (request == MPI_REQUEST_NULL) continue;
      int done = 0;
      MPI_Test(&request, &done, MPI_STATUS_IGNORE);
      if (done) continue;
      MPI_Request_free(&request);
      undelivered = true;
    }
    // MPI may still read a freed send's buffer: a message to a gone peer keeps its 8 bytes.
    if (undelivered) outbox.values.release();
  }
}

std::vector<std::string> MpiControlPlane::HostNames() {
  char mine[MPI_MAX_PROCESSOR_NAME] = {};
  int length = 0;
  MPI_Get_processor_name(mine, &length);
  std::vector<char> all(static_cast<size_t>(MPI_MAX_PROCESSOR_NAME) * size_);
  MPI_Allgather(mine, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, comm_);
  std::vector<std::string> hosts;
  for (int r = 0; r < size_; ++r) {
    const char* name = all.data() + static_cast<size_t>(r) * MPI_MAX_PROCESSOR_NAME;
    hosts.emplace_back(name, strnlen(name, MPI_MAX_PROCESSOR_NAME));
  }
  return hosts;
}

Status MpiControlPlane::StartBitwiseAnd(uint64_t* words, size_t count, float* sums, size_t sum_count) {
  result_words_ = nullptr;
  if (sum_count == 0) {
    const int code = MPI_Iallreduce(MPI_IN_PLACE, words, static_cast<int>(count), MPI_UINT64_T, MPI_BAND, comm_,
                                    &and_request_);
    return MpiStatus(code, "negotiation", "(cycle)");
  }
  const size_t element_words = 2 + count + (sum_count + 1) / 2;
  if (exchange_.size() != element_words) {
    if (exchange_type_ != MPI_DATATYPE_NULL) MPI_Type_free(&exchange_type_);
    MPI_Type_contiguous(static_cast<int>(element_words), MPI_UINT64_T, &exchange_type_);
    MPI_Type_commit(&exchange_type_);
  }
  exchange_.assign(element_words, 0);
  exchange_[0] = count;
  exchange_[1] = sum_count;
  std::memcpy(exchange_.data() + 2, words, count * sizeof(uint64_t));
  std::memcpy(exchange_.data() + 2 + count, sums, sum_count * sizeof(float));
  result_words_ = words;
  result_sums_ = sums;
  const int code = MPI_Iallreduce(MPI_IN_PLACE, exchange_.data(), 1, exchange_type_, and_with_sum_, comm_,
                                  &and_request_);
  return MpiStatus(code, "negotiation", "(cycle)");
}

Status MpiControlPlane::TestBitwiseAnd(bool* done) {
  int flag = 0;
  const int code = MPI_Test(&and_request_, &flag, MPI_STATUS_IGNORE);
  *done = flag != 0;
  if (*done && code == MPI_SUCCESS && result_words_) {
    const size_t count = exchange_[0], sum_count = exchange_[1];
    std::memcpy(result_words_, exchange_.data() + 2, count * sizeof(uint64_t));
    std::memcpy(result_sums_, exchange_.data() + 2 + count, sum_count * sizeof(float));
    result_words_ = nullptr;
  }
  return MpiStatus(code, "negotiation", "(cycle)");
}

Status MpiControlPlane::GatherToRoot(const std::vector<char>& mine, std::vector<std::vector<char>>* gathered) {
  int my_size = static_cast<int>(mine.size());
  std::vector<int> sizes(rank_ == 0 ? size_ : 0);
  int code = MPI_Gather(&my_size, 1, MPI_INT, sizes.data(), 1, MPI_INT, 0, comm_);
  if (code != MPI_SUCCESS) return MpiStatus(code, "the slow-path negotiation", "(gather)");
  std::vector<int> displs(sizes.size(), 0);
  std::vector<char> all;
  if (rank_ == 0) {
    for (int r = 1; r < size_; ++r) displs[r] = displs[r - 1] + sizes[r - 1];
    all.resize(static_cast<size_t>(displs.back()) + sizes.back());
  }
  code = MPI_Gatherv(mine.data(), my_size, MPI_BYTE, all.data(), sizes.data(), displs.data(), MPI_BYTE, 0, comm_);
  if (code != MPI_SUCCESS) return MpiStatus(code, "the slow-path negotiation", "(gather)");
  if (rank_ == 0) {
    gathered->assign(size_, {});
    for (int r = 0; r < size_; ++r) (*gathered)[r].assign(all.begin() + displs[r], all.begin() + displs[r] + sizes[r]);
  }
  return Status::OK();
}

Status MpiControlPlane::BroadcastFromRoot(std::vector<char>* bytes) {
  int length = static_cast<int>(bytes->size());
  int code = MPI_Bcast(&length, 1, MPI_INT, 0, comm_);
  if (code != MPI_SUCCESS) return MpiStatus(code, "the slow-path negotiation", "(broadcast)");
  bytes->resize(length);
  code = MPI_Bcast(bytes->data(), length, MPI_BYTE, 0, comm_);
  return MpiStatus(code, "the slow-path negotiation", "(broadcast)");
}

void MpiControlPlane::Post(int peer, StallMessage kind, int64_t value) {
  Outbox& outbox = outboxes_[static_cast<int>(kind)];
  MPI_Request& request = outbox.requests[peer];
  if (request != MPI_REQUEST_NULL) {
    int done = 0;
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (!done) return;
  }
  outbox.values[peer] = value;
  // Not a blocking send: one to a peer whose process died while its host stays up never returned
  // (MPICH over TCP, under srun, which leaves the other tasks running).
  MPI_Isend(&outbox.values[peer], 1, MPI_INT64_T, peer, kTagOf[static_cast<int>(kind)], comm_, &request);
}

bool MpiControlPlane::Receive(int* peer, StallMessage* kind, int64_t* value) {
  int flag = 0;
  MPI_Status status;
  MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &flag, &status);
  if (!flag) return false;
  MPI_Recv(value, 1, MPI_INT64_T, status.MPI_SOURCE, status.MPI_TAG, comm_, MPI_STATUS_IGNORE);
  *peer = status.MPI_SOURCE;
  *kind = status.MPI_TAG == kTagOf[static_cast<int>(StallMessage::kReply)] ? StallMessage::kReply
                                                                           : StallMessage::kQuestion;
  return true;
}

Status MakeMpiTransport(const EngineOptions& options, Transport* transport) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return Status::FailedPrecondition("kerasdist: MPI is not initialized");
  int provided = 0;
  MPI_Query_thread(&provided);
  if (provided < MPI_THREAD_MULTIPLE) {
    return Status::FailedPrecondition(
        "kerasdist: MPI was initialized without MPI_THREAD_MULTIPLE; let kerasdist.init() "
        "initialize MPI (or set mpi4py.rc.thread_level = 'multiple')");
  }
  // Never freed: after a stall the communicator may still hold an unfinished negotiation, and
  // freeing it then would be erroneous; MPI_Finalize takes it.
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  AllreduceAlgorithm algorithm;
  Status chosen = AllreduceAlgorithm::Make(comm, options.allreduce_algorithm, &algorithm);
  if (!chosen.ok()) return chosen;
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  SetLogging(options.log_level, rank);  // as the engine will: this message is logged before it starts
  if (rank == 0) {
    const bool unavailable =
        (options.allreduce_algorithm == AllreduceChoice::kRing && !algorithm.ring_available()) ||
        (options.allreduce_algorithm == AllreduceChoice::kHierarchical && !algorithm.hierarchy_available());
    Log(unavailable ? 2 : 1, "%s", algorithm.Describe().c_str());
  }
  transport->control_plane = std::make_unique<MpiControlPlane>(comm);
  transport->backend = std::make_unique<MpiBackend>(comm, options.fusion_threshold_bytes, algorithm);
  SetJobAbort(AbortWorld);
  return Status::OK();
}

}  // namespace kerasdist
