"""Rank 0 waits in broadcast_object and rank 1 in barrier; both catch the stall timeout.

Run with KERASDIST_MISMATCH_TIMEOUT_S=0 (so the stall path, not the mismatch check, ends
the wait), KERASDIST_STALL_WARNING_S=1 and KERASDIST_STALL_TIMEOUT_S=3. Expected: stall
warnings that name both calls, both ranks catch tf.errors.DeadlineExceededError and carry
on to the end, and the job still ends non-zero.
"""

import os
import time

import tensorflow as tf

import kerasdist as kd

kd.init()
print(f"LAUNCH_PID rank={kd.rank()} pid={os.getpid()}", flush=True)
kd.barrier()
try:
    if kd.rank() == 0:
        kd.broadcast_object("nobody receives this")
    else:
        kd.barrier()
    print(f"RESULT rank={kd.rank()} completed", flush=True)
except tf.errors.DeadlineExceededError:
    print(f"RESULT rank={kd.rank()} DeadlineExceededError", flush=True)
print(f"CAUGHT_AT={time.time()}", flush=True)
print(f"RANK_DONE rank={kd.rank()}", flush=True)
