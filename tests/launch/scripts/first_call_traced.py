"""The job's first collective runs inside a tf.function, so kerasdist starts while
TensorFlow traces it. Each rank prints TRACED_OK when every result is right; any failed
check raises."""

import numpy as np
import tensorflow as tf

import kerasdist as kd


@tf.function
def collectives(x):
    return (
        kd.allreduce(x, op=kd.Sum),
        kd.grouped_allreduce([x, 2 * x], op=kd.Average),
        kd.allgather(x),
        kd.broadcast(x, root_rank=0),
    )


x = tf.constant([1.0, -2.0, 3.5])
total, (mean, mean_doubled), gathered, broadcast = collectives(x)
size = kd.size()
np.testing.assert_array_equal(total.numpy(), size * x.numpy())
np.testing.assert_array_equal(mean.numpy(), x.numpy())
np.testing.assert_array_equal(mean_doubled.numpy(), 2 * x.numpy())
np.testing.assert_array_equal(gathered.numpy(), np.tile(x.numpy(), size))
np.testing.assert_array_equal(broadcast.numpy(), x.numpy())
print(f"TRACED_OK rank={kd.rank()}", flush=True)
