// The control plane over MPI, on the engine's own communicator (a duplicate of the world whose
// errors return instead of aborting), and the function that makes a job's MPI transport.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "control_plane.h"

namespace kerasdist {

class MpiControlPlane : public ControlPlane {
 public:
  // `comm` stays the caller's.
  explicit MpiControlPlane(MPI_Comm comm);
  ~MpiControlPlane() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::vector<std::string> HostNames() override;
  Status StartBitwiseAnd(uint64_t* words, size_t count, float* sums, size_t sum_count) override;
  Status TestBitwiseAnd(bool* done) override;
  Status GatherToRoot(const std::vector<char>& mine, std::vector<std::vector<char>>* gathered) override;
  Status BroadcastFromRoot(std::vector<char>* bytes) override;
  void Post(int peer, StallMessage kind, int64_t value) override;
  bool Receive(int* peer, StallMessage* kind, int64_t* value) override;

 private:
  struct Outbox {
    std::vector<MPI_Request> requests;  // per rank, MPI_REQUEST_NULL once delivered
    std::unique_ptr<int64_t[]> values;  // per rank, the message in flight
  };

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  MPI_Request and_request_ = MPI_REQUEST_NULL;
  // An AND with sums travels as one element of `exchange_type_`: a header of two words (the
  // AND's word count and the sums' count), the words, then the floats; `and_with_sum_` combines
  // two such elements. One element, so that MPI never splits the words from their header.
  std::vector<uint64_t> exchange_;
  MPI_Datatype exchange_type_ = MPI_DATATYPE_NULL;
  MPI_Op and_with_sum_ = MPI_OP_NULL;
  uint64_t* result_words_ = nullptr;  // the caller's, while an AND with sums is in flight
  float* result_sums_ = nullptr;
  Outbox outboxes_[2];  // by StallMessage
};

// Checks that MPI is initialized with MPI_THREAD_MULTIPLE, duplicates the world for the engine,
// and makes its control plane and host-memory backend (MpiBackend, with the allreduce algorithm
// that `options` asks for, AllreduceAlgorithm). Also makes EndJob end the job with MPI_Abort.
// Collective: every rank calls it, from Engine::Start.
Status MakeMpiTransport(const EngineOptions& options, Transport* transport);

}  // namespace kerasdist
