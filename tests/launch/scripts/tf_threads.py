"""Reports what kerasdist.init() did to TensorFlow's thread pools.

Usage: tf_threads.py [--ops_first] [--user_inter_op N]
  --ops_first       run a TensorFlow op before init(), so the pools already exist
  --user_inter_op   size the inter-op pool with tf.config.threading before init()
Each rank prints one line: TF_THREADS {"affinity": [...], "intra": n, "inter": n, "spinning": b}
(0 = TensorFlow's own default; spinning: whether idle pool threads spin before they sleep).
"""

import json
import os
import sys
import warnings

import tensorflow as tf
from tensorflow.python.eager import context

import kerasdist as kd

warnings.simplefilter("always")
if "--user_inter_op" in sys.argv:
    tf.config.threading.set_inter_op_parallelism_threads(int(sys.argv[sys.argv.index("--user_inter_op") + 1]))
if "--ops_first" in sys.argv:
    tf.ones(2) + 1
kd.init()
report = {
    "affinity": sorted(os.sched_getaffinity(0)),
    "intra": tf.config.threading.get_intra_op_parallelism_threads(),
    "inter": tf.config.threading.get_inter_op_parallelism_threads(),
    "spinning": not context.context().config.experimental.disable_thread_spinning,
}
print("TF_THREADS " + json.dumps(report), flush=True)
kd.barrier()
