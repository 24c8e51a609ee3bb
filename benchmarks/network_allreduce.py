"""Allreduce over a network: kerasdist against raw MPI (mpi4py) on the same link, rank side.

Every rank of a job runs this file; benchmarks/network.py starts it across emulated hosts and
prints the tables. It can also run on its own, e.g. across two real hosts:

  .venv/bin/kerasdist-run -np 2 -H node1:1,node2:1 .venv/bin/python benchmarks/network_allreduce.py \
      --json out.json

Sections (--only):
  sizes        float32 tensors of --sizes_kib, reduced with Sum and with Average. Ours:
               kd.allreduce in a tf.function loop, each op taking the previous result. Raw:
               comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM) on a NumPy array, and for Average
               also buf *= 1/size, what a user of raw MPI would write.
  many         --many_tensors float32 tensors of --many_tensor_kib: one kd.grouped_allreduce
               per step, against one raw Allreduce per tensor and one of a flat buffer. Run
               once with the default fusion threshold and once with
               KERASDIST_FUSION_THRESHOLD=0 to compare fused and unfused. The grouped step
               first runs FUSION_TUNING_STEPS times untimed, so that fusion tuning has chosen
               its threshold (benchmarks/fusion_tuning.py compares the thresholds).
  compression  kd.allreduce(op=Average) of float32 tensors of --compression_sizes_kib with
               Compression.none, fp16 and bf16, against the raw float32 Sum and against
               raw16: the MPI calls alone of a 16-bit reduction of the same tensor (Alltoall,
               then Allgather, of half the bytes), what compression can save at most.

Rank 0 writes a result file to --json (benchmarks/results.py: the run's header, then the
sections' rows, and the compression section's table as "tables": {"compression": ...}). On one
host, `make bench` measures the compression section into
benchmarks/results/network_allreduce_one_host_16bit.json:

  .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/network_allreduce.py --only compression \
      --compression_sizes_kib 16384 --repeats 7 --json benchmarks/results/network_allreduce_one_host_16bit.json

Timing (benchmarks/timing.py, shared with allreduce.py): each case runs N times back to back (N
calibrated to about --target_ms); time per op is the slowest rank's time / N; cases alternate
within each of --repeats repeats and the median is reported, with the range of the per-repeat
ratios against raw. Under the sizes table, kerasdist's time per op split by the engine thread's
phases (kd.engine_times(), as allreduce.py shows them on one host): what a link adds to the fixed
costs of negotiating and handing results back.
"""

import argparse
import os
import sys

KIB = 1024


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", nargs="+", choices=["sizes", "many", "compression"], default=["sizes", "many", "compression"]
    )
    parser.add_argument("--sizes_kib", type=int, nargs="+", default=[4, 64, 1024, 4096, 16384, 65536])
    parser.add_argument("--compression_sizes_kib", type=int, nargs="+", default=[1024, 16384])
    parser.add_argument("--many_tensors", type=int, default=160)
    parser.add_argument("--many_tensor_kib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--target_ms", type=float, default=200.0)
    parser.add_argument("--min_iters", type=int, default=2)
    parser.add_argument("--max_iters", type=int, default=2000)
    parser.add_argument("--json", default=None, help="rank 0 writes the result file here")
    return parser.parse_args()


ARGS = parse_args()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import kerasdist as kd  # noqa: E402

kd.init()
import results as result_files  # noqa: E402  (benchmarks/results.py)
from mpi4py import MPI  # noqa: E402  (after kerasdist, which starts MPI)
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
OPS = {"Sum": kd.Sum, "Average": kd.Average}


def say(text):
    if RANK == 0:
        print(text, flush=True)


HARNESS = Harness(COMM, ARGS.repeats, ARGS.target_ms, ARGS.min_iters, ARGS.max_iters)
compare = HARNESS.compare


@tf.function
def chained(x, iters, op):
    for _ in tf.range(iters):
        x = kd.allreduce(x, op=op)
    return x


