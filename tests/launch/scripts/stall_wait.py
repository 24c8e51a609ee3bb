"""Rank 0 waits in one allreduce, the other ranks in another, until the stall timeout; rank 0
timestamps each line its engine writes to stderr, counted from the start of its call.

Run with KERASDIST_MISMATCH_TIMEOUT_S=0, KERASDIST_STALL_WARNING_S=2 and KERASDIST_STALL_TIMEOUT_S=6.
Expected: stall warnings (rank 0 sees both names) whose "waiting N s" is no more than the time
rank 0 had actually waited when the line was written.
"""

import os
import threading
import time

import tensorflow as tf

import kerasdist as kd

kd.init()
print(f"LAUNCH_PID rank={kd.rank()} pid={os.getpid()}", flush=True)
kd.barrier()
called = [None]

if kd.rank() == 0:
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)  # the engine's own stderr lines come through here

    def timestamp_stderr():
        with os.fdopen(read_end, errors="replace") as lines:
            for line in lines:
                at = time.monotonic() - called[0] if called[0] is not None else -1.0
                print(f"STDERR_AT {at:.3f} {line.rstrip()}", flush=True)

    threading.Thread(target=timestamp_stderr, daemon=True).start()

called[0] = time.monotonic()
try:
    kd.allreduce(tf.constant([1.0]), op=kd.Sum, name="only_on_rank_0" if kd.rank() == 0 else "only_on_other_ranks")
except tf.errors.DeadlineExceededError:
    pass
print(f"RANK_DONE rank={kd.rank()} waited={time.monotonic() - called[0]:.3f}", flush=True)
time.sleep(0.2)  # lets the reader thread pass on the last lines
