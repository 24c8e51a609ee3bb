"""Rank 1 dies by SIGKILL while rank 0 waits in an allreduce.

Expected: the whole job ends quickly with a non-zero status.
"""

import os
import signal
import time

import tensorflow as tf

import kerasdist as kd

kd.init()
print(f"LAUNCH_PID rank={kd.rank()} pid={os.getpid()}", flush=True)
kd.allreduce(tf.constant([1.0]), op=kd.Sum, name="warmup")

if kd.rank() == 1:
    time.sleep(0.5)  # let rank 0 get into the allreduce
    print(f"FAIL_AT={time.time()}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

kd.allreduce(tf.constant([1.0]), op=kd.Sum, name="never_completes")
print("RANK0_FINISHED", flush=True)
