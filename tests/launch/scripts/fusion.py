"""Many allreduces of mixed sizes and dtypes; each rank saves inputs and results
to argv[1]/rank<R>.npz. The test runs this under several
KERASDIST_FUSION_THRESHOLD values and compares the files bit for bit."""

import os
import sys

import numpy as np
import tensorflow as tf

import kerasdist as kd

kd.init()
rank = kd.rank()
print(f"LAUNCH_PID rank={rank} pid={os.getpid()}", flush=True)
sizes = np.random.default_rng(1000).integers(1, 3000, size=48)  # same on every rank
rng = np.random.default_rng(2000 + rank)  # values differ per rank
dtypes = [np.float32, np.float64, np.float16, np.int32]
inputs = []
for i in range(48):
    # Some above 4 KiB (split into pieces at a 4 KiB threshold), some above the 256 KiB
    # past which a tensor is never fused.
    n = int(sizes[i]) if i % 8 else (20_000 if i % 16 else 100_000)
    dtype = dtypes[i % len(dtypes)]
    if dtype == np.int32:
        inputs.append(rng.integers(-1000, 1000, size=n).astype(dtype))
    else:
        inputs.append(rng.standard_normal(n).astype(dtype))
tensors = [tf.constant(a) for a in inputs]
ops = [kd.Sum if i % 3 else kd.Average for i in range(len(inputs))]


@tf.function
def independent(*xs):
    return [kd.allreduce(x, op=op) for x, op in zip(xs, ops)]


results = {}
for i, out in enumerate(independent(*tensors)):
    results[f"function_{i}"] = out.numpy()
for i, out in enumerate(kd.grouped_allreduce(tensors[:16], op=kd.Sum)):
    results[f"grouped_{i}"] = out.numpy()
for i in range(0, len(tensors), 6):
    results[f"eager_{i}"] = kd.allreduce(tensors[i], op=kd.Sum).numpy()
np.savez(os.path.join(sys.argv[1], f"rank{rank}.npz"), **results, **{f"input_{i}": a for i, a in enumerate(inputs)})
print(f"FUSION_SCRIPT_DONE rank={rank}", flush=True)
