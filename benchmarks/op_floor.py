"""The floor under a collective's fixed cost: what TensorFlow charges per op before a byte moves,
beside kerasdist's fixed cost and the budget that a target ratio to raw MPI leaves for it.

Every case runs N ops back to back in a tf.function loop (tf.range), each op taking the previous
one's output, the way benchmarks/allreduce.py chains its allreduces, and is timed by the same
harness (benchmarks/timing.py: slowest rank, medians of --repeats, cases alternating):

  raw                  mpi4py Allreduce in place of the same bytes, in a Python loop
  raw agreement        mpi4py Allreduce of one 8-byte word: the least an agreement across ranks
                       on what is ready costs (kerasdist's negotiation is one such collective)
  TensorFlow, sync     a kernel that hands its input on and does nothing else
  TensorFlow, async    the same as an asynchronous kernel that completes before it returns:
                       the kind of kernel kerasdist's collectives are
  kerasdist            kd.allreduce, Sum

From these, per size: fixed = kerasdist - raw; budget = what a ratio of --target to raw leaves
beside the raw transfer, raw * (1 / target - 1); floor = TensorFlow async + raw agreement, the
fixed cost of an op that negotiated and moved its bytes on TensorFlow's own thread with nothing
else at all. Where the floor reaches the budget, no negotiated collective run from a TensorFlow
kernel meets the target on this machine, whatever its engine does.

The two kernels (benchmarks/op_floor_kernels.cc) are compiled on first use into build/op_floor/
with TensorFlow's own compile and link flags (the compiler is $CXX, else g++); `make bench` runs
it at 2 ranks and at 1 (where the hand-over to the engine thread is all that is left):

  .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/op_floor.py --json benchmarks/results/op_floor.json
  .venv/bin/mpiexec -n 1 .venv/bin/python benchmarks/op_floor.py --json benchmarks/results/op_floor_one_rank.json

TensorFlow runs with one intra-op and one inter-op thread per rank, as in benchmarks/allreduce.py.
"""

import argparse
import os
import pathlib
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import kerasdist as kd  # noqa: E402

kd.init()
import results as result_files  # noqa: E402  (benchmarks/results.py, beside this script)
from mpi4py import MPI  # noqa: E402
from timing import Harness, human  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
KIB = 1024
KERNEL_SOURCE = pathlib.Path(__file__).resolve().parent / "op_floor_kernels.cc"
KERNEL_DIR = result_files.REPO / "build" / "op_floor"
COMPILE_TIMEOUT_S = 300


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes_kib", type=int, nargs="+", default=[4, 1024, 4096], help="float32 sizes in KiB")
    parser.add_argument("--target", type=float, default=0.95, help="the ratio to raw whose budget is shown")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per case; the median is reported")
    parser.add_argument("--target_ms", type=float, default=250.0, help="wall time of N ops (sets N)")
    parser.add_argument("--max_iters", type=int, default=4000, help="upper bound on N")
    parser.add_argument("--json", default=None, help="rank 0 also writes a result file here")
    return parser.parse_args()


def say(text):
    if RANK == 0:
        print(text, flush=True)


def floor_kernels():
    """The op library of op_floor_kernels.cc; rank 0 compiles it if it is missing or older than
    its source, and every rank stops with the compiler's message if that fails."""
    library = KERNEL_DIR / f"kernels-tf{tf.__version__}.so"
    failure = None
    if RANK == 0 and (not library.exists() or library.stat().st_mtime < KERNEL_SOURCE.stat().st_mtime):
        KERNEL_DIR.mkdir(parents=True, exist_ok=True)
        partial = library.with_name(library.name + ".partial")  # renamed when whole
        command = [
            os.environ.get("CXX", "g++"),
            "-O2",
            "-shared",
            "-fPIC",
            str(KERNEL_SOURCE),
            "-o",
            str(partial),
            *tf.sysconfig.get_compile_flags(),
            *tf.sysconfig.get_link_flags(),
        ]
        compiled = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if compiled.returncode == 0:
            os.replace(partial, library)
        else:
            failure = f"cannot compile {KERNEL_SOURCE.name}:\n{compiled.stderr[-2000:]}"
    failure = COMM.bcast(failure, root=0)
    if failure:
        raise SystemExit(f"rank {RANK}: {failure}")
    return tf.load_op_library(str(library))


