"""Allreduce throughput: kerasdist against raw MPI (mpi4py) on the same bytes.

How to run (every rank runs this file; rank 0 prints the tables):

  .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/allreduce.py

  # The fusion threshold is read once, at init, so the unfused baseline of the
  # 160-tensor case is a second invocation:
  .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/allreduce.py --only=many
  .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/allreduce.py --only=many \
      --fusion_threshold=0

What is measured
  sizes  float32 tensors of 4 KiB .. 64 MiB. Ours: kd.allreduce(op=kd.Sum) in a
         tf.function that loops N times (tf.range), so Python costs nothing per
         op; each allreduce depends on the previous one, as in a real step.
         Raw: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM) on a NumPy array in
         a Python loop. N is calibrated per side to take about --target_ms.
         Time per op = slowest rank's time / N, median of --repeats.
         "ours/raw" = raw time / our time = our bandwidth / raw bandwidth
         (1.00 is parity, below 1 we are slower). GB/s = bytes / time / 1e9.
  many   160 float32 tensors of 64 KiB (10 MiB) per step: 160 independent
         kd.allreduce ops in one tf.function (fused up to the threshold) and one
         kd.grouped_allreduce, against 160 raw Allreduce calls and one raw
         Allreduce of a flat 10 MiB buffer.

TensorFlow runs with one intra-op and one inter-op thread per rank, the way a
rank per core is deployed on these machines.
"""

import argparse
import json
import os
import statistics
import sys
import time

KIB = 1024
DEFAULT_SIZES_KIB = [4, 64, 1024, 4 * 1024, 16 * 1024, 64 * 1024]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes_kib", type=int, nargs="+", default=DEFAULT_SIZES_KIB,
                        help="float32 tensor sizes in KiB (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed repeats per measurement; the median is reported")
    parser.add_argument("--target_ms", type=float, default=250.0,
                        help="wall time one timed repeat should take (sets N)")
    parser.add_argument("--max_iters", type=int, default=5000,
                        help="upper bound on N, the allreduces per timed repeat")
    parser.add_argument("--many_tensors", type=int, default=160)
    parser.add_argument("--many_tensor_kib", type=int, default=64)
    parser.add_argument("--only", choices=["sizes", "many", "all"], default="all")
    parser.add_argument("--fusion_threshold", type=int, default=None,
                        help="sets KERASDIST_FUSION_THRESHOLD (bytes; 0 = no fusion) "
                             "before kerasdist starts; default: leave the environment alone")
    parser.add_argument("--json", default=None, help="rank 0 also writes results here")
    return parser.parse_args()


ARGS = parse_args()
if ARGS.fusion_threshold is not None:
    os.environ["KERASDIST_FUSION_THRESHOLD"] = str(ARGS.fusion_threshold)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import kerasdist as kd  # noqa: E402

kd.init()
from mpi4py import MPI  # noqa: E402  (after kerasdist: it owns MPI initialisation)

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def say(*parts):
    if RANK == 0:
        print(*parts, flush=True)


def slowest(seconds):
    """Per-repeat time is the slowest rank's: a collective is done when all are."""
    return COMM.allreduce(seconds, op=MPI.MAX)


def timed(fn, iters):
    COMM.Barrier()
    start = time.perf_counter()
    fn(iters)
    return slowest(time.perf_counter() - start)


def calibrate(fn):
    """Iterations per repeat so one repeat takes about --target_ms (same on all ranks)."""
    fn(2)  # warm up: tracing, buffer allocation, connection setup
    probe = 1
    while True:  # grow the probe until it is long enough to time
        seconds = timed(fn, probe)
        if seconds >= 0.02 or probe >= ARGS.max_iters:
            break
        probe *= 4
    iters = int(ARGS.target_ms / 1e3 / max(seconds / probe, 1e-7))
    return COMM.bcast(min(max(iters, 3), ARGS.max_iters), root=0)


def median_per_op(fn):
    iters = calibrate(fn)
    return statistics.median(timed(fn, iters) / iters for _ in range(ARGS.repeats)), iters


# ------------------------------------------------------------- sizes

@tf.function
def chained_allreduce(x, iters):
    for _ in tf.range(iters):
        x = kd.allreduce(x, op=kd.Sum)
    return x


def check_ours(elems):
    x = tf.fill([elems], float(RANK + 1))
    got = kd.allreduce(x, op=kd.Sum).numpy()
    if not np.all(got == SIZE * (SIZE + 1) / 2):
        raise SystemExit(f"rank {RANK}: wrong allreduce result for {elems} floats")


