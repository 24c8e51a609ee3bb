"""What the engine sends per negotiation cycle at 2 to 128 ranks: counted, not timed.

How to run (`make bench` runs it; ~3 min, most of it the 128-rank job):

  .venv/bin/python benchmarks/scale_counts.py --json benchmarks/results/scale_counts.json
  .venv/bin/python benchmarks/scale_counts.py --ranks 2 8              # a quick look, no file

It builds benchmarks/scale_engine_driver.cc with every engine source (no TensorFlow) and the
PMPI counting shim benchmarks/scale_mpi_counts.c, then runs the driver under mpiexec at each
--ranks on this one host (oversubscribed past 2 ranks: 2 cores), the shim preloaded. The driver
runs a training-like workload (a step is --buckets grouped allreduces holding --tensors tensors)
in four phases: the first step (new requests: rank 0's slow path), steady steps (the bit-vector
fast path), churning steps (new names every step: the slow path every step) and one step that
rank 0 starts --pause_s late (the stall inspector's questions). Every rank checks every result
against values computed from (rank, size).

What it reports per rank count is what the shim counted at the MPI API: calls and bytes per MPI
function and phase, on every rank. These counts do not depend on the machine's load; the cycles a
step takes, and so the per-step figures of the fast path, do (the table says the load). Times are
reported for completeness only: with up to 64 ranks per core they measure the scheduler.
"""

import argparse
import csv
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import results as result_files  # benchmarks/results.py, beside this script

REPO = result_files.REPO
ENGINE_DIR = REPO / "kerasdist" / "csrc" / "engine"
DRIVER_SOURCE = REPO / "benchmarks" / "scale_engine_driver.cc"
SHIM_SOURCE = REPO / "benchmarks" / "scale_mpi_counts.c"
BUILD_INFO = REPO / "kerasdist" / "build_info.json"
MPIEXEC = pathlib.Path(sys.executable).parent / "mpiexec"
PHASES = {1: "first step", 2: "steady", 3: "churning", 4: "rank 0 late"}
COMPILE_TIMEOUT_S = 900


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--steps", type=int, default=10, help="steps of the steady and of the churning phase")
    parser.add_argument("--tensors", type=int, default=161, help="gradient tensors per step (ResNet-50 has 161)")
    parser.add_argument("--buckets", type=int, default=4, help="grouped allreduces per step")
    parser.add_argument("--elements", type=int, default=161 * 64, help="float32 values per step, over all tensors")
    parser.add_argument("--pause_s", type=float, default=6.0, help="rank 0's delay in the last phase; 0: no phase")
    parser.add_argument("--fusion_threshold_bytes", type=int, default=16 << 20)
    parser.add_argument("--cache_capacity", type=int, default=1024)
    parser.add_argument("--job_timeout_s", type=int, default=600)
    parser.add_argument("--json", help="the result file (benchmarks/results.py); none: print only")
    return parser.parse_args(argv)


def build(build_dir=REPO / "build" / "scale_counts"):
    """The driver and the shim, compiled into ``build_dir`` unless already built from the same
    sources; returns their paths."""
    info = result_files.read(BUILD_INFO)
    sources = sorted(ENGINE_DIR.glob("*.cc")) + [DRIVER_SOURCE]
    digest = hashlib.sha256()
    for path in [*sources, *ENGINE_DIR.glob("*.h"), SHIM_SOURCE]:
        digest.update(path.read_bytes())
    build_dir = pathlib.Path(build_dir) / digest.hexdigest()[:16]
    driver, shim = build_dir / "scale_engine_driver", build_dir / "scale_mpi_counts.so"
    if driver.exists() and shim.exists():
        return driver, shim
    build_dir.mkdir(parents=True, exist_ok=True)
    link = info["mpi_link_flags"]
    rpaths = [f"-Wl,-rpath,{flag[2:]}" for flag in link if flag.startswith("-L")]
    compile_flags = info["mpi_compile_flags"]
    commands = [
        ["g++", "-std=c++17", "-O1", "-pthread", f"-I{ENGINE_DIR}", *compile_flags, *map(str, sources)]
        + ["-o", f"{driver}.tmp", *link, *rpaths],
        ["gcc", "-O1", "-Wall", "-shared", "-fPIC", *compile_flags, str(SHIM_SOURCE)]
        + ["-o", f"{shim}.tmp", *link, *rpaths],
    ]
    for command in commands:
        subprocess.run(command, check=True, timeout=COMPILE_TIMEOUT_S)
    for path in (driver, shim):
        os.replace(f"{path}.tmp", path)
    return driver, shim


