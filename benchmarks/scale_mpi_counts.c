/* A PMPI counting shim: loaded with LD_PRELOAD in front of libmpi, it counts, per MPI function
   the engine calls, the calls and the bytes this rank puts in and gets out, separately for each
   phase the program names with MPI_Pcontrol(phase) (0: not counted, as the standard says).
   At MPI_Finalize every rank writes $SCALE_COUNTS_DIR/rank<r>.tsv.

   Bytes and messages are the call's own, not its algorithm's: an MPI_Allreduce of n bytes puts
   in n and gets out n however MPICH moves them (PMPI sees the API, not MPICH's internal sends).
   A rooted collective's root exchanges one message with each other rank (Gatherv: it receives
   P-1, the bytes of all of them); point-to-point calls are one message each.
   benchmarks/scale_counts.py builds it (gcc -shared) and reads the files. */
#include <mpi.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

enum { kPhases = 8 };
enum Function {
  F_IALLREDUCE, F_ALLREDUCE, F_GATHER, F_GATHERV, F_BCAST, F_ISEND, F_RECV, F_IPROBE, F_TEST,
  F_ALLGATHER, F_ALLGATHERV, F_ALLTOALL, F_ALLTOALLV, F_REDUCE_SCATTER, F_COUNT
};
static const char* const kNames[F_COUNT] = {
    "MPI_Iallreduce", "MPI_Allreduce", "MPI_Gather",    "MPI_Gatherv",   "MPI_Bcast",
    "MPI_Isend",      "MPI_Recv",      "MPI_Iprobe",    "MPI_Test",      "MPI_Allgather",
    "MPI_Allgatherv", "MPI_Alltoall",  "MPI_Alltoallv", "MPI_Reduce_scatter"};

struct Count {
  long long calls, bytes_in, bytes_out, messages_in, messages_out;
};
static struct Count g_counts[kPhases][F_COUNT];
static volatile int g_phase = 0; /* the engine's thread counts too: reads of an int are atomic */

static long long Bytes(long long count, MPI_Datatype type) {
  int size = 0;
  PMPI_Type_size(type, &size);
  return count * size;
}

static int Size(MPI_Comm comm) {
  int size = 1;
  PMPI_Comm_size(comm, &size);
  return size;
}

static int Rank(MPI_Comm comm) {
  int rank = 0;
  PMPI_Comm_rank(comm, &rank);
  return rank;
}

static void Add(enum Function f, long long bytes_in, long long bytes_out, long long messages_in,
                long long messages_out) {
  const int phase = g_phase;
  if (phase <= 0 || phase >= kPhases) return;
  struct Count* c = &g_counts[phase][f];
  __atomic_fetch_add(&c->calls, 1, __ATOMIC_RELAXED);
  __atomic_fetch_add(&c->bytes_in, bytes_in, __ATOMIC_RELAXED);
  __atomic_fetch_add(&c->bytes_out, bytes_out, __ATOMIC_RELAXED);
  __atomic_fetch_add(&c->messages_in, messages_in, __ATOMIC_RELAXED);
  __atomic_fetch_add(&c->messages_out, messages_out, __ATOMIC_RELAXED);
}

int MPI_Pcontrol(const int level, ...) {
  g_phase = level;
  return MPI_SUCCESS;
}

int MPI_Iallreduce(const void* in, void* out, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm,
                   MPI_Request* request) {
  Add(F_IALLREDUCE, Bytes(count, type), Bytes(count, type), 0, 0);
  return PMPI_Iallreduce(in, out, count, type, op, comm, request);
}

int MPI_Allreduce(const void* in, void* out, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm) {
  Add(F_ALLREDUCE, Bytes(count, type), Bytes(count, type), 0, 0);
  return PMPI_Allreduce(in, out, count, type, op, comm);
}

int MPI_Gather(const void* in, int in_count, MPI_Datatype in_type, void* out, int out_count, MPI_Datatype out_type,
               int root, MPI_Comm comm) {
  const int size = Size(comm);
  if (Rank(comm) == root) {
    Add(F_GATHER, Bytes((long long)out_count * (size - 1), out_type), 0, size - 1, 0);
  } else {
    Add(F_GATHER, 0, Bytes(in_count, in_type), 0, 1);
  }
  return PMPI_Gather(in, in_count, in_type, out, out_count, out_type, root, comm);
}

int MPI_Gatherv(const void* in, int in_count, MPI_Datatype in_type, void* out, const int out_counts[],
                const int displacements[], MPI_Datatype out_type, int root, MPI_Comm comm) {
  const int size = Size(comm), rank = Rank(comm);
  if (rank == root) {
    long long total = 0;
    for (int r = 0; r < size; ++r) total += r == root ? 0 : out_counts[r];
    Add(F_GATHERV, Bytes(total, out_type), 0, size - 1, 0);
  } else {
    Add(F_GATHERV, 0, Bytes(in_count, in_type), 0, 1);
  }
  return PMPI_Gatherv(in, in_count, in_type, out, out_counts, displacements, out_type, root, comm);
}

