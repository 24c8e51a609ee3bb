"""Fusion thresholds across two emulated hosts: which one each link prefers, and which one fusion
tuning keeps.

How to run (as root; `make bench-net` runs it, ~10 min):

  .venv/bin/python benchmarks/fusion_tuning.py
  .venv/bin/python benchmarks/fusion_tuning.py --rounds 1 --repeats 3   # quick look

It makes a 2-host cluster (benchmarks/emulated_hosts.py; removed at the end) and, on a link shaped
to --rate and on the unshaped one, runs benchmarks/network_allreduce.py --only many (160 float32
tensors of 64 KiB per step, one kd.grouped_allreduce, one rank per host) once per configuration,
taking turns, --rounds times:
  16 MiB, tuning off   the default threshold alone: one MPI call per step
  1 MiB, tuning off    --fusion-threshold-mb 1: ten calls of 1 MiB per step
  unfused              --fusion-threshold-mb 0: 160 calls
  defaults             16 MiB with KERASDIST_FUSION_TUNING=auto, timed after the tuning has
                       settled (network_allreduce.py runs the step FUSION_TUNING_STEPS times
                       first); the threshold it kept is read from rank 0's log
Each run also times raw mpi4py on the same bytes: one Allreduce per tensor, and one of a flat
buffer. A configuration's figure is the median over the rounds of each run's median step time.
Results: printed tables, and a result file at --json (benchmarks/results.py; default
bench-results/fusion_tuning.json; `make bench-net`: benchmarks/results/fusion_tuning.json).
"""

import argparse
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results as result_files  # noqa: E402  (benchmarks/results.py)
from emulated_hosts import REPO, UNSHAPED, measure_link, two_hosts  # noqa: E402

RANK_BENCH = REPO / "benchmarks" / "network_allreduce.py"
CONFIGURATIONS = {  # label -> kerasdist-run flags
    "16 MiB, tuning off": ["--fusion-tuning", "off"],
    "1 MiB, tuning off": ["--fusion-threshold-mb", "1", "--fusion-tuning", "off"],
    "unfused": ["--fusion-threshold-mb", "0"],
    "defaults (16 MiB, tuning auto)": ["--log-level", "info"],
}
KEPT = re.compile(r"tuning: fused allreduces timed .*; keeping calls of up to (\d+) bytes")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit", help="tc rate of the shaped link (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each configuration per link, in turns")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats within each run")
    parser.add_argument("--job_timeout_s", type=int, default=900)
    parser.add_argument("--json", default=str(REPO / "bench-results" / "fusion_tuning.json"), help="the result file")
    return parser.parse_args()


def run_once(cluster, flags):
    """One network_allreduce.py run: its many-tensor seconds per case, and the threshold fusion
    tuning kept (None when it did not tune)."""
    with tempfile.TemporaryDirectory() as scratch:
        path = pathlib.Path(scratch, "many.json")
        output = cluster.launch(
            [sys.executable, RANK_BENCH, "--only", "many", "--repeats", str(ARGS.repeats), "--json", path],
            extra_flags=flags,
            with_stderr=True,
        )
        seconds = json.loads(path.read_text())["many"]["seconds"]
    kept = KEPT.search(output)
    return seconds, int(kept.group(1)) if kept else None


def bench_link(cluster):
    runs = {label: [] for label in CONFIGURATIONS}
    for round_number in range(ARGS.rounds):
        for label, flags in CONFIGURATIONS.items():
            seconds, kept = run_once(cluster, flags)
            runs[label].append({"seconds": seconds, "kept_bytes": kept})
            print(f"  round {round_number + 1} {label}: grouped {seconds['grouped'] * 1e3:.2f} ms", flush=True)
    return runs


def table(runs):
    """Rows of ms per step (median over the runs, and their range) and the unfused / case ratio."""

    def grouped_ms(label):
        return [run["seconds"]["grouped"] * 1e3 for run in runs[label]]

    unfused = statistics.median(grouped_ms("unfused"))
    rows = []
    for case in ("raw per tensor", "raw flat"):
        every_run = [run["seconds"][case] * 1e3 for label in runs for run in runs[label]]
        rows.append([f"raw MPI, {case.removeprefix('raw ')}", f"{statistics.median(every_run):.1f}", "", ""])
    for label in CONFIGURATIONS:
        ms = grouped_ms(label)
        kept = [run["kept_bytes"] for run in runs[label] if run["kept_bytes"] is not None]
        name = f"kerasdist, {label}"
        if kept:
            name += ": kept " + ", ".join(f"{b / 2**20:g} MiB" for b in kept)
        low_high = f"{min(ms):.1f}–{max(ms):.1f}" if len(ms) > 1 else ""
        rows.append([name, f"{statistics.median(ms):.1f}", low_high, f"{unfused / statistics.median(ms):.2f}×"])
    return {"columns": ["160 × 64 KiB per step", "ms", "range over runs", "unfused / this"], "rows": rows}


def main():
    run_header = result_files.start_run("fusion_tuning")
    links = [(ARGS.rate.replace("gbit", " Gbit").replace("mbit", " Mbit"), ARGS.rate), ("unshaped", UNSHAPED)]
    results, tables = {"links": {}}, {}
    with two_hosts(ARGS.job_timeout_s) as cluster:
        for label, rate in links:
            cluster.shape(rate)
            gbits = measure_link(cluster, rate)
            print(f"\n== {label} link: one TCP stream {gbits:.2f} Gbit/s (load {os.getloadavg()[0]:.1f})", flush=True)
            runs = bench_link(cluster)
            results["links"][label] = {"rate": rate, "tcp_gbits": gbits, "runs": runs}
            tables[label] = table(runs)
    for label, laid_out in tables.items():
        print(f"\n{label} link")
        for row in [laid_out["columns"], *laid_out["rows"]]:
            print("  " + " | ".join(row))
    path = result_files.write(ARGS.json, result_files.finish_run(run_header, **results, tables=tables))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    ARGS = parse_args()
    main()
