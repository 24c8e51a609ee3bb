"""Allreduce past two hosts: MPICH's own choice against its ring, raw and through kerasdist.

How to run (as root; `make bench-net` runs it with the defaults, ~15 min):

  .venv/bin/python benchmarks/topology_allreduce.py
  .venv/bin/python benchmarks/topology_allreduce.py --layouts 3x1 --sizes_kib 4 16384 --repeats 3
  .venv/bin/python benchmarks/topology_allreduce.py --layouts 2x3 3x2 --sizes_kib 64 256 1024 4096 12288 16384

For each layout HxR (H emulated hosts of scripts/netns_cluster.sh, R ranks each, links shaped to
--rate) it measures one TCP stream between two hosts (the link's rate; median of 3) and runs
benchmarks/topology_allreduce_ranks.py across the hosts three times, float32 Sum of each size:
  mpi     KERASDIST_ALLREDUCE_ALGORITHM=mpi: raw MPI (mpi4py) and kerasdist, taking turns
  auto    KERASDIST_ALLREDUCE_ALGORITHM=auto (the default): raw MPI and kerasdist, taking turns
  ring    MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring in every rank's environment: raw MPI alone,
          every allreduce as MPICH's ring
  hierarchical  KERASDIST_ALLREDUCE_ALGORITHM=hierarchical: kerasdist alone, every allreduce as
          reduce-scatter within hosts, allreduce across, allgather within (with one rank per host
          there is no hierarchy: it runs what auto runs)
Link limit: an allreduce of S bytes over H hosts must send and receive 2(H-1)/H x S bytes over
some host's link at best (reduce-scatter, then allgather, between the hosts), so that over the
stream's rate is the floor. Ratios within a row compare jobs that ran one after the other: read
them with the load average each job started at (the notes). Jobs go through kerasdist-run with
the cluster's launcher program and interface and UCX_TLS=tcp.

Results: the tables printed, and a result file at --json (benchmarks/results.py; default
bench-results/topology_allreduce.json; `make bench-net`: benchmarks/results/) holding every
measurement and the tables.
"""

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results as result_files  # noqa: E402  (benchmarks/results.py)
from emulated_hosts import CLUSTER_SCRIPT, REPO, interrupt, job_environment, measure_link, run  # noqa: E402
from timing import human  # noqa: E402

