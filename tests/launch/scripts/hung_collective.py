"""Rank 0 waits in an allreduce that rank 1 never calls; rank 1 waits in a barrier: both are
blocked inside the engine (not in Python), so only the launcher can end the job."""

import os

import numpy as np

import kerasdist

kerasdist.init()
print(f"LAUNCH_PID rank={kerasdist.rank()} pid={os.getpid()}", flush=True)
if kerasdist.rank() == 0:
    kerasdist.allreduce(np.ones(1, np.float32), name="only_rank_0_calls_this")
else:
    kerasdist.barrier()
print("UNREACHABLE", flush=True)
