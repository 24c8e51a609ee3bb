"""Rank 1 calls sys.exit(STATUS) while rank 0 waits for it in a collective.

Expected: the job ends soon with STATUS as its exit status when STATUS is not 0 (and
non-zero when it is 0: rank 0's collective can never complete); rank 0 never finishes.
"""

import os
import sys
import time

import tensorflow as tf

import kerasdist as kd

status = int(sys.argv[1])
kd.init()
print(f"LAUNCH_PID rank={kd.rank()} pid={os.getpid()}", flush=True)
kd.allreduce(tf.constant([1.0]), name="together")
if kd.rank() == 1:
    print(f"FAIL_AT={time.time()}", flush=True)
    sys.exit(status)
kd.allreduce(tf.constant([1.0]), name="rank_1_never_comes")
print("RANK0_FINISHED", flush=True)
