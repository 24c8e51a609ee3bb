"""Ranks that run different numbers of steps in `fit` fail within seconds, told why.

A `tf.data` filter that keeps a different number of batches per rank (and no
`uneven_steps=True`) leaves the rank that ran out waiting in an eager collective at its epoch's
end while the others wait in their next step. Before, that waited for the 60 s stall timeout
set for these tests (1800 s by default) and, where the metrics were being combined, blamed a
missing `local_metrics`.
"""

import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist as kd

kd.init()
RANK, SIZE = kd.rank(), kd.size()


@pytest.mark.skipif(SIZE < 2, reason="needs at least 2 ranks (run under mpiexec -n 2)")
def test_a_filter_that_leaves_ranks_unequal_batches_fails_every_rank_within_seconds_naming_the_cause():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=kd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    rows = np.arange(32, dtype=np.float32).reshape(16, 2)
    # Rank 0 keeps 4 of 16 rows, the others all 16: 1 batch of 4 against 4.
    keep = 4 if RANK == 0 else 16
    data = (
        tf.data.Dataset.from_tensor_slices((rows, rows[:, :1]))
        .enumerate()
        .filter(lambda i, _: i < keep)
        .map(lambda _, xy: xy)
        .batch(4)
    )
    started = time.monotonic()
    with pytest.raises(Exception) as caught:
        model.fit(data, epochs=2, shuffle=False, verbose=0, callbacks=kd.callbacks())
    waited = time.monotonic() - started
    kd.join()  # the ranks called the training step unequally often: join starts their counts alike
    message = str(caught.value)
    assert "different numbers of steps" in message, message
    assert "local_metrics" not in message, message
    # The mismatch timeout (5 s) and a few cycles, not the stall timeout (60 s here).
    assert waited < 40, f"rank {RANK} waited {waited:.1f} s"
