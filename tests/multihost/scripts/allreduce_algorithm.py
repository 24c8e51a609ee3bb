"""Three float32 Sum allreduces of 16 MiB (random floats, whose sums round differently in different
orders): each rank checks the result against NumPy and reports a digest of its bytes, so the test
can check that every rank holds the same bits. Prints ALGORITHM {...} per rank."""

import hashlib
import json

import numpy as np
import tensorflow as tf

import kerasdist as kd

kd.init()
rank, size = kd.rank(), kd.size()
LENGTH, CALLS = 4 << 20, 3


def sent(r, call):
    return np.random.default_rng([r, call]).standard_normal(LENGTH).astype(np.float32)


digests, worst = [], 0.0
for call in range(CALLS):
    out = kd.allreduce(tf.constant(sent(rank, call)), op=kd.Sum, name=f"big{call}").numpy()
    values = np.stack([sent(r, call).astype(np.float64) for r in range(size)])
    # Each of the size - 1 additions rounds by at most half a unit in the last place of its sum.
    bound = size * np.finfo(np.float32).eps * np.abs(values).sum(axis=0)
    worst = max(worst, float(np.max(np.abs(out - values.sum(axis=0)) / bound)))
    digests.append(hashlib.sha256(out.tobytes()).hexdigest())
print("ALGORITHM " + json.dumps({"rank": rank, "digests": digests, "worst_error_of_bound": worst}), flush=True)
