"""Where each rank runs, what reached it, and one 4 MiB kerasdist allreduce across the ranks.

Each rank prints one line: PLACED {"rank", "size", "local_rank", "host", "sum", "variables"},
where "sum" is the allreduced value of every element (rank r sends r + 1 everywhere; None when
the elements differ) and "variables" the values the test asks about (argv[1:]), None when unset.
"""

import json
import os
import socket
import sys

import numpy as np
import tensorflow as tf

import kerasdist as kd

kd.init()
summed = kd.allreduce(tf.fill([1 << 20], float(kd.rank() + 1)), op=kd.Sum, name="placement").numpy()
report = {
    "rank": kd.rank(),
    "size": kd.size(),
    "local_rank": kd.local_rank(),
    "host": socket.gethostname(),
    "sum": float(summed[0]) if np.all(summed == summed[0]) else None,
    "variables": {name: os.environ.get(name) for name in sys.argv[1:]},
}
sys.stdout.write("PLACED " + json.dumps(report) + "\n")  # one write: lines of ranks do not interleave
sys.stdout.flush()
