"""TensorFlow and kerasdist setup for the collective tests, applied before any
test module imports kerasdist.

* One intra-op thread per rank: under ``mpiexec -n 3`` on a 2-core machine,
  Eigen thread pools in every rank would otherwise fight over the cores. The
  inter-op pool keeps its default, so independent collectives inside one
  tf.function still start in a nondeterministic order (what the ordering tests
  are about).
* A finite stall timeout: if a library bug makes one rank skip a collective,
  the waiting rank fails that test after a minute and the ranks fall back into
  step at the next test, instead of the whole run hanging until the per-test
  timeout kills it. Override by setting the variables yourself.
"""

import os

os.environ.setdefault("KERASDIST_STALL_WARNING_S", "20")
os.environ.setdefault("KERASDIST_STALL_TIMEOUT_S", "60")

import tensorflow as tf  # noqa: E402

tf.get_logger().setLevel("ERROR")  # retracing warnings from per-test tf.functions
try:
    tf.config.threading.set_intra_op_parallelism_threads(1)
except RuntimeError:  # the TF context already started; harmless
    pass