def job_command(driver, ranks, args):
    return [
        str(MPIEXEC),
        "-n",
        str(ranks),
        str(driver),
        *map(
            str,
            (
                args.steps,
                args.tensors,
                args.buckets,
                args.elements,
                args.pause_s,
                args.fusion_threshold_bytes,
                args.cache_capacity,
            ),
        ),
    ]


def job_env(shim, counts_dir, base=None):
    """The environment of a counted job: the shim preloaded, the files' directory named."""
    env = dict(os.environ if base is None else base)
    env.update(LD_PRELOAD=str(shim), SCALE_COUNTS_DIR=str(counts_dir))
    return env


def read_counts(counts_dir, ranks):
    """What the shim and the driver wrote: ({rank: {phase: {function: counts}}}, {rank: {phase: row}})."""
    counts, driver_rows = {}, {}
    for rank in range(ranks):
        counts[rank] = {}
        with open(pathlib.Path(counts_dir) / f"rank{rank}.tsv") as file:
            for row in csv.DictReader(file, delimiter="\t"):
                values = {key: int(value) for key, value in row.items() if key not in ("phase", "function")}
                counts[rank].setdefault(int(row["phase"]), {})[row["function"]] = values
        driver_rows[rank] = {}
        with open(pathlib.Path(counts_dir) / f"driver{rank}.tsv") as file:
            for row in csv.DictReader(file, delimiter="\t"):
                driver_rows[rank][int(row["phase"])] = {
                    "steps": int(row["steps"]),
                    "cycles": int(row["cycles"]),
                    "collectives": int(row["collectives"]),
                    "seconds": float(row["seconds"]),
                }
    return counts, driver_rows


def summarize(counts, driver_rows, ranks):
    """The per-cycle and per-step properties of one job, from its counts."""
    zero = {"calls": 0, "bytes_in": 0, "bytes_out": 0, "messages_in": 0, "messages_out": 0}

    def get(rank, phase, function):
        return counts[rank].get(phase, {}).get(function, zero)

    others = range(1, ranks)
    steady, churn, late = 2, 3, 4
    steps = driver_rows[0][steady]["steps"]
    and_sizes = sorted(
        {
            get(r, phase, "MPI_Iallreduce")["bytes_out"] // get(r, phase, "MPI_Iallreduce")["calls"]
            for r in range(ranks)
            for phase in (steady, churn)
            if get(r, phase, "MPI_Iallreduce")["calls"]
        }
    )
    summary = {
        "ranks": ranks,
        # The fast path: one bitwise AND per cycle on every rank, of a size that is the cache's.
        "and_bytes_per_cycle": and_sizes,
        "and_calls_equal_cycles_on_every_rank": all(
            get(r, phase, "MPI_Iallreduce")["calls"] == driver_rows[r][phase]["cycles"]
            for r in range(ranks)
            for phase in (steady, churn)
        ),
        "steady_cycles": driver_rows[0][steady]["cycles"],
        "steady_steps": steps,
        "steady_slow_path_cycles": max(get(r, steady, "MPI_Gatherv")["calls"] for r in range(ranks)),
        "data_bytes_per_step": get(0, steady, "MPI_Allreduce")["bytes_out"] // steps,
        "data_allreduces_per_step": get(0, steady, "MPI_Allreduce")["calls"] / steps,
        # The slow path: rank 0 hears from every other rank in every slow cycle.
        "churn_steps": driver_rows[0][churn]["steps"],
        "churn_slow_path_cycles": get(0, churn, "MPI_Gatherv")["calls"],
        "rank0_gatherv_messages_in": get(0, churn, "MPI_Gatherv")["messages_in"],
        "rank0_gather_bytes_in_per_step": (
            get(0, churn, "MPI_Gatherv")["bytes_in"] + get(0, churn, "MPI_Gather")["bytes_in"]
        )
        // driver_rows[0][churn]["steps"],
        "other_rank_gather_bytes_out_per_step": [
            (get(r, churn, "MPI_Gatherv")["bytes_out"] + get(r, churn, "MPI_Gather")["bytes_out"])
            // driver_rows[r][churn]["steps"]
            for r in others
        ],
        "answer_bytes_per_step": get(1, churn, "MPI_Bcast")["bytes_in"] // driver_rows[1][churn]["steps"]
        if ranks > 1
        else 0,
        "seconds_per_step": {
            PHASES[phase]: driver_rows[0][phase]["seconds"] / driver_rows[0][phase]["steps"]
            for phase in (steady, churn)
        },
    }
    if late in driver_rows[0]:
        questions = [get(r, late, "MPI_Isend")["messages_out"] for r in others]
        summary.update(
            stall_isends_per_waiting_rank=[min(questions), max(questions)],
            stall_isends_job_wide=sum(get(r, late, "MPI_Isend")["messages_out"] for r in range(ranks)),
        )
    return summary