RANK_SIDE = REPO / "benchmarks" / "topology_allreduce_ranks.py"
JOBS = {
    "mpi": ({"KERASDIST_ALLREDUCE_ALGORITHM": "mpi"}, ["raw", "kerasdist"]),
    "auto": ({"KERASDIST_ALLREDUCE_ALGORITHM": "auto"}, ["raw", "kerasdist"]),
    "ring": ({"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "ring"}, ["raw"]),
    "hierarchical": ({"KERASDIST_ALLREDUCE_ALGORITHM": "hierarchical"}, ["kerasdist"]),
}
COLUMNS = [
    "size",
    "link limit",
    "raw MPI",
    "raw MPI ring",
    "kerasdist mpi",
    "kerasdist auto",
    "kerasdist hierarchical",
    "auto: share of link limit",
    "hierarchical: share of link limit",
    "auto ÷ mpi (speed-up)",
    "auto ÷ raw ring",
    "hierarchical ÷ mpi",
]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Several ranks per host (2x3, 3x2: the hierarchy) are `make bench-net`'s second run.
    parser.add_argument("--layouts", nargs="+", default=["2x1", "3x1", "4x1"], help="HOSTSxRANKS_PER_HOST")
    parser.add_argument("--rate", default="1gbit", help="tc rate of every host's link (default: %(default)s)")
    parser.add_argument("--sizes_kib", type=int, nargs="+", default=[4, 64, 256, 1024, 4096, 12288, 16384])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--job_timeout_s", type=int, default=900)
    parser.add_argument("--json", default=str(REPO / "bench-results" / "topology_allreduce.json"))
    return parser.parse_args()


class Cluster:
    """HOSTS emulated hosts with SLOTS slots each, links at RATE; removed by down()."""

    def __init__(self, hosts, slots, rate):
        made = subprocess.run(
            [str(CLUSTER_SCRIPT), "up", "--hosts", str(hosts), "--slots", str(slots), "--rate", rate]
            + ["--owner", str(os.getpid())],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if made.returncode != 0:
            raise SystemExit(f"cannot make the test cluster: {made.stderr.strip()}")
        directory = pathlib.Path(made.stdout.strip().splitlines()[-1])
        self.env = dict(line.split("=", 1) for line in (directory / "env").read_text().splitlines())
        self.hosts = self.env["NETNS_CLUSTER_HOSTS"].split(",")
        self.slots = slots

    def down(self):
        subprocess.run([str(CLUSTER_SCRIPT), "down", self.env["NETNS_CLUSTER_DIR"]], capture_output=True, timeout=120)

    def on_host(self, host, command, **kwargs):
        return subprocess.Popen([self.env["NETNS_CLUSTER_LAUNCHER"], host, command], **kwargs)

    def launch(self, command, env, timeout_s):
        argv = [
            sys.executable,
            "-m",
            "kerasdist.run",
            "-np",
            str(len(self.hosts) * self.slots),
            "-H",
            ",".join(f"{host}:{self.slots}" for host in self.hosts),
            "--launcher-exec",
            self.env["NETNS_CLUSTER_LAUNCHER"],
            "--network-interface",
            self.env["NETNS_CLUSTER_IFACE"],
            *command,
        ]
        return run(argv, {**job_environment(), "UCX_TLS": "tcp", **env}, timeout_s)


def measure_layout(args, hosts, slots):
    cluster = Cluster(hosts, slots, args.rate)
    try:
        gbits = measure_link(cluster, args.rate)
        jobs = {}
        with tempfile.TemporaryDirectory() as scratch:
            for name, (env, cases) in JOBS.items():
                out = pathlib.Path(scratch, f"{name}.json")
                load = os.getloadavg()[0]
                command = [sys.executable, RANK_SIDE, "--cases", *cases, "--repeats", str(args.repeats), "--json", out]
                command += ["--sizes_kib", *map(str, args.sizes_kib)]
                print(f"{hosts}x{slots} {name} (load {load:.1f}):", flush=True)
                print(cluster.launch(command, env, args.job_timeout_s), end="", flush=True)
                jobs[name] = {**json.loads(out.read_text()), "load_average_at_start": load}
        return {"hosts": hosts, "ranks_per_host": slots, "link_gbits": gbits, "jobs": jobs}
    finally:
        cluster.down()


def table(layout):
    hosts, jobs = layout["hosts"], layout["jobs"]
    rows = []
    sizes = zip(jobs["mpi"]["sizes"], jobs["auto"]["sizes"], jobs["ring"]["sizes"], jobs["hierarchical"]["sizes"])
    for mpi, auto, ring, hierarchical in sizes:
        nbytes = mpi["bytes"]
        limit = 2 * (hosts - 1) / hosts * nbytes * 8 / (layout["link_gbits"] * 1e9)
        rows.append(
            [
                human(nbytes),
                f"{limit * 1e3:.3f} ms",
                f"{mpi['raw_s'] * 1e3:.3f} ms",
                f"{ring['raw_s'] * 1e3:.3f} ms",
                f"{mpi['kerasdist_s'] * 1e3:.3f} ms",
                f"{auto['kerasdist_s'] * 1e3:.3f} ms",
                f"{hierarchical['kerasdist_s'] * 1e3:.3f} ms",
                f"{limit / auto['kerasdist_s']:.2f}",
                f"{limit / hierarchical['kerasdist_s']:.2f}",
                f"{mpi['kerasdist_s'] / auto['kerasdist_s']:.2f}",
                f"{ring['raw_s'] / auto['kerasdist_s']:.2f}",
                f"{mpi['kerasdist_s'] / hierarchical['kerasdist_s']:.2f}",
            ]
        )
    return {"columns": COLUMNS, "rows": rows}


def main():
    args = parse_args()
    previous = signal.signal(signal.SIGTERM, interrupt)  # `finally` removes the cluster
    record = result_files.start_run("topology_allreduce")
    layouts, tables, notes = [], {}, []
    try:
        for text in args.layouts:
            hosts, slots = map(int, text.split("x"))
            layout = measure_layout(args, hosts, slots)
            layouts.append(layout)
            tables[text] = table(layout)
            loads = ", ".join(f"{name} {job['load_average_at_start']:.1f}" for name, job in layout["jobs"].items())
            notes.append(f"{text}: one TCP stream {layout['link_gbits']:.3f} Gbit/s; load at each job's start {loads}")
            print(f"\n{text} at {args.rate}, float32 Sum, medians of {args.repeats}:")
            for row in [COLUMNS, ["---"] * len(COLUMNS), *tables[text]["rows"]]:
                print("| " + " | ".join(row) + " |", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    path = result_files.write(
        args.json,
        result_files.finish_run(record, rate=args.rate, layouts=layouts, tables=tables, notes="; ".join(notes)),
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
