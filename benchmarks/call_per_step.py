"""Allreduce when Python calls a fresh `tf.function` per op or per step, against raw MPI.

How to run (every rank runs this file; rank 0 prints the tables; `make bench` runs it):

  .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/call_per_step.py --json benchmarks/results/call_per_step.json

benchmarks/allreduce.py keeps its loops inside one `tf.function`, as a training step does. A
harness that calls a `tf.function` once per op, or once per step with the step's tensors going in
and coming out, pays TensorFlow's call and its completion work on every call. This measures that
way of calling:

  calls   4 KiB and 1 MiB float32 Sum: one call of a `tf.function` holding one kd.allreduce per
          op, its result read with .numpy(), against raw comm.Allreduce on a NumPy array per op.
          160 x 64 KiB per step: one call of a `tf.function` taking the 160 tensors and
          returning 160 results (one kd.grouped_allreduce, or 160 kd.allreduce), one result
          read with .numpy(), against 160 raw Allreduce calls and one raw Allreduce of a flat
          buffer of the same bytes.
  engine  the same 160 x 64 KiB step built three ways: one call per step; 20 steps inside one
          call (tf.range, as allreduce.py runs it); and one call per step of 160 `t + 0.0`, no
          collective at all: what the call costs by itself. Beside each, where the engine
          thread's time went per step (kd.engine_times(), the mean of the ranks).

Timing is benchmarks/timing.py's (the slowest rank, calibrated repeats, cases alternating
within each of --repeats repeats, medians and the range of the per-repeat ratios). Rank 0
writes a result file (benchmarks/results.py) to --json holding both tables.
"""

import argparse
import os
import sys

KIB = 1024
STEPS_PER_CALL = 20


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=160)
    parser.add_argument("--tensor_kib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--target_ms", type=float, default=200.0)
    parser.add_argument("--min_iters", type=int, default=2)
    parser.add_argument("--max_iters", type=int, default=5000)
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
from timing import FUSION_TUNING_STEPS, Harness, compare_with_engine_phases, human, ratio_to_raw  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
HARNESS = Harness(COMM, ARGS.repeats, ARGS.target_ms, ARGS.min_iters, ARGS.max_iters)


def say(text):
    if RANK == 0:
        print(text, flush=True)


def compare(cases):
    return compare_with_engine_phases(HARNESS, cases, kd.engine_times)


def raw_per_op(buf):
    def run(ops):
        for _ in range(ops):
            COMM.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    return run


def one_op_per_call(elems):
    """kd.allreduce of a fresh input, one `tf.function` call per op, the result read back."""
    one_op = tf.function(lambda x: kd.allreduce(x, op=kd.Sum))
    x = tf.fill([elems], float(RANK + 1))
    if not np.all(one_op(x).numpy() == SIZE * (SIZE + 1) / 2):
        raise SystemExit(f"rank {RANK}: wrong allreduce result for {elems} floats")

    def run(ops):
        for _ in range(ops):
            one_op(x).numpy()

    return run


def calls_per_op():
    rows = []
    for kib in (4, 1024):
        elems = kib * KIB // 4
        results = compare({"raw": raw_per_op(np.zeros(elems, np.float32)), "ours": one_op_per_call(elems)})
        rows.append((f"{human(elems * 4)} Sum, one call per op", results))
    return rows


def step_functions(shapes):
    """The 160-tensor step as Python calls it: name -> fn(steps)."""
    xs = [tf.zeros(shape) for shape in shapes]

    @tf.function
    def grouped(tensors):
        return kd.grouped_allreduce(tensors, op=kd.Sum)

    @tf.function
    def separate(tensors):
        return [kd.allreduce(t, op=kd.Sum) for t in tensors]

    @tf.function
    def no_collective(tensors):
        return [t + 0.0 for t in tensors]

    @tf.function
    def grouped_steps(steps):
        tensors = [tf.zeros(shape) for shape in shapes]
        for _ in tf.range(steps):
            tensors = kd.grouped_allreduce(tensors, op=kd.Sum)
        return tensors

    def per_call(step):
        def run(steps):
            for _ in range(steps):
                step(xs)[0].numpy()

        return run

    def steps_per_call(steps):
        calls, left = divmod(steps, STEPS_PER_CALL)
        for count in [STEPS_PER_CALL] * calls + ([left] if left else []):
            grouped_steps(tf.constant(count))[0].numpy()

    grouped_steps(tf.constant(FUSION_TUNING_STEPS))  # fusion tuning settles before anything is timed
    return {
        "grouped, one call per step": per_call(grouped),
        f"{len(shapes)} ops, one call per step": per_call(separate),
        f"grouped, {STEPS_PER_CALL} steps in one call": steps_per_call,
        f"{len(shapes)} `t + 0.0`, one call per step, no collective": per_call(no_collective),
    }


