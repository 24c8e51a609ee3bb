"""Repeated named allreduces whose shapes keep changing, under a tiny response cache.

Run with KERASDIST_CACHE_CAPACITY=2 so fast-path entries are evicted, reused and
invalidated (a cached name arriving with a new shape) all the time. Prints CHURN_OK
when every result matched the NumPy sum.
"""

import numpy as np
import tensorflow as tf

import kerasdist as kd

kd.init()
rank, size = kd.rank(), kd.size()


@tf.function(reduce_retracing=False)
def step(tensors):
    return [kd.allreduce(t, op=kd.Sum, name=f"churn_{i}") for i, t in enumerate(tensors)]


for iteration in range(40):
    length = 3 + iteration // 5  # every name changes shape every 5 iterations
    tensors = [tf.fill([length + i], float(rank * 100 + iteration + i)) for i in range(5)]
    for i, result in enumerate(step(tensors)):
        expected = sum(r * 100 + iteration + i for r in range(size))
        assert np.array_equal(result.numpy(), np.full([length + i], expected, np.float32)), (iteration, i)
print("CHURN_OK", flush=True)
