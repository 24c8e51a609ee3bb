"""What each rank of a Slurm job learns from kerasdist, next to what Slurm says it is.

Each rank prints one line: SLURM_RANK {...} with kerasdist's rank, local rank, size and local
size, the host, Slurm's SLURM_PROCID / SLURM_LOCALID / SLURMD_NODENAME (absent under a launcher
that does not start ranks through Slurm), and the sum of an allreduce of rank + 1.
"""

import json
import os
import socket
import sys

import numpy as np

import kerasdist as kd

kd.init()
total = kd.allreduce(np.full(1 << 16, kd.rank() + 1, np.float32), op=kd.Sum)
report = {
    "rank": kd.rank(),
    "local_rank": kd.local_rank(),
    "size": kd.size(),
    "local_size": kd.local_size(),
    "host": socket.gethostname(),
    "slurm": {
        name: os.environ.get(name) for name in ("SLURM_PROCID", "SLURM_LOCALID", "SLURMD_NODENAME", "SLURM_JOB_ID")
    },
    "sums": sorted({float(value) for value in np.asarray(total)}),
}
sys.stdout.write("SLURM_RANK " + json.dumps(report) + "\n")  # one write: ranks' lines do not interleave