def run_at(ranks, driver, shim, args):
    """One job at ``ranks``: its summary, the load it started under and its seconds."""
    counts_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"scale_counts_{ranks}_"))
    load = os.getloadavg()[0]
    started = time.monotonic()
    try:
        done = subprocess.run(
            job_command(driver, ranks, args),
            env=job_env(shim, counts_dir),
            capture_output=True,
            text=True,
            timeout=args.job_timeout_s,
            start_new_session=True,
        )
        passed = re.findall(r"^rank \d+: passed, 0 of [1-9]\d* checks failed$", done.stdout, re.M)
        if done.returncode != 0 or len(passed) != ranks:
            raise SystemExit(f"{ranks} ranks: exit {done.returncode}\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
        checks = sum(int(n) for n in re.findall(r"^rank \d+: passed, 0 of (\d+) checks", done.stdout, re.M))
        summary = summarize(*read_counts(counts_dir, ranks), ranks)
    finally:
        shutil.rmtree(counts_dir, ignore_errors=True)
    return {
        **summary,
        "checks_passed": checks,
        "load_average_at_start": round(load, 2),
        "job_s": time.monotonic() - started,
    }


def tables(rows, args):
    """The page's tables, laid out from the rows."""
    negotiation = {
        "columns": [
            "ranks",
            "fast path: bytes per rank per cycle",
            "fast path: ANDs per cycle",
            "steady steps through rank 0",
            "slow path: rank 0 receives per cycle (messages)",
            "slow path: rank 0 receives per step",
            "slow path: each other rank sends per step",
            "slow path: answer per step",
            "results checked, all right",
        ],
        "rows": [
            [
                row["ranks"],
                " / ".join(f"{size} B" for size in row["and_bytes_per_cycle"]),
                "1" if row["and_calls_equal_cycles_on_every_rank"] else "not 1",
                f"{row['steady_slow_path_cycles']} of {row['steady_steps']}",
                f"{row['rank0_gatherv_messages_in'] / row['churn_slow_path_cycles']:.0f}",
                f"{row['rank0_gather_bytes_in_per_step']:,} B",
                " to ".join(
                    dict.fromkeys(
                        f"{value:,} B"
                        for value in (
                            min(row["other_rank_gather_bytes_out_per_step"]),
                            max(row["other_rank_gather_bytes_out_per_step"]),
                        )
                    )
                ),
                f"{row['answer_bytes_per_step']:,} B",
                f"{row['checks_passed']:,}",
            ]
            for row in rows
        ],
    }
    stall = {
        "columns": [
            "ranks",
            f"messages each waiting rank sent, questions and answers (rank 0 {args.pause_s:g} s late)",
            "messages job-wide",
            "steady step (s)",
            "churning step (s)",
            "load",
        ],
        "rows": [
            [
                row["ranks"],
                " to ".join(dict.fromkeys(str(n) for n in row.get("stall_isends_per_waiting_rank", ["-"]))),
                f"{row.get('stall_isends_job_wide', '-'):,}",
                f"{row['seconds_per_step']['steady']:.3f}",
                f"{row['seconds_per_step']['churning']:.3f}",
                f"{row['load_average_at_start']:.1f}",
            ]
            for row in rows
        ],
    }
    return {"negotiation": negotiation, "stall": stall}


def main():
    args = parse_args()
    run = result_files.start_run("scale_counts")
    driver, shim = build()
    rows = []
    for ranks in args.ranks:
        row = run_at(ranks, driver, shim, args)
        print(row, flush=True)
        rows.append(row)
    workload = {
        key: getattr(args, key)
        for key in ("steps", "tensors", "buckets", "elements", "pause_s", "fusion_threshold_bytes", "cache_capacity")
    }
    laid_out = tables(rows, args)
    for table in laid_out.values():
        print("| " + " | ".join(table["columns"]) + " |")
        for cells in table["rows"]:
            print("| " + " | ".join(str(cell) for cell in cells) + " |")
    if args.json:
        record = result_files.finish_run(
            run,
            config=workload,
            rows=rows,
            tables=laid_out,
            notes="one host, 2 cores, oversubscribed past 2 ranks; counts at the MPI API by a PMPI shim "
            "(benchmarks/scale_mpi_counts.c), per rank; times are the scheduler's, not a network's",
        )
        result_files.write(args.json, record)


if __name__ == "__main__":
    main()