def bench_step():
    shapes = [(ARGS.tensor_kib * KIB // 4,)] * ARGS.tensors
    bufs = [np.zeros(shape, np.float32) for shape in shapes]
    flat = np.zeros(sum(int(np.prod(s)) for s in shapes), np.float32)

    def raw_per_tensor(steps):
        for _ in range(steps):
            for buf in bufs:
                COMM.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    cases = {"raw per tensor": raw_per_tensor, "raw flat": raw_per_op(flat), **step_functions(shapes)}
    return compare(cases)


def milliseconds(seconds):
    return f"{seconds * 1e3:.2f} ms" if seconds < 0.01 else f"{seconds * 1e3:.1f} ms"


def time_cell(seconds):
    return (
        f"{seconds * 1e6:.1f} µs"
        if seconds < 1e-4
        else f"{seconds * 1e6:.0f} µs"
        if seconds < 1e-3
        else milliseconds(seconds)
    )


def calls_table(op_rows, step, what):
    """One row per case: raw MPI's time, kerasdist's, and raw / kerasdist (range over repeats)."""
    rows = []
    for label, results in op_rows:
        ratio, low, high = ratio_to_raw(results, "ours")
        rows.append(
            [
                label,
                time_cell(results["raw"]["op_s"]),
                time_cell(results["ours"]["op_s"]),
                f"{ratio:.2f} ({low:.2f}–{high:.2f})",
            ]
        )
    for name in ("grouped, one call per step", f"{ARGS.tensors} ops, one call per step"):
        ratio, low, high = ratio_to_raw(step, name, raw="raw flat")
        rows.append(
            [
                f"{what}, {name}",
                f"{milliseconds(step['raw flat']['op_s'])} flat, "
                f"{milliseconds(step['raw per tensor']['op_s'])} per tensor",
                milliseconds(step[name]["op_s"]),
                f"{ratio:.2f} ({low:.2f}–{high:.2f}) of flat",
            ]
        )
    return {"columns": ["case", "raw MPI", "kerasdist", "raw / kerasdist (range over repeats)"], "rows": rows}


def engine_table(step, what):
    """The step built three ways: ms per step and the engine's phases per step."""
    phases = ("negotiation", "copy_in", "transfer", "hand_back")
    rows = []
    for name in (
        "grouped, one call per step",
        f"grouped, {STEPS_PER_CALL} steps in one call",
        f"{ARGS.tensors} `t + 0.0`, one call per step, no collective",
    ):
        spent = step[name]["phases_s"]
        collective = "no collective" not in name
        rows.append(
            [
                name,
                f"{step[name]['op_s'] * 1e3:.2f}",
                " / ".join(f"{spent[key] * 1e3:.2f}" for key in phases) if collective else "—",
            ]
        )
    columns = [
        f"the same {what} step, built as",
        "ms per step",
        "engine: negotiation / copy in / transfer / hand back (ms)",
    ]
    return {"columns": columns, "rows": rows}


def main():
    run = result_files.start_run("call_per_step", launcher=("mpiexec", "-n", str(SIZE))) if RANK == 0 else None
    say(f"call_per_step: {SIZE} ranks, {MPI.Get_library_version().splitlines()[0].strip()}, TF {tf.__version__}")
    op_rows = calls_per_op()
    step = bench_step()
    what = f"{ARGS.tensors} × {human(ARGS.tensor_kib * KIB)}"
    tables = {"calls": calls_table(op_rows, step, what), "engine": engine_table(step, what)}
    for table in tables.values():
        say("\n" + "\n".join(" | ".join(row) for row in [table["columns"], *table["rows"]]))
    if RANK == 0 and ARGS.json:
        record = result_files.finish_run(
            run,
            ranks=SIZE,
            repeats=ARGS.repeats,
            per_op={label: results for label, results in op_rows},
            step=step,
            tables=tables,
        )
        say(f"wrote {result_files.write(ARGS.json, record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