int MPI_Bcast(void* buffer, int count, MPI_Datatype type, int root, MPI_Comm comm) {
  const int size = Size(comm);
  if (Rank(comm) == root) {
    Add(F_BCAST, 0, Bytes(count, type), 0, size - 1);
  } else {
    Add(F_BCAST, Bytes(count, type), 0, 1, 0);
  }
  return PMPI_Bcast(buffer, count, type, root, comm);
}

int MPI_Isend(const void* buffer, int count, MPI_Datatype type, int peer, int tag, MPI_Comm comm,
              MPI_Request* request) {
  Add(F_ISEND, 0, Bytes(count, type), 0, 1);
  return PMPI_Isend(buffer, count, type, peer, tag, comm, request);
}

int MPI_Recv(void* buffer, int count, MPI_Datatype type, int peer, int tag, MPI_Comm comm, MPI_Status* status) {
  Add(F_RECV, Bytes(count, type), 0, 1, 0);
  return PMPI_Recv(buffer, count, type, peer, tag, comm, status);
}

int MPI_Iprobe(int peer, int tag, MPI_Comm comm, int* flag, MPI_Status* status) {
  Add(F_IPROBE, 0, 0, 0, 0);
  return PMPI_Iprobe(peer, tag, comm, flag, status);
}

int MPI_Test(MPI_Request* request, int* flag, MPI_Status* status) {
  Add(F_TEST, 0, 0, 0, 0);
  return PMPI_Test(request, flag, status);
}

int MPI_Allgather(const void* in, int in_count, MPI_Datatype in_type, void* out, int out_count, MPI_Datatype out_type,
                  MPI_Comm comm) {
  Add(F_ALLGATHER, Bytes((long long)out_count * (Size(comm) - 1), out_type), Bytes(in_count, in_type), 0, 0);
  return PMPI_Allgather(in, in_count, in_type, out, out_count, out_type, comm);
}

int MPI_Allgatherv(const void* in, int in_count, MPI_Datatype in_type, void* out, const int out_counts[],
                   const int displacements[], MPI_Datatype out_type, MPI_Comm comm) {
  const int size = Size(comm), rank = Rank(comm);
  long long total = 0;
  for (int r = 0; r < size; ++r) total += r == rank ? 0 : out_counts[r];
  Add(F_ALLGATHERV, Bytes(total, out_type), Bytes(out_counts[rank], out_type), 0, 0);
  return PMPI_Allgatherv(in, in_count, in_type, out, out_counts, displacements, out_type, comm);
}

int MPI_Alltoall(const void* in, int in_count, MPI_Datatype in_type, void* out, int out_count, MPI_Datatype out_type,
                 MPI_Comm comm) {
  const int others = Size(comm) - 1;
  Add(F_ALLTOALL, Bytes((long long)out_count * others, out_type), Bytes((long long)in_count * others, in_type), 0, 0);
  return PMPI_Alltoall(in, in_count, in_type, out, out_count, out_type, comm);
}

int MPI_Alltoallv(const void* in, const int in_counts[], const int in_displacements[], MPI_Datatype in_type, void* out,
                  const int out_counts[], const int out_displacements[], MPI_Datatype out_type, MPI_Comm comm) {
  const int size = Size(comm), rank = Rank(comm);
  long long sent = 0, received = 0;
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    sent += in_counts[r];
    received += out_counts[r];
  }
  Add(F_ALLTOALLV, Bytes(received, out_type), Bytes(sent, in_type), 0, 0);
  return PMPI_Alltoallv(in, in_counts, in_displacements, in_type, out, out_counts, out_displacements, out_type, comm);
}

int MPI_Reduce_scatter(const void* in, void* out, const int counts[], MPI_Datatype type, MPI_Op op, MPI_Comm comm) {
  const int size = Size(comm), rank = Rank(comm);
  long long total = 0;
  for (int r = 0; r < size; ++r) total += counts[r];
  Add(F_REDUCE_SCATTER, Bytes(counts[rank], type), Bytes(total, type), 0, 0);
  return PMPI_Reduce_scatter(in, out, counts, type, op, comm);
}

int MPI_Finalize(void) {
  const char* dir = getenv("SCALE_COUNTS_DIR");
  if (dir != NULL) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/rank%d.tsv", dir, Rank(MPI_COMM_WORLD));
    FILE* file = fopen(path, "w");
    if (file != NULL) {
      fprintf(file, "phase\tfunction\tcalls\tbytes_in\tbytes_out\tmessages_in\tmessages_out\n");
      for (int p = 1; p < kPhases; ++p) {
        for (int f = 0; f < F_COUNT; ++f) {
          const struct Count* c = &g_counts[p][f];
          if (c->calls == 0) continue;
          fprintf(file, "%d\t%s\t%lld\t%lld\t%lld\t%lld\t%lld\n", p, kNames[f], c->calls, c->bytes_in, c->bytes_out,
                  c->messages_in, c->messages_out);
        }
      }
      fclose(file);
    }
  }
  return PMPI_Finalize();
}