def chained(op):
    """A tf.function running `iters` ops, each on the previous one's output."""

    @tf.function
    def run(x, iters):
        for _ in tf.range(iters):
            x = op(x)
        return x

    return run


def raw_allreduce(buffer):
    def run(iters):
        for _ in range(iters):
            COMM.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)

    return run


def in_tensorflow(op, elems):
    x = tf.zeros([elems], tf.float32)  # zeros: the sums never overflow
    loop = chained(op)
    return lambda iters: loop(x, tf.constant(iters, tf.int32))


def check_kerasdist(elems):
    got = kd.allreduce(tf.fill([elems], float(RANK + 1)), op=kd.Sum).numpy()
    if not np.all(got == SIZE * (SIZE + 1) / 2):
        raise SystemExit(f"rank {RANK}: wrong allreduce result for {elems} floats")


def main():
    args = parse_args()
    say(f"op floor: {SIZE} ranks, MPI: {MPI.Get_library_version().splitlines()[0].strip()}, TF {tf.__version__}")
    run = result_files.start_run("op_floor", launcher=["mpiexec", "-n", str(SIZE)]) if RANK == 0 else None
    kernels = floor_kernels()
    harness = Harness(COMM, args.repeats, args.target_ms, 16, args.max_iters)
    agreement = harness.compare({"raw agreement": raw_allreduce(np.zeros(1, np.int64))})["raw agreement"]
    rows = []
    say(
        f"\nfixed cost per op against the budget of {args.target} x raw, µs (medians of {args.repeats}, "
        f"slowest rank); raw agreement (one 8-byte allreduce): {agreement['op_s'] * 1e6:.1f}"
    )
    say(
        f"{'size':>8} {'raw':>8} {'kerasdist':>10} {'ratio':>6} {'fixed':>7} {'budget':>7} "
        f"{'TF sync':>8} {'TF async':>9} {'floor':>7} {'floor/budget':>13}"
    )
    for kib in args.sizes_kib:
        elems = kib * KIB // 4
        check_kerasdist(elems)
        result = harness.compare(
            {
                "raw": raw_allreduce(np.zeros(elems, np.float32)),
                "TensorFlow, sync": in_tensorflow(kernels.kerasdist_floor_forward, elems),
                "TensorFlow, async": in_tensorflow(kernels.kerasdist_floor_forward_async, elems),
                "kerasdist": in_tensorflow(lambda x: kd.allreduce(x, op=kd.Sum), elems),
            }
        )
        raw_s, ours_s = result["raw"]["op_s"], result["kerasdist"]["op_s"]
        row = {
            "size_bytes": elems * 4,
            "cases": result,
            "fixed_s": ours_s - raw_s,
            "budget_s": raw_s * (1 / args.target - 1),
            "floor_s": result["TensorFlow, async"]["op_s"] + agreement["op_s"],
        }
        rows.append(row)
        say(
            f"{human(row['size_bytes']):>8} {raw_s * 1e6:8.1f} {ours_s * 1e6:10.1f} {raw_s / ours_s:6.2f} "
            f"{row['fixed_s'] * 1e6:7.1f} {row['budget_s'] * 1e6:7.1f} "
            f"{result['TensorFlow, sync']['op_s'] * 1e6:8.1f} {result['TensorFlow, async']['op_s'] * 1e6:9.1f} "
            f"{row['floor_s'] * 1e6:7.1f} {row['floor_s'] / row['budget_s']:13.2f}"
        )
    if RANK == 0 and args.json:
        record = result_files.finish_run(
            run, ranks=SIZE, target=args.target, repeats=args.repeats, agreement=agreement, sizes=rows
        )
        result_files.write(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
