"""The rank side of benchmarks/topology_allreduce.py: float32 Sum allreduces of each --sizes_kib,
raw MPI (mpi4py Allreduce in place on a NumPy array) against kerasdist (kd.allreduce in a
tf.function loop, each op taking the previous result), timed by benchmarks/timing.py's harness
(cases alternate within each repeat; slowest rank; medians). --cases raw alone imports neither
TensorFlow nor kerasdist: a job whose MPI runs every allreduce as its ring
(MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring in the environment) times raw MPI's ring that way.

Rank 0 writes {"ranks", "hosts", "sizes": [{"bytes", "raw_s", "raw_samples", "kerasdist_s",
"kerasdist_samples"}]} to --json.
"""

import argparse
import json
import os
import sys

KIB = 1024


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=["raw", "kerasdist"], default=["raw", "kerasdist"])
    parser.add_argument("--sizes_kib", type=int, nargs="+", default=[4, 64, 256, 1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--target_ms", type=float, default=200.0)
    parser.add_argument("--min_iters", type=int, default=2)
    parser.add_argument("--max_iters", type=int, default=2000)
    parser.add_argument(
        "--untimed_calls", type=int, default=0, help="kerasdist allreduces of each size before timing it (the tuner's)"
    )
    parser.add_argument("--json", required=True, help="rank 0 writes the results here")
    return parser.parse_args()


ARGS = parse_args()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402

if "kerasdist" in ARGS.cases:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import kerasdist as kd

    kd.init()

from mpi4py import MPI  # noqa: E402  (after kerasdist, which starts MPI with threads)
from timing import Harness  # noqa: E402  (benchmarks/timing.py)

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def raw_allreduce(buf):
    def run(iters):
        for _ in range(iters):
            COMM.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    return run


def kerasdist_allreduce(elems):
    @tf.function
    def chained(x, iters):
        for _ in tf.range(iters):
            x = kd.allreduce(x, op=kd.Sum)
        return x

    x = tf.zeros([elems], tf.float32)
    return lambda iters: chained(x, tf.constant(iters))


def check_sums(elems):
    """Every case's result for rank + 1 from every rank is exact: a wrong algorithm shows here."""
    expected = SIZE * (SIZE + 1) / 2
    buf = np.full(elems, RANK + 1, np.float32)
    COMM.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    right = bool(np.all(buf == expected))
    if "kerasdist" in ARGS.cases:
        right &= bool(np.all(kd.allreduce(tf.fill([elems], float(RANK + 1)), op=kd.Sum).numpy() == expected))
    if not COMM.allreduce(right, op=MPI.LAND):
        raise SystemExit(f"rank {RANK}: wrong allreduce result for {elems} floats")


def main():
    harness = Harness(COMM, ARGS.repeats, ARGS.target_ms, ARGS.min_iters, ARGS.max_iters)
    host = MPI.Get_processor_name()
    hosts = len(set(COMM.allgather(host)))
    rows = []
    for kib in ARGS.sizes_kib:
        elems = kib * KIB // 4
        check_sums(elems)
        cases = {}
        if "raw" in ARGS.cases:
            cases["raw"] = raw_allreduce(np.zeros(elems, np.float32))
        if "kerasdist" in ARGS.cases:
            cases["kerasdist"] = kerasdist_allreduce(elems)
            cases["kerasdist"](ARGS.untimed_calls)
        results = harness.compare(cases)
        row = {"bytes": elems * 4}
        for name, result in results.items():
            row[f"{name}_s"] = result["op_s"]
            row[f"{name}_samples"] = result["samples"]
        rows.append(row)
        if RANK == 0:
            print(
                f"{kib:>6} KiB: " + "  ".join(f"{n} {r['op_s'] * 1e3:.3f} ms" for n, r in results.items()), flush=True
            )
    if RANK == 0:
        with open(ARGS.json, "w") as f:
            json.dump({"ranks": SIZE, "hosts": hosts, "sizes": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
