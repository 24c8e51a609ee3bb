"""Reports what kerasdist.init() learned about this rank's place and what it did to the
TensorFlow thread pools, after one allreduce across all ranks.

Each rank prints one line: TOPOLOGY {"rank", "size", "local_rank", "local_size", "cross_rank",
"cross_size", "host", "affinity", "intra", "inter", "allreduce", "one_cpu_host"} (intra /
inter: the pool sizes TensorFlow was configured with, 0 meaning its own default; one_cpu_host:
whether init() found every rank on one host without a GPU, which makes gradient buckets one).
"""

import json
import os
import socket
import sys

import tensorflow as tf

import kerasdist as kd
from kerasdist import runtime

kd.init()
total = kd.allreduce(tf.constant(float(kd.rank() + 1)), op=kd.Sum)
report = {
    "rank": kd.rank(),
    "size": kd.size(),
    "local_rank": kd.local_rank(),
    "local_size": kd.local_size(),
    "cross_rank": kd.cross_rank(),
    "cross_size": kd.cross_size(),
    "host": socket.gethostname(),
    "affinity": sorted(os.sched_getaffinity(0)),
    "intra": tf.config.threading.get_intra_op_parallelism_threads(),
    "inter": tf.config.threading.get_inter_op_parallelism_threads(),
    "allreduce": float(total.numpy()),
    "one_cpu_host": runtime.state().one_cpu_host,
}
sys.stdout.write("TOPOLOGY " + json.dumps(report) + "\n")
kd.barrier()
