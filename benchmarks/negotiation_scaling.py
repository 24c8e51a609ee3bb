"""How negotiation cost grows with ranks: fast path (bit vector) against slow path (first seen).

How to run (as root; `make bench-net` runs it after benchmarks/network.py, ~6 min):

  .venv/bin/python benchmarks/negotiation_scaling.py
  .venv/bin/python benchmarks/negotiation_scaling.py --ranks 2 4 --repeats 3   # quick look

It makes 4 emulated hosts (scripts/netns_cluster.sh, unshaped links, UCX over TCP) and runs
benchmarks/negotiation.py at each --ranks (spread over min(ranks, 4) hosts), once with the
default negotiation cache (every op on the fast path) and once with KERASDIST_CACHE_CAPACITY=1
(every op on the slow path). Per op it reports raw MPI (a 4-byte allreduce), kerasdist's fast
and slow path (the fastest of --repeats: with more ranks than cores, waiting for a core only
ever adds), and the negotiation overheads fast - raw and slow - fast; then fits
    fast - raw = a + b * log2(P)        (a bitwise-AND allreduce: a tree of log2 P rounds)
    slow - fast = c + d * P             (P requests gathered to and parsed by rank 0)
by least squares and prints what the fits give at 1,024 and 4,096 ranks.

This machine has 2 cores: from 4 ranks on, ranks wait for a core as much as for the network, so
the slopes measured here are upper bounds for dedicated hosts (see docs/network.md).
"""

import argparse
import json
import math
import os
import pathlib
import signal
import statistics
import subprocess
import sys

import numpy as np
import results as result_files  # benchmarks/results.py, beside this script

REPO = pathlib.Path(__file__).resolve().parent.parent
CLUSTER_SCRIPT = REPO / "scripts" / "netns_cluster.sh"
RANK_BENCH = REPO / "benchmarks" / "negotiation.py"
MAX_HOSTS = 4


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--job_timeout_s", type=int, default=900)
    parser.add_argument(
        "--json",
        default=str(REPO / "bench-results" / "negotiation.json"),
        help="the result file (benchmarks/results.py; `make bench-net`: benchmarks/results/negotiation_scaling.json)",
    )
    return parser.parse_args()


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")  # so that the cluster is removed on SIGTERM too


def run_at(env_file, ranks, capacity, args):
    hosts = env_file["NETNS_CLUSTER_HOSTS"].split(",")
    host_count = min(ranks, MAX_HOSTS)
    per_host = math.ceil(ranks / host_count)
    argv = [
        "timeout",
        "--kill-after=10",
        str(args.job_timeout_s),
        sys.executable,
        "-m",
        "kerasdist.run",
        "-np",
        str(ranks),
        "-H",
        ",".join(f"{h}:{per_host}" for h in hosts[:host_count]),
        "--launcher-exec",
        env_file["NETNS_CLUSTER_LAUNCHER"],
        "--network-interface",
        env_file["NETNS_CLUSTER_IFACE"],
        sys.executable,
        str(RANK_BENCH),
        "--repeats",
        str(args.repeats),
        "--iterations",
        str(args.iterations),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERASDIST_")}
    env.update(UCX_TLS="tcp", OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO))
    if capacity is not None:
        env["KERASDIST_CACHE_CAPACITY"] = str(capacity)
    done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("NEGOTIATION ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(argv)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("NEGOTIATION ") :])


def fit(xs, ys):
    """Least-squares (intercept, slope) of ys against xs."""
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(intercept), float(slope)


def main():
    args = parse_args()
    run_header = result_files.start_run("negotiation_scaling")
    previous = signal.signal(signal.SIGTERM, _interrupt)
    made = subprocess.run(
        [
            str(CLUSTER_SCRIPT),
            "up",
            "--hosts",
            str(MAX_HOSTS),
            "--slots",
            str(max(args.ranks)),
            "--owner",
            str(os.getpid()),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if made.returncode != 0:
        raise SystemExit(f"cannot make the test cluster: {made.stderr.strip()}")
    directory = made.stdout.strip().splitlines()[-1]
    env_file = dict(line.split("=", 1) for line in pathlib.Path(directory, "env").read_text().splitlines())
    rows = []
    try:
        for ranks in args.ranks:
            fast = run_at(env_file, ranks, None, args)
            slow = run_at(env_file, ranks, 1, args)
            # The fastest repeat: with more ranks than cores, time waiting for a core only ever adds.
            row = {
                "ranks": ranks,
                "raw_us": 1e6 * min(fast["raw_samples"] + slow["raw_samples"]),
                "fast_us": 1e6 * min(fast["ours_samples"]),
                "slow_us": 1e6 * min(slow["ours_samples"]),
                "median_us": {
                    "raw": 1e6 * statistics.median(fast["raw_samples"] + slow["raw_samples"]),
                    "fast": 1e6 * fast["ours_s"],
                    "slow": 1e6 * slow["ours_s"],
                },
                "fast": fast,
                "slow": slow,
                "load": os.getloadavg()[0],
            }
            rows.append(row)
            print(
                f"  {ranks:3d} ranks: raw {row['raw_us']:8.1f} us  fast {row['fast_us']:8.1f} us  "
                f"slow {row['slow_us']:8.1f} us  (load {row['load']:.1f})",
                flush=True,
            )
    finally:
        subprocess.run([str(CLUSTER_SCRIPT), "down", directory], capture_output=True, timeout=120)
        signal.signal(signal.SIGTERM, previous)

    print("\nµs per op, fastest of the repeats (median in brackets)\n")
    table = [
        "| ranks (hosts) | raw MPI 4-byte allreduce | kerasdist, fast path | kerasdist, slow path | "
        "fast - raw | slow - fast | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        median = row["median_us"]
        table.append(
            f"| {row['ranks']} ({min(row['ranks'], MAX_HOSTS)}) | {row['raw_us']:.0f} ({median['raw']:.0f}) | "
            f"{row['fast_us']:.0f} ({median['fast']:.0f}) | {row['slow_us']:.0f} ({median['slow']:.0f}) | "
            f"{row['fast_us'] - row['raw_us']:.0f} | {row['slow_us'] - row['fast_us']:.0f} | {row['load']:.1f} |"
        )
    print("\n".join(table))
    model = {}
    if len(rows) >= 2:
        model["fast"] = fit([math.log2(r["ranks"]) for r in rows], [r["fast_us"] - r["raw_us"] for r in rows])
        model["slow"] = fit([r["ranks"] for r in rows], [r["slow_us"] - r["fast_us"] for r in rows])
        model["raw"] = fit([math.log2(r["ranks"]) for r in rows], [r["raw_us"] for r in rows])
        (a, b), (c, d), (e, f) = model["fast"], model["slow"], model["raw"]
        print(
            f"\nfits (µs): fast - raw = {a:.0f} + {b:.0f}·log2 P;  slow - fast = {c:.0f} + {d:.1f}·P;  "
            f"raw = {e:.0f} + {f:.0f}·log2 P"
        )
        for ranks in (1024, 4096):
            print(
                f"  at {ranks} ranks: fast-path overhead {a + b * math.log2(ranks):.0f} µs per cycle; "
                "slow-path extra "
                f"{(c + d * ranks) / 1e3:.1f} ms per cycle that has first-seen requests"
            )
    record = result_files.finish_run(
        run_header, rows=rows, model_us=model, tables={"negotiation": result_files.markdown_tables("\n".join(table))[0]}
    )
    path = result_files.write(args.json, record)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
