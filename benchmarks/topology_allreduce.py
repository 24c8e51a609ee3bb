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
The jobs above run with KERASDIST_AUTOTUNE=off: each column is one fixed choice. With --tuned the
run asks instead how close the tuner comes to the best fixed choice, kerasdist alone: one job per
fixed choice (mpi, auto, ring, and hierarchical where hosts hold several ranks; autotune off), then
one job per size with the defaults (autotune on), so that the tuner times that size, as a training
job times its own step; the tuner's cycles are the harness's warm-up, and the medians are of the
cycles after it (the log names what it kept). Result file: topology_allreduce_tuned.json.

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
import re
import signal
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results as result_files  # noqa: E402  (benchmarks/results.py)
from emulated_hosts import CLUSTER_SCRIPT, REPO, interrupt, job_environment, measure_link, run  # noqa: E402
from timing import human  # noqa: E402

RANK_SIDE = REPO / "benchmarks" / "topology_allreduce_ranks.py"
FIXED = {"KERASDIST_AUTOTUNE": "off"}
JOBS = {
    "mpi": ({**FIXED, "KERASDIST_ALLREDUCE_ALGORITHM": "mpi"}, ["raw", "kerasdist"]),
    "auto": ({**FIXED, "KERASDIST_ALLREDUCE_ALGORITHM": "auto"}, ["raw", "kerasdist"]),
    "ring": ({**FIXED, "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "ring"}, ["raw"]),
    "hierarchical": ({**FIXED, "KERASDIST_ALLREDUCE_ALGORITHM": "hierarchical"}, ["kerasdist"]),
}
FIXED_CHOICES = ("mpi", "auto", "ring", "hierarchical")  # --tuned: kerasdist alone, autotune off
TUNED_COLUMNS = [
    "size",
    "link limit",
    *(f"kerasdist {choice}" for choice in FIXED_CHOICES),
    "kerasdist tuned",
    "tuner kept",
    "tuned ÷ best fixed (time)",
    "tuned: share of link limit",
]
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
    parser.add_argument("--tuned", action="store_true", help="the tuner against each fixed choice (see above)")
    parser.add_argument("--json", default=None, help="default bench-results/topology_allreduce[_tuned].json")
    args = parser.parse_args()
    name = "topology_allreduce_tuned.json" if args.tuned else "topology_allreduce.json"
    args.json = args.json or str(REPO / "bench-results" / name)
    return args


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

    def launch(self, command, env, timeout_s, with_stderr=False):
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
        return run(argv, {**job_environment(), "UCX_TLS": "tcp", **env}, timeout_s, with_stderr)


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


def measure_tuned_layout(args, hosts, slots):
    """One job per fixed choice at every size, then one tuned job per size."""
    cluster = Cluster(hosts, slots, args.rate)
    choices = [c for c in FIXED_CHOICES if c != "hierarchical" or slots > 1]
    try:
        gbits = measure_link(cluster, args.rate)
        jobs = {}
        with tempfile.TemporaryDirectory() as scratch:
            planned = [
                (choice, {**FIXED, "KERASDIST_ALLREDUCE_ALGORITHM": choice}, args.sizes_kib) for choice in choices
            ]
            planned += [(f"tuned {kib}", {"KERASDIST_LOG_LEVEL": "info"}, [kib]) for kib in args.sizes_kib]
            # Past the tuner's timed cycles (8 per candidate, at most 4 candidates) before timing.
            untimed = ["--untimed_calls", "40"]
            for name, env, sizes in planned:
                out = pathlib.Path(scratch, "job.json")
                load = os.getloadavg()[0]
                command = [sys.executable, RANK_SIDE, "--cases", "kerasdist", "--repeats", str(args.repeats)]
                command += ["--json", out, "--sizes_kib", *map(str, sizes), *untimed]
                print(f"{hosts}x{slots} {name} (load {load:.1f}):", flush=True)
                output = cluster.launch(command, env, args.job_timeout_s, with_stderr=True)
                kept = re.findall(r"tuning: allreduce algorithms timed .*; keeping (\w+)", output)
                print(*kept and [f"  the tuner kept {kept[0]}"], flush=True)
                jobs[name] = {**json.loads(out.read_text()), "load_average_at_start": load, "kept": kept[:1]}
        return {"hosts": hosts, "ranks_per_host": slots, "link_gbits": gbits, "jobs": jobs}
    finally:
        cluster.down()


def tuned_table(layout, sizes_kib):
    hosts, jobs = layout["hosts"], layout["jobs"]
    rows = []
    for index, kib in enumerate(sizes_kib):
        tuned = jobs[f"tuned {kib}"]
        nbytes = tuned["sizes"][0]["bytes"]
        limit = 2 * (hosts - 1) / hosts * nbytes * 8 / (layout["link_gbits"] * 1e9)
        fixed = {choice: jobs[choice]["sizes"][index]["kerasdist_s"] for choice in FIXED_CHOICES if choice in jobs}
        tuned_s = tuned["sizes"][0]["kerasdist_s"]
        rows.append(
            [
                human(nbytes),
                f"{limit * 1e3:.3f} ms",
                *(f"{fixed[choice] * 1e3:.3f} ms" if choice in fixed else "—" for choice in FIXED_CHOICES),
                f"{tuned_s * 1e3:.3f} ms",
                tuned["kept"][0] if tuned["kept"] else "(nothing to choose)",
                f"{tuned_s / min(fixed.values()):.2f}",
                f"{limit / tuned_s:.2f}",
            ]
        )
    return {"columns": TUNED_COLUMNS, "rows": rows}


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
    record = result_files.start_run("topology_allreduce_tuned" if args.tuned else "topology_allreduce")
    layouts, tables, notes = [], {}, []
    try:
        for text in args.layouts:
            hosts, slots = map(int, text.split("x"))
            layout = (measure_tuned_layout if args.tuned else measure_layout)(args, hosts, slots)
            layouts.append(layout)
            tables[text] = tuned_table(layout, args.sizes_kib) if args.tuned else table(layout)
            columns = tables[text]["columns"]
            loads = ", ".join(f"{name} {job['load_average_at_start']:.1f}" for name, job in layout["jobs"].items())
            notes.append(f"{text}: one TCP stream {layout['link_gbits']:.3f} Gbit/s; load at each job's start {loads}")
            print(f"\n{text} at {args.rate}, float32 Sum, medians of {args.repeats}:")
            for row in [columns, ["---"] * len(columns), *tables[text]["rows"]]:
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
