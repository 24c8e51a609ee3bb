"""Hierarchical against flat allreduce on emulated hosts, for docs/scale.md's model to be checked
on (it is fitted on 2 hosts of benchmarks/topology_allreduce.py and never on these).

How to run (as root; `make bench-net` runs it, ~5 min):

  .venv/bin/python benchmarks/scale_hierarchical.py --json benchmarks/results/scale_hierarchical.json

For each layout HxR (scripts/netns_cluster.sh hosts, R ranks each, links shaped to --rate) it runs
benchmarks/scale_hierarchical_ranks.py through kerasdist-run with UCX over TCP: raw MPI only, no
kerasdist (which has no hierarchical allreduce yet: this measures what one would cost).
"""

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results as result_files  # noqa: E402  (benchmarks/results.py)
from emulated_hosts import REPO, interrupt  # noqa: E402
from topology_allreduce import Cluster  # noqa: E402

RANK_SIDE = REPO / "benchmarks" / "scale_hierarchical_ranks.py"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=["2x2", "3x2"], help="HOSTSxRANKS_PER_HOST")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--sizes_mib", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--job_timeout_s", type=int, default=900)
    parser.add_argument("--json", help="the result file (benchmarks/results.py); none: print only")
    return parser.parse_args()


def measure(args, hosts, slots):
    cluster = Cluster(hosts, slots, args.rate)
    try:
        load = os.getloadavg()[0]
        command = [sys.executable, RANK_SIDE, "--repeats", args.repeats, "--sizes_mib", *args.sizes_mib]
        output = cluster.launch(list(map(str, command)), {}, args.job_timeout_s)
        line = next(line for line in output.splitlines() if "SCALE_HIERARCHICAL " in line)
        measured = json.loads(line.split("SCALE_HIERARCHICAL ", 1)[1])
        return {**measured, "ranks_per_host": slots, "load_average_at_start": round(load, 2)}
    finally:
        cluster.down()


def table(layouts):
    rows = []
    for x in layouts:
        for size in x["sizes"]:
            rows.append(
                [
                    f"{x['hosts']}x{x['ranks_per_host']}",
                    f"{size['bytes'] >> 20} MiB",
                    f"{size['flat_s'] * 1e3:.1f} ms",
                    f"{size['hierarchical_s'] * 1e3:.1f} ms",
                    f"{size['flat_s'] / size['hierarchical_s']:.2f}",
                    f"{x['load_average_at_start']:.1f}",
                ]
            )
    columns = ["hosts x ranks", "size", "flat (MPI's own choice)", "hierarchical", "flat ÷ hierarchical", "load"]
    return {"columns": columns, "rows": rows}


def main():
    args = parse_args()
    previous = signal.signal(signal.SIGTERM, interrupt)  # `finally` removes the cluster
    run = result_files.start_run("scale_hierarchical")
    try:
        layouts = []
        for text in args.layouts:
            hosts, slots = map(int, text.split("x"))
            layouts.append(measure(args, hosts, slots))
            print(layouts[-1], flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.json:
        record = result_files.finish_run(run, rate=args.rate, layouts=layouts, tables={"allreduce": table(layouts)})
        result_files.write(args.json, record)


if __name__ == "__main__":
    main()
