"""Two small allreduces submitted about 50 ms apart on every rank; rank 0 writes the timeline
(KERASDIST_TIMELINE), from which the test reads whether they shared a negotiation cycle."""

import os
import threading
import time

import tensorflow as tf

import kerasdist as kd

kd.init()
rank = kd.rank()
print(f"LAUNCH_PID rank={rank} pid={os.getpid()}", flush=True)
kd.allreduce(tf.constant([1.0]), op=kd.Sum, name="warmup")
kd.barrier()  # the engine is idle again, and every rank starts together
first = threading.Thread(target=lambda: kd.allreduce(tf.ones([8]), op=kd.Sum, name="cycle_first"))
first.start()
time.sleep(0.05)
kd.allreduce(tf.ones([8]), op=kd.Sum, name="cycle_second")
first.join()
kd.shutdown()  # the trace is complete once the engine has stopped
print(f"CYCLE_SCRIPT_DONE rank={rank}", flush=True)
