"""Reports where each rank runs and checks one 4 MiB allreduce, with mpi4py only (no kerasdist).

Each rank prints one line: WHERE {"rank": r, "size": n, "host": hostname, "sum_ok": bool}.
"""

import json
import os
import socket
import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
values = np.full(1 << 20, comm.rank + 1, np.float32)  # 4 MiB: large enough to show on the links
comm.Allreduce(MPI.IN_PLACE, values, op=MPI.SUM)
report = {
    "rank": comm.rank,
    "size": comm.size,
    "host": socket.gethostname(),
    "sum_ok": bool(np.all(values == comm.size * (comm.size + 1) / 2)),
    "launcher_variables": {name: os.environ.get(name) for name in ("UCX_NET_DEVICES", "FI_TCP_IFACE")},
}
sys.stdout.write("WHERE " + json.dumps(report) + "\n")  # one write: lines of ranks do not interleave