@tf.function
def chained_compressed(x, iters, compression):
    for _ in tf.range(iters):
        x = kd.allreduce(x, op=kd.Average, compression=compression)
    return x


def check_sum(elems):
    got = kd.allreduce(tf.fill([elems], float(RANK + 1)), op=kd.Sum).numpy()
    if not np.all(got == SIZE * (SIZE + 1) / 2):
        raise SystemExit(f"rank {RANK}: wrong allreduce result for {elems} floats")


def raw_allreduce(buf, average):
    scale = np.float32(1.0 / SIZE)

    def run(iters):
        for _ in range(iters):
            COMM.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            if average:
                np.multiply(buf, scale, out=buf)

    return run


def bench_sizes():
    rows = []
    say(f"\nallreduce float32, {SIZE} ranks: seconds per op (median of {ARGS.repeats}, slowest rank)")
    say(f"{'op':<8} {'size':>8} {'raw':>10} {'kerasdist':>10} {'raw/ours':>9} {'range':>11} {'ours Gbit/s':>11}")
    for op_name, op in OPS.items():
        for kib in ARGS.sizes_kib:
            elems = kib * KIB // 4
            check_sum(elems)
            buf = np.zeros(elems, np.float32)
            x = tf.zeros([elems], tf.float32)
            results = compare_with_engine_phases(
                HARNESS,
                {
                    "raw": raw_allreduce(buf, op_name == "Average"),
                    "ours": lambda n, x=x, op=op: chained(x, tf.constant(n), op),
                },
                kd.engine_times,
            )
            ratio, low, high = ratio_to_raw(results, "ours")
            nbytes = elems * 4
            row = {
                "op": op_name,
                "bytes": nbytes,
                "raw_s": results["raw"]["op_s"],
                "ours_s": results["ours"]["op_s"],
                "ratio": ratio,
                "ratio_low": low,
                "ratio_high": high,
                "phases_s": results["ours"]["phases_s"],
            }
            rows.append(row)
            say(
                f"{op_name:<8} {human(nbytes):>8} {row['raw_s'] * 1e3:8.3f}ms {row['ours_s'] * 1e3:8.3f}ms "
                f"{ratio:9.2f} {low:5.2f}-{high:<5.2f} {nbytes * 8 / row['ours_s'] / 1e9:11.2f}"
            )
    say(breakdown_table([(f"{row['op']} {human(row['bytes'])}", row["raw_s"], row["phases_s"]) for row in rows]))
    return rows