def bench_sizes():
    rows = []
    say(f"\nallreduce float32, {SIZE} ranks: time per op (median of {ARGS.repeats}), "
        "slowest rank")
    say(f"{'size':>9} {'raw us':>10} {'ours us':>10} {'ours/raw':>9} "
        f"{'raw GB/s':>9} {'ours GB/s':>10} {'N raw':>6} {'N ours':>7}")
    for kib in ARGS.sizes_kib:
        elems = kib * KIB // 4
        nbytes = elems * 4
        check_ours(elems)

        buf = np.zeros(elems, np.float32)

        def raw(iters, buf=buf):
            for _ in range(iters):
                COMM.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

        x = tf.zeros([elems], tf.float32)  # zeros: the sum never overflows

        def ours(iters, x=x):
            chained_allreduce(x, tf.constant(iters, tf.int32))

        raw_s, raw_n = median_per_op(raw)
        ours_s, ours_n = median_per_op(ours)
        row = dict(size_bytes=nbytes, raw_s=raw_s, ours_s=ours_s, ratio=raw_s / ours_s,
                   raw_gbps=nbytes / raw_s / 1e9, ours_gbps=nbytes / ours_s / 1e9,
                   raw_iters=raw_n, ours_iters=ours_n)
        rows.append(row)
        say(f"{human(nbytes):>9} {raw_s * 1e6:10.1f} {ours_s * 1e6:10.1f} {row['ratio']:9.2f} "
            f"{row['raw_gbps']:9.2f} {row['ours_gbps']:10.2f} {raw_n:6d} {ours_n:7d}")
    return rows


# -------------------------------------------------------------- many

def bench_many():
    count, elems = ARGS.many_tensors, ARGS.many_tensor_kib * KIB // 4
    total = count * elems * 4
    threshold = os.environ.get("KERASDIST_FUSION_THRESHOLD", "unset (library default)")
    tensors = [tf.fill([elems], float(RANK + 1)) for _ in range(count)]

    @tf.function
    def separate(*xs):
        return [kd.allreduce(x, op=kd.Sum) for x in xs]

    @tf.function
    def grouped(*xs):
        return kd.grouped_allreduce(list(xs), op=kd.Sum)

    for outs in (separate(*tensors), grouped(*tensors)):  # check and trace once
        if not all(np.all(o.numpy() == SIZE * (SIZE + 1) / 2) for o in outs):
            raise SystemExit(f"rank {RANK}: wrong result in the {count}-tensor step")

    bufs = [np.zeros(elems, np.float32) for _ in range(count)]
    flat = np.zeros(count * elems, np.float32)

    def raw_separate(steps):
        for _ in range(steps):
            for b in bufs:
                COMM.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM)

    def raw_flat(steps):
        for _ in range(steps):
            COMM.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)

    def ours_separate(steps):
        for _ in range(steps):
            separate(*tensors)

    def ours_grouped(steps):
        for _ in range(steps):
            grouped(*tensors)

    say(f"\n{count} x {human(elems * 4)} float32 per step ({human(total)}), {SIZE} ranks, "
        f"KERASDIST_FUSION_THRESHOLD={threshold}: time per step (median of {ARGS.repeats})")
    results = {}
    for label, fn in (("raw: one Allreduce per tensor", raw_separate),
                      ("raw: one flat buffer", raw_flat),
                      (f"kerasdist: {count} kd.allreduce in one tf.function", ours_separate),
                      ("kerasdist: kd.grouped_allreduce", ours_grouped)):
        seconds, steps = median_per_op(fn)
        results[label] = seconds
        say(f"  {label:<52} {seconds * 1e3:9.2f} ms  {total / seconds / 1e9:6.2f} GB/s"
            f"  (N={steps})")
    return dict(threshold=threshold, tensors=count, tensor_bytes=elems * 4,
                step_seconds=results)


def human(nbytes):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def main():
    say(f"kerasdist allreduce benchmark: {SIZE} ranks, MPI: "
        f"{MPI.Get_library_version().splitlines()[0].strip()}, TF {tf.__version__}")
    results = {"ranks": SIZE}
    if ARGS.only in ("sizes", "all"):
        results["sizes"] = bench_sizes()
    if ARGS.only in ("many", "all"):
        results["many"] = bench_many()
    if RANK == 0 and ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
