"""Rank 1 raises while rank 0 waits in a collective (argv[1]: allreduce|barrier).

Expected: the whole job ends quickly, non-zero, with rank 1's traceback.
"""

import os
import sys
import time

import tensorflow as tf

import kerasdist as kd

kd.init()
print(f"LAUNCH_PID rank={kd.rank()} pid={os.getpid()}", flush=True)
kd.allreduce(tf.constant([1.0]), op=kd.Sum, name="warmup")  # every rank is up

if kd.rank() == 1:
    print(f"FAIL_AT={time.time()}", flush=True)
    raise RuntimeError("deliberate failure on rank 1")

if sys.argv[1] == "allreduce":
    kd.allreduce(tf.constant([1.0]), op=kd.Sum, name="never_completes")
else:
    kd.barrier()
print("RANK0_FINISHED", flush=True)