def bench_many():
    shapes = [(ARGS.many_tensor_kib * KIB // 4,)] * ARGS.many_tensors
    total = sum(s[0] for s in shapes) * 4
    threshold = os.environ.get("KERASDIST_FUSION_THRESHOLD", "default")

    @tf.function
    def grouped(steps):
        xs = [tf.zeros(shape) for shape in shapes]
        for _ in tf.range(steps):
            xs = kd.grouped_allreduce(xs, op=kd.Sum)
        return xs

    outs = tf.function(
        lambda: kd.grouped_allreduce([tf.fill(s, float(RANK + i)) for i, s in enumerate(shapes)], op=kd.Sum)
    )()
    for i, out in enumerate(outs):
        if not np.all(out.numpy() == SIZE * i + SIZE * (SIZE - 1) / 2):
            raise SystemExit(f"rank {RANK}: wrong grouped result for tensor {i}")
    grouped(tf.constant(FUSION_TUNING_STEPS))
    bufs = [np.zeros(shape, np.float32) for shape in shapes]
    flat = np.zeros(total // 4, np.float32)

    def raw_per_tensor(steps):
        for _ in range(steps):
            for b in bufs:
                COMM.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM)

    results = compare(
        {
            "raw per tensor": raw_per_tensor,
            "raw flat": raw_allreduce(flat, False),
            "grouped": lambda n: grouped(tf.constant(n)),
        }
    )
    say(
        f"\n{len(shapes)} x {ARGS.many_tensor_kib} KiB ({human(total)}), KERASDIST_FUSION_THRESHOLD={threshold}: "
        f"ms per step (median of {ARGS.repeats})"
    )
    for name, r in results.items():
        say(f"  {name:<16} {r['op_s'] * 1e3:8.2f} ms")
    return {
        "threshold": threshold,
        "tensors": len(shapes),
        "bytes": total,
        "seconds": {name: r["op_s"] for name, r in results.items()},
        "samples": {name: r["samples"] for name, r in results.items()},
    }


def raw_halves(elems):
    """Alltoall, then Allgather, of `elems` 16-bit values: the bytes a 16-bit reduction moves,
    without the conversions and the sum."""
    values = np.zeros(elems - elems % SIZE, np.uint16)
    chunks = np.empty_like(values)

    def run(iters):
        for _ in range(iters):
            COMM.Alltoall(values, chunks)
            COMM.Allgather(chunks[: len(values) // SIZE], values)

    return run


def bench_compression():
    rows = []
    compressions = {"none": kd.Compression.none, "fp16": kd.Compression.fp16, "bf16": kd.Compression.bf16}
    say(f"\nallreduce(op=Average) of float32 with compression: ms per op (median of {ARGS.repeats})")
    for kib in ARGS.compression_sizes_kib:
        elems = kib * KIB // 4
        buf = np.zeros(elems, np.float32)
        x = tf.zeros([elems], tf.float32)
        cases = {"raw": raw_allreduce(buf, False), "raw16": raw_halves(elems)}
        for name, compression in compressions.items():
            cases[name] = lambda n, x=x, c=compression: chained_compressed(x, tf.constant(n), c)
        results = compare(cases)
        row = {"bytes": elems * 4, **{name: r["op_s"] for name, r in results.items()}}
        for name in ("fp16", "bf16"):  # the 16-bit time against float32's, per repeat: the cost or the gain
            per_repeat = [a / b for a, b in zip(results[name]["samples"], results["none"]["samples"])]
            row[f"{name}_over_none"] = results[name]["op_s"] / results["none"]["op_s"]
            row[f"{name}_over_none_range"] = [min(per_repeat), max(per_repeat)]
        rows.append(row)
        say(f"  {human(elems * 4):>8}: " + "  ".join(f"{name} {r['op_s'] * 1e3:.2f}" for name, r in results.items()))
    return rows


def compression_table(rows):
    """The compression rows laid out for a page: ms per op, and each 16-bit time over float32's."""

    def ratio(row, name):
        low, high = row[f"{name}_over_none_range"]
        return f"{row[f'{name}_over_none']:.2f} ({low:.2f}–{high:.2f})"

    columns = [
        "Average of float32",
        "raw MPI float32 (Sum)",
        "raw MPI, 16-bit calls only",
        "none",
        "fp16",
        "bf16",
        "fp16 time / none (range over repeats)",
        "bf16 time / none (range over repeats)",
    ]
    cells = [
        [human(row["bytes"]), *(f"{row[name] * 1e3:.2f} ms" for name in ("raw", "raw16", "none", "fp16", "bf16"))]
        + [ratio(row, "fp16"), ratio(row, "bf16")]
        for row in rows
    ]
    return {"columns": columns, "rows": cells}


def main():
    run = result_files.start_run("network_allreduce", launcher=("mpiexec", "-n", str(SIZE))) if RANK == 0 else None
    say(
        f"network_allreduce: {SIZE} ranks, {MPI.Get_library_version().splitlines()[0].strip()}, "
        f"UCX_TLS={os.environ.get('UCX_TLS', 'unset')}"
    )
    results = {"ranks": SIZE}
    if "sizes" in ARGS.only:
        results["sizes"] = bench_sizes()
    if "many" in ARGS.only:
        results["many"] = bench_many()
    if "compression" in ARGS.only:
        results["compression"] = bench_compression()
    if "compression" in results:
        results["tables"] = {"compression": compression_table(results["compression"])}
    if RANK == 0 and ARGS.json:
        result_files.write(ARGS.json, result_files.finish_run(run, **results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
