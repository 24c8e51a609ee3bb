"""Negotiation cost per collective at one job size, rank side (benchmarks/negotiation_scaling.py
starts it at several sizes and fits the model).

Every op here is one negotiation cycle: a tf.function loop of allreduces of a single float32,
each taking the previous one's result, alternating between two op names. With the default
negotiation cache both names take the fast path (one bitwise-AND allreduce of the cache's bit
vector); with KERASDIST_CACHE_CAPACITY=1 each name evicts the other, so every op takes the slow
path (requests gathered to rank 0, validated, responses broadcast). Raw MPI: mpi4py Allreduce of
one float32 in a Python loop, the cost of the data movement alone. Rank 0 prints
NEGOTIATION {"ranks", "cache_capacity", "raw_s", "ours_s", "raw_samples", "ours_samples"}, and
with --json writes the same as a result file (benchmarks/results.py). `make bench` runs it at 2
ranks on this host, once per path:

  .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/negotiation.py --json fast.json
  KERASDIST_CACHE_CAPACITY=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/negotiation.py --json slow.json

The cache capacity is fixed when the engine starts, so the two paths are two jobs, and the costs
docs/network.md shows (fast - raw, slow - fast) are differences between them: if the machine's load
changes between the jobs by more than the slow path costs, slow - fast comes out negative.
benchmarks/render.py refuses such a pair of files, naming both medians; re-run both jobs.
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import kerasdist as kd  # noqa: E402

kd.init()
import results as result_files  # noqa: E402  (benchmarks/results.py, beside this script)
from mpi4py import MPI  # noqa: E402

COMM = MPI.COMM_WORLD


@tf.function
def alternating(x, iterations):
    for _ in tf.range(iterations):
        x = kd.allreduce(x, op=kd.Max, name="negotiation_a")
        x = kd.allreduce(x, op=kd.Max, name="negotiation_b")
    return x


def timed(fn, ops):
    COMM.Barrier()
    start = time.perf_counter()
    fn()
    return COMM.allreduce(time.perf_counter() - start, op=MPI.MAX) / ops


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=200, help="loop iterations (2 ops each) per sample")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="rank 0 also writes a result file here")
    args = parser.parse_args()
    capacity = os.environ.get("KERASDIST_CACHE_CAPACITY")
    launcher = [*([f"KERASDIST_CACHE_CAPACITY={capacity}"] if capacity else []), "mpiexec", "-n", str(COMM.size)]
    run = result_files.start_run("negotiation", launcher=launcher) if COMM.rank == 0 else None

    x = tf.constant([float(COMM.rank)])
    if float(alternating(x, tf.constant(2))[0]) != COMM.size - 1:
        raise SystemExit(f"rank {COMM.rank}: wrong allreduce result")
    buf = np.zeros(1, np.float32)

    def raw():
        for _ in range(2 * args.iterations):
            COMM.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)

    iterations = tf.constant(args.iterations)
    raw_samples, ours_samples = [], []
    for _ in range(args.repeats):
        raw_samples.append(timed(raw, 2 * args.iterations))
        ours_samples.append(timed(lambda: alternating(x, iterations), 2 * args.iterations))
    if COMM.rank == 0:
        report = {
            "ranks": COMM.size,
            "cache_capacity": int(capacity or "1024"),
            "raw_s": statistics.median(raw_samples),
            "ours_s": statistics.median(ours_samples),
            "raw_samples": raw_samples,
            "ours_samples": ours_samples,
        }
        print("NEGOTIATION " + json.dumps(report), flush=True)
        if args.json:
            result_files.write(args.json, result_files.finish_run(run, iterations=args.iterations, **report))


if __name__ == "__main__":
    main()
