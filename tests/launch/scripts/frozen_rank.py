"""Rank 1 freezes (SIGSTOP: every thread stops, as on a host that hangs or a link that drops)
while rank 0 needs it.

    frozen_rank.py waiting   rank 1 freezes before it submits; rank 0 waits in a negotiation
    frozen_rank.py moving    rank 1 freezes while both move 64 MiB allreduces

Expected: rank 0 ends the job with status 1 within KERASDIST_COLLECTIVE_TIMEOUT_S (and, when
waiting, one round of questions to its peers), instead of waiting for the stall timeout or for
ever.
"""

import os
import signal
import sys
import threading
import time

import tensorflow as tf

import kerasdist as kd

kd.init()
print(f"LAUNCH_PID rank={kd.rank()} pid={os.getpid()}", flush=True)
kd.allreduce(tf.constant([1.0]), op=kd.Sum, name="warmup")


def freeze(after_s):
    time.sleep(after_s)
    print(f"FROZEN_AT={time.time()}", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)


if sys.argv[1] == "waiting":
    if kd.rank() == 1:
        freeze(0.5)
    kd.allreduce(tf.constant([1.0]), op=kd.Sum, name="never_completes")
else:
    big = tf.ones([16 * 2**20])  # 64 MiB: a call takes tens of milliseconds, its negotiation microseconds
    if kd.rank() == 1:
        threading.Thread(target=freeze, args=(1.0,), daemon=True).start()
    while True:
        kd.allreduce(big, op=kd.Sum, name="big")
