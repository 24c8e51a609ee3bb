"""Allreduce throughput: kerasdist against raw MPI (mpi4py) on the same bytes.

How to run (every rank runs this file; rank 0 prints the tables):

  .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/allreduce.py --json fused.json

  # The fusion threshold is read once, at init, so the unfused case is a second
  # invocation; --compare_to prints fused against unfused:
  .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/allreduce.py --only many resnet50 \
      --fusion_threshold=0 --compare_to fused.json

What is measured
  sizes  float32 tensors of 4 KiB .. 64 MiB. Ours: kd.allreduce(op=kd.Sum) in a
         tf.function that loops (tf.range), each allreduce taking the previous
         one's result, as in a real step. Raw: comm.Allreduce(MPI.IN_PLACE, buf,
         op=MPI.SUM) on a NumPy array in a Python loop.
  many   160 float32 tensors of 64 KiB (10 MiB) per step: 160 independent
         kd.allreduce ops per loop iteration of one tf.function (fused up to the
         threshold), and one kd.grouped_allreduce of the 160, against 160 raw
         Allreduce calls and one raw Allreduce of a flat 10 MiB buffer.
  resnet50  ResNet-50's 214 gradient shapes (97.6 MiB float32) in one
         kd.grouped_allreduce per step, as DistributedOptimizer reduces them,
         against the same raw per-tensor and flat cases.

  Before the tensor lists are timed, their grouped step runs FUSION_TUNING_STEPS times
  (benchmarks/timing.py), so that fusion tuning (KERASDIST_FUSION_TUNING) has chosen its threshold.

How it is timed
  Every case runs N times back to back, N calibrated per case so that takes
  about --target_ms, at least --min_iters; time per op = the slowest rank's
  time / N. Our time includes what one tf.function call pays once: the call,
  and a first iteration whose input the caller still holds, so that it cannot
  reuse the input's memory and allocates (for 64 MiB, page faults worth about
  20 ms a call here). The cases alternate within every repeat, so a slow spell
  on this shared machine hits all of them; medians of --repeats. "ours/raw" =
  raw time / our time (1.00 is parity, below 1 we are slower), with the range
  of the per-repeat ratios.

Where the time goes
  Under each table, kerasdist's time per op (per step for the tensor lists) split by the engine
  thread's phases from kd.engine_times(), the mean of the ranks: negotiation, slow path, copy in
  (packing fused tensors), transfer (the MPI calls), outputs, hand back (TensorFlow's callbacks),
  other (bookkeeping), and `outside`, the rest of the wall time, when the engine thread had nothing
  to do: TensorFlow running the loop between ops and waking the engine. Beside them the raw MPI
  time of the same bytes (the flat buffer, for the tensor lists), the time collectives waited to
  be taken up (pickup) and the negotiation cycles per op.

TensorFlow runs with one intra-op and one inter-op thread per rank, the way a
rank per core is deployed on these machines.
"""

import argparse
import json
import os
import sys

KIB = 1024
DEFAULT_SIZES_KIB = [4, 64, 1024, 4 * 1024, 16 * 1024, 64 * 1024]
SECTIONS = ["sizes", "many", "resnet50"]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes_kib",
        type=int,
        nargs="+",
        default=DEFAULT_SIZES_KIB,
        help="float32 tensor sizes in KiB (default: %(default)s)",
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per case; the median is reported")
    parser.add_argument("--target_ms", type=float, default=250.0, help="wall time of N ops (sets N)")
    parser.add_argument("--min_iters", type=int, default=16, help="lower bound on N: spreads a call's one-off costs")
    parser.add_argument("--max_iters", type=int, default=4000, help="upper bound on N")
    parser.add_argument("--many_tensors", type=int, default=160)
    parser.add_argument("--many_tensor_kib", type=int, default=64)
    parser.add_argument("--only", choices=SECTIONS, nargs="+", default=SECTIONS, help="sections to run (default: all)")
    parser.add_argument(
        "--fusion_threshold",
        type=int,
        default=None,
        help="sets KERASDIST_FUSION_THRESHOLD (bytes; 0 = no fusion) "
        "before kerasdist starts; default: leave the environment alone",
    )
    parser.add_argument(
        "--json",
        default=None,
        help="rank 0 also writes a result file here (benchmarks/results.py; `make bench`: benchmarks/results/)",
    )
    parser.add_argument(
        "--compare_to",
        default=None,
        help="JSON of an earlier run (other fusion threshold): print this run's many-tensor times against it",
    )
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
import results as result_files  # noqa: E402  (benchmarks/results.py, beside this script)
from mpi4py import MPI  # noqa: E402  (after kerasdist: it owns MPI initialisation)
from timing import (  # noqa: E402  (benchmarks/timing.py)
    FUSION_TUNING_STEPS,
    Harness,
    breakdown_table,
    compare_with_engine_phases,
    human,
    ratio_to_raw,
)

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def say(*parts):
    if RANK == 0:
        print(*parts, flush=True)


