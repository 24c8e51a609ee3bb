/* The engine's C entry points: Python reaches them through ctypes, and tests/engine/c_api_test.cc
   drives the engine through them alone, without TensorFlow. Every call that can fail returns 0,
   or a kerasdist_status value with a message written into `error` (`error_size` bytes). */
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* kerasdist::DataType, ReduceOp and StatusCode values (common.h; c_api.cc checks that they agree). */
enum kerasdist_dtype {
  KERASDIST_UINT8 = 0,
  KERASDIST_INT8 = 1,
  KERASDIST_INT32 = 2,
  KERASDIST_INT64 = 3,
  KERASDIST_FLOAT16 = 4,
  KERASDIST_BFLOAT16 = 5,
  KERASDIST_FLOAT32 = 6,
  KERASDIST_FLOAT64 = 7,
  KERASDIST_BOOL = 8,
};
enum kerasdist_reduce_op {
  KERASDIST_AVERAGE = 0,
  KERASDIST_SUM = 1,
  KERASDIST_MIN = 2,
  KERASDIST_MAX = 3,
  KERASDIST_PRODUCT = 4,
};
enum kerasdist_status {
  KERASDIST_OK = 0,
  KERASDIST_INVALID_ARGUMENT = 1,
  KERASDIST_FAILED_PRECONDITION = 2,
  KERASDIST_ABORTED = 3,
  KERASDIST_DEADLINE_EXCEEDED = 4,
  KERASDIST_INTERNAL = 5,
};

int kerasdist_start(int count, const char* const* names, const char* const* values, char* error, int error_size);
void kerasdist_shutdown(void);
void kerasdist_submit_failure(const char* name, int op_kind, const char* message);
int kerasdist_join(int* last_joined_rank, char* error, int error_size);
int kerasdist_stalled(void);
/* Where the engine thread's time went since it started: seconds per phase (idle, negotiation,
   slow_path, copy_in, transfer, outputs, hand_back, other; together the thread's wall time), then
   "pickup" (seconds collectives waited, summed, between being enqueued and a cycle taking them up),
   "cycles", "collectives" and "rode" (counts; "rode": collectives whose sums travelled with the
   negotiation, KERASDIST_PIGGYBACK_BYTES). Fills up to `capacity` names and values; returns how
   many there are. */
int kerasdist_engine_times(const char** names, double* values, int capacity);

int kerasdist_grouped_allreduce(const char* name, int tensor_count, const void* const* inputs, void* const* outputs,
                                const int64_t* counts, int dtype, int wire_dtype, int reduce_op, double prescale,
                                double postscale, char* error, int error_size);
int kerasdist_broadcast(const char* name, void* buffer, int64_t count, int dtype, int root_rank, char* error,
                        int error_size);
int kerasdist_allgather(const char* name, const void* input, int64_t rows, int64_t row_elements, int dtype,
                        void* output, int64_t output_capacity_rows, int64_t* gathered_rows, char* error,
                        int error_size);

#ifdef __cplusplus
}  /* extern "C" */
#endif
