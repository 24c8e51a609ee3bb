"""Every rank moves 64 MiB allreduces until the job ends; rank 0 creates the file named by the
first argument once the ranks have moved a few, so that the test knows data crosses the links.
Expected to be ended by a fault the test makes, never to finish by itself."""

import itertools
import os
import sys
from pathlib import Path

import tensorflow as tf

import kerasdist as kd

kd.init()
print(f"LAUNCH_PID rank={kd.rank()} pid={os.getpid()}", flush=True)
big = tf.ones([16 * 2**20])
for step in itertools.count():
    kd.allreduce(big, op=kd.Sum, name="big")
    if step == 3 and kd.rank() == 0:
        Path(sys.argv[1]).touch()