HARNESS = Harness(COMM, ARGS.repeats, ARGS.target_ms, ARGS.min_iters, ARGS.max_iters)


def compare(cases):
    """The harness's timings; kerasdist's cases also get phases_s (timing.compare_with_engine_phases)."""
    return compare_with_engine_phases(HARNESS, cases, kd.engine_times)


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
    say(
        f"\nallreduce float32, {SIZE} ranks: time per op, median of {ARGS.repeats} "
        "(slowest rank; see the docstring for how)"
    )
    say(
        f"{'size':>9} {'raw us':>10} {'ours us':>10} {'ours/raw':>9} {'range':>11} "
        f"{'raw GB/s':>9} {'ours GB/s':>10} {'N raw':>6} {'N ours':>7}"
    )
    for kib in ARGS.sizes_kib:
        elems = kib * KIB // 4
        nbytes = elems * 4
        check_ours(elems)
        buf = np.zeros(elems, np.float32)
        x = tf.zeros([elems], tf.float32)  # zeros: the sum never overflows

        def raw(iters, buf=buf):
            for _ in range(iters):
                COMM.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

        def ours(iters, x=x):
            chained_allreduce(x, tf.constant(iters, tf.int32))

        result = compare({"raw": raw, "ours": ours})
        raw_r, ours_r = result["raw"], result["ours"]
        ratio, low, high = ratio_to_raw(result, "ours")
        row = dict(
            size_bytes=nbytes,
            raw_s=raw_r["op_s"],
            ours_s=ours_r["op_s"],
            ratio=ratio,
            ratio_low=low,
            ratio_high=high,
            raw_gbps=nbytes / raw_r["op_s"] / 1e9,
            ours_gbps=nbytes / ours_r["op_s"] / 1e9,
            raw_iters=raw_r["iters"],
            ours_iters=ours_r["iters"],
        )
        row["phases_s"] = ours_r["phases_s"]
        rows.append(row)
        say(
            f"{human(nbytes):>9} {row['raw_s'] * 1e6:10.1f} {row['ours_s'] * 1e6:10.1f} "
            f"{row['ratio']:9.2f} {low:5.2f}-{high:<5.2f} "
            f"{row['raw_gbps']:9.2f} {row['ours_gbps']:10.2f} {row['raw_iters']:6d} {row['ours_iters']:7d}"
        )
    say(breakdown_table([(human(row["size_bytes"]), row["raw_s"], row["phases_s"]) for row in rows]))
    return rows


# -------------------------------------------------------------- many


