"""Rank 0 waits for a tensor rank 1 never sends.

Run with KERASDIST_STALL_WARNING_S=1 KERASDIST_STALL_TIMEOUT_S=3. Expected: a
stall warning naming rank 1, then rank 0's allreduce fails with an error that
names the tensor; rank 1 outlives the timeout; the job then ends (the library
may abort it at exit, since the engine gave up on a negotiation).
"""

import os
import time

import tensorflow as tf

import kerasdist as kd

TENSOR = "stalled_tensor_7f3a"
kd.init()
print(f"LAUNCH_PID rank={kd.rank()} pid={os.getpid()}", flush=True)
kd.allreduce(tf.constant([1.0]), op=kd.Sum, name="warmup")

if kd.rank() == 0:
    start = time.monotonic()
    try:
        kd.allreduce(tf.constant([1.0]), op=kd.Sum, name=TENSOR)
        print("STALL_RESULT=completed", flush=True)
    except (tf.errors.FailedPreconditionError, tf.errors.DeadlineExceededError) as error:
        print(f"STALL_ERROR_AT={time.time()}", flush=True)
        print(f"STALL_RESULT={type(error).__name__}", flush=True)
        print("STALL_MESSAGE=" + " ".join(error.message.split()), flush=True)
    print(f"STALL_SECONDS={time.monotonic() - start:.3f}", flush=True)
else:
    time.sleep(8)  # never submits TENSOR; outlives rank 0's stall timeout
print(f"RANK_DONE rank={kd.rank()}", flush=True)
