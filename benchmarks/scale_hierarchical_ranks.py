"""The rank side of benchmarks/scale_hierarchical.py: raw float32 Sum allreduces (mpi4py, no
kerasdist) of each --sizes_mib, two ways taking turns within each repeat:
  flat          one MPI_Allreduce over every rank (MPI's own choice of algorithm)
  hierarchical  MPI_Reduce inside each host (shared memory), MPI_Allreduce among one rank per
                host, MPI_Bcast inside each host
Each result is checked against the sum computed from (rank, size). The time of a repeat is the
slowest rank's; rank 0 prints one JSON line, SCALE_HIERARCHICAL {"sizes": [{"bytes",
"flat_s", "flat_samples", "hierarchical_s", "hierarchical_samples"}], "hosts": H}, medians.
"""

import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--sizes_mib", type=int, nargs="+", default=[1, 4, 16])
parser.add_argument("--repeats", type=int, default=5)
parser.add_argument("--iterations", type=int, default=3)
args = parser.parse_args()

world = MPI.COMM_WORLD
local = world.Split_type(MPI.COMM_TYPE_SHARED)
leaders = world.Split(0 if local.rank == 0 else MPI.UNDEFINED, world.rank)
hosts = world.allreduce(1 if local.rank == 0 else 0)


def flat(buffer):
    world.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)


def hierarchical(buffer):
    if local.rank == 0:
        local.Reduce(MPI.IN_PLACE, buffer, op=MPI.SUM, root=0)
        leaders.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
    else:
        local.Reduce(buffer, None, op=MPI.SUM, root=0)
    local.Bcast(buffer, root=0)


def timed(allreduce, count):
    # Rank r sends r + 1 everywhere: the sum is size (size + 1) / 2, exact in float32 here.
    buffers = [np.full(count, world.rank + 1, dtype=np.float32) for _ in range(args.iterations)]
    world.Barrier()
    start = time.perf_counter()
    for buffer in buffers:
        allreduce(buffer)
    elapsed = (time.perf_counter() - start) / args.iterations
    expected = world.size * (world.size + 1) / 2
    if not all(np.all(buffer == expected) for buffer in buffers):
        raise SystemExit(f"rank {world.rank}: {allreduce.__name__} gave a wrong sum")
    return world.allreduce(elapsed, op=MPI.MAX)


sizes = []
for mib in args.sizes_mib:
    count = (mib << 20) // 4
    timed(flat, count), timed(hierarchical, count)  # warm-up: connections, buffers
    samples = {"flat": [], "hierarchical": []}
    for _ in range(args.repeats):
        for way in (flat, hierarchical):
            samples[way.__name__].append(timed(way, count))
    row = {"bytes": mib << 20}
    for way, values in samples.items():
        row.update({f"{way}_s": statistics.median(values), f"{way}_samples": values})
    sizes.append(row)
if world.rank == 0:
    print("SCALE_HIERARCHICAL " + json.dumps({"hosts": hosts, "ranks": world.size, "sizes": sizes}), flush=True)