def bench_tensor_list(title, shapes, separate_ops=False):
    """A step's worth of float32 tensors, reduced by one kd.grouped_allreduce (and, with
    `separate_ops`, by one kd.allreduce each), against raw MPI per tensor and flat."""
    total = sum(int(np.prod(shape)) for shape in shapes) * 4
    threshold = os.environ.get("KERASDIST_FUSION_THRESHOLD", "unset (library default)")

    # The loops live inside tf.function, as a training step's collectives do: calling a
    # tf.function with 160 tensor arguments from Python costs more than reducing them.
    @tf.function
    def grouped(steps):
        xs = [tf.zeros(shape) for shape in shapes]
        for _ in tf.range(steps):
            xs = kd.grouped_allreduce(xs, op=kd.Sum)
        return xs

    @tf.function
    def separate(steps):
        xs = [tf.zeros(shape) for shape in shapes]
        for _ in tf.range(steps):
            xs = [kd.allreduce(x, op=kd.Sum) for x in xs]
        return xs

    @tf.function
    def grouped_check():
        return kd.grouped_allreduce([tf.fill(shape, float(RANK + i)) for i, shape in enumerate(shapes)], op=kd.Sum)

    for i, out in enumerate(grouped_check()):
        if not np.all(out.numpy() == SIZE * i + SIZE * (SIZE - 1) / 2):
            raise SystemExit(f"rank {RANK}: wrong result for tensor {i} of {title}")
    grouped(tf.constant(FUSION_TUNING_STEPS))

    bufs = [np.zeros(shape, np.float32) for shape in shapes]
    flat = np.zeros(total // 4, np.float32)

    def raw_separate(steps):
        for _ in range(steps):
            for b in bufs:
                COMM.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM)

    def raw_flat(steps):
        for _ in range(steps):
            COMM.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)

    cases = {"raw: one Allreduce per tensor": raw_separate, "raw: one flat buffer": raw_flat}
    if separate_ops:
        cases[f"kerasdist: {len(shapes)} kd.allreduce per step"] = lambda n: separate(tf.constant(n))
    cases["kerasdist: kd.grouped_allreduce"] = lambda n: grouped(tf.constant(n))
    say(
        f"\n{title}: {len(shapes)} float32 tensors, {human(total)} per step, {SIZE} ranks, "
        f"KERASDIST_FUSION_THRESHOLD={threshold}: time per step, median of {ARGS.repeats}"
    )
    results = compare(cases)
    per_tensor = results["raw: one Allreduce per tensor"]["op_s"]
    for label, r in results.items():
        say(
            f"  {label:<44} {r['op_s'] * 1e3:8.2f} ms {total / r['op_s'] / 1e9:6.2f} GB/s"
            f"  {per_tensor / r['op_s']:5.2f}x raw per tensor"
        )
    flat = results["raw: one flat buffer"]["op_s"]
    say(
        breakdown_table(
            [(label[len("kerasdist: ") :], flat, r["phases_s"]) for label, r in results.items() if "phases_s" in r]
        )
    )
    return dict(
        threshold=threshold,
        tensors=len(shapes),
        bytes=total,
        step_seconds={label: r["op_s"] for label, r in results.items()},
        step_phases_s={label: r["phases_s"] for label, r in results.items() if "phases_s" in r},
    )


def resnet50_gradient_shapes():
    from kerasdist.models import resnet50

    return [tuple(v.shape) for v in resnet50(num_classes=1000).trainable_variables]


def compare_runs(mine, path):
    """Fused against unfused: one of the two runs must have KERASDIST_FUSION_THRESHOLD=0."""
    with open(path) as f:
        earlier = json.load(f)
    for section, results in mine.items():
        other = earlier.get(section)
        if not isinstance(results, dict) or other is None:
            continue
        if "0" not in (results["threshold"], other["threshold"]):
            raise SystemExit("--compare_to needs one of the two runs at KERASDIST_FUSION_THRESHOLD=0")
        unfused, fused = (results, other) if results["threshold"] == "0" else (other, results)
        say(
            f"\n{section}: fused (KERASDIST_FUSION_THRESHOLD={fused['threshold']}) against "
            "unfused (0): unfused time / fused time"
        )
        for label, seconds in fused["step_seconds"].items():
            note = "  (the same work in both runs: drift between them)" if label.startswith("raw") else ""
            say(f"  {label:<44} {unfused['step_seconds'][label] / seconds:5.2f}{note}")


def main():
    say(
        f"kerasdist allreduce benchmark: {SIZE} ranks, MPI: "
        f"{MPI.Get_library_version().splitlines()[0].strip()}, TF {tf.__version__}"
    )
    run = result_files.start_run("allreduce", launcher=["mpiexec", "-n", str(SIZE)]) if RANK == 0 else None
    results = {"ranks": SIZE}
    if "sizes" in ARGS.only:
        results["sizes"] = bench_sizes()
    if "many" in ARGS.only:
        results["many"] = bench_tensor_list(
            f"{ARGS.many_tensors} x {ARGS.many_tensor_kib} KiB",
            [(ARGS.many_tensor_kib * KIB // 4,)] * ARGS.many_tensors,
            separate_ops=True,
        )
    if "resnet50" in ARGS.only:
        results["resnet50"] = bench_tensor_list("ResNet-50 gradients", resnet50_gradient_shapes())
    if ARGS.compare_to:
        compare_runs(results, ARGS.compare_to)
    if RANK == 0 and ARGS.json:
        result_files.write(ARGS.json, result_files.finish_run(run, repeats=ARGS.repeats, **results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
