"""The collectives and the negotiation at many ranks, checked against values each rank computes
from (rank, size) alone. Each rank prints SCALE {"rank", "size", "checks", "failures"}.

Run with a small KERASDIST_FUSION_THRESHOLD and KERASDIST_CACHE_CAPACITY (see
tests/multihost/test_scale_out.py) so that fusion, splitting, and cache evictions (requests
falling back from the bit-vector fast path to rank 0's slow path) all happen.
"""

import json
import sys

import numpy as np
import tensorflow as tf

import kerasdist as kd

kd.init()
RANK, SIZE = kd.rank(), kd.size()
failures = []
checks = 0


def check(label, got, expected):
    global checks
    checks += 1
    if not np.array_equal(np.asarray(got), np.asarray(expected)):
        failures.append(f"{label}: got {np.asarray(got).ravel()[:6]}, expected {np.asarray(expected).ravel()[:6]}")


def triangle(n):
    return n * (n + 1) // 2


# Reduce ops and dtypes: rank r sends r + 1 (integers and quarters, exact in every dtype here).
for dtype in (tf.int32, tf.int64, tf.float32, tf.float64):
    sent = tf.fill([5], tf.cast(RANK + 1, dtype))
    check(f"Sum {dtype.name}", kd.allreduce(sent, op=kd.Sum).numpy(), np.full(5, triangle(SIZE)))
    check(f"Min {dtype.name}", kd.allreduce(sent, op=kd.Min).numpy(), np.ones(5))
    check(f"Max {dtype.name}", kd.allreduce(sent, op=kd.Max).numpy(), np.full(5, SIZE))
quarters = tf.fill([3], 0.25 * (RANK + 1))
check(
    "Average float64",
    kd.allreduce(tf.cast(quarters, tf.float64), op=kd.Average).numpy(),
    np.full(3, 0.25 * (SIZE + 1) / 2),
)

# A gradient-like group: small tensors fused, one larger than the threshold split in pieces.
shapes = [(7,), (3, 5), (1000,), (64, 64), (300_000,)]
group = kd.grouped_allreduce([tf.fill(s, float(RANK + i)) for i, s in enumerate(shapes)], op=kd.Sum)
for i, (shape, out) in enumerate(zip(shapes, group)):
    check(f"grouped tensor {i}", out.numpy(), np.full(shape, SIZE * i + triangle(SIZE - 1), np.float32))

# Other collectives.
gathered = kd.allgather(tf.fill([RANK + 1, 2], RANK))
check("allgather", gathered.numpy()[:, 0], np.concatenate([np.full(r + 1, r) for r in range(SIZE)]))
check("broadcast from the last rank", kd.broadcast(tf.constant([RANK, 7]), root_rank=SIZE - 1).numpy(), [SIZE - 1, 7])
scattered = kd.reducescatter(tf.reshape(tf.range(2 * SIZE * 3, dtype=tf.float32), [2 * SIZE, 3]), op=kd.Sum)
check(
    "reducescatter",
    scattered.numpy(),
    SIZE * np.arange(2 * SIZE * 3, dtype=np.float32).reshape(2 * SIZE, 3)[2 * RANK : 2 * RANK + 2],
)
check("alltoall", kd.alltoall(tf.fill([SIZE], RANK)).numpy(), np.arange(SIZE))


# Ordering race: many independent allreduces in one step, started in any order on each rank; run
# several steps so that the later ones take the fast path (or, past the cache capacity, churn).
@tf.function
def many_independent(step):
    return [kd.allreduce(tf.fill([4], tf.cast(step * 100 + i + RANK, tf.float32)), op=kd.Sum) for i in range(40)]


for step in range(4):
    for i, out in enumerate(many_independent(tf.constant(step))):
        check(f"independent {i} at step {step}", out.numpy(), np.full(4, SIZE * (step * 100 + i) + triangle(SIZE - 1)))

# A disagreement is an error on every rank, naming the tensor, and the world goes on.
try:
    kd.allreduce(tf.zeros([2 + (RANK == SIZE - 1)]), op=kd.Sum, name="scale_check_mismatch")
    failures.append("a shape mismatch raised nothing")
except tf.errors.FailedPreconditionError as error:
    checks += 1
    if "scale_check_mismatch" not in str(error):
        failures.append(f"mismatch error does not name the tensor: {error}")
check("after the error", kd.allreduce(tf.constant([1.0]), op=kd.Sum).numpy(), [float(SIZE)])
check("every rank took part", sorted(kd.allgather_object(RANK)), list(range(SIZE)))

sys.stdout.write("SCALE " + json.dumps({"rank": RANK, "size": SIZE, "checks": checks, "failures": failures}) + "\n")
kd.barrier()
