"""Rank 0 waits in broadcast_object and rank 1 in barrier; both catch the stall timeout.

Run with KERASDIST_MISMATCH_TIMEOUT_S=0 (so the stall path, not the mismatch check, ends
the wait), KERASDIST_STALL_WARNING_S=1 and KERASDIST_STALL_TIMEOUT_S=3. Expected: stall
warnings that name both calls, both ranks catch tf.errors.DeadlineExceededError and carry
on to the end, and the job still ends non-zero.
"""
import os
import sys
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
    sys.stdout.write(f"RESULT rank={kd.rank()} completed\n")
except tf.errors.DeadlineExceededError:
    sys.stdout.write(f"RESULT rank={kd.rank()} DeadlineExceededError\n")
print(f"CAUGHT_AT={time.time()}", flush=True)
sys.stdout.write(f"RANK_DONE rank={kd.rank()}\n")
