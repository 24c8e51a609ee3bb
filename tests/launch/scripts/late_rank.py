"""The last rank submits a named allreduce argv[1] seconds after the others.

Prints, on every rank: LATE_RESULT=<the sum, or the error's class> and LATE_SECONDS=<how long
the call took>.
"""

import os
import sys
import time

import tensorflow as tf

import kerasdist as kd

kd.init()
print(f"LAUNCH_PID rank={kd.rank()} pid={os.getpid()}", flush=True)
kd.allreduce(tf.constant([1.0]), op=kd.Sum, name="warmup")  # every rank is up

if kd.rank() == kd.size() - 1:
    time.sleep(float(sys.argv[1]))
start = time.monotonic()
try:
    result = float(kd.allreduce(tf.constant([1.0]), op=kd.Sum, name="late_tensor")[0])
except tf.errors.OpError as error:
    result = type(error).__name__
print(f"LATE_RESULT={result}", flush=True)
print(f"LATE_SECONDS={time.monotonic() - start:.3f}", flush=True)
