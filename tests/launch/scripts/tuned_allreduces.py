"""40 allreduces of 1 MiB, enough for the tuner to time each allreduce algorithm 8 times; every
rank checks each sum against NumPy's and prints the largest difference and the sum's bytes' hash."""

import hashlib

import numpy as np

import kerasdist

kerasdist.init()
import tensorflow as tf  # noqa: E402  (after init, as a user's script does)

rank, size = kerasdist.rank(), kerasdist.size()
values = np.linspace(-1.0, 1.0, 1 << 18, dtype=np.float32)
digest = hashlib.sha256()
worst = 0.0
for step in range(40):
    mine = values * (rank + 1) + step
    reduced = kerasdist.allreduce(tf.constant(mine), op=kerasdist.Sum, name="tuned").numpy()
    expected = sum(values * (r + 1) + step for r in range(size))
    worst = max(worst, float(np.max(np.abs(reduced - expected))))
    digest.update(reduced.tobytes())
print(f"RANK {rank} WORST {worst} SUMS {digest.hexdigest()}", flush=True)
