"""A few named collectives with KERASDIST_TIMELINE set; rank 0 writes the trace."""
import os

import tensorflow as tf

import kerasdist as kd

kd.init()
rank = kd.rank()
print(f"LAUNCH_PID rank={rank} pid={os.getpid()}", flush=True)
x = tf.ones([16, 4])
kd.allreduce(x, op=kd.Sum, name="timeline_allreduce_tensor")
kd.allgather(x, name="timeline_allgather_tensor")
kd.broadcast(x, root_rank=0, name="timeline_broadcast_tensor")
kd.grouped_allreduce([x, x * 2], op=kd.Sum, name="timeline_grouped_tensor")


@tf.function
def in_function(y):
    return kd.allreduce(y, op=kd.Sum, name="timeline_in_function_tensor")


in_function(x)
kd.shutdown()  # the trace is complete once the engine has stopped
print(f"TIMELINE_SCRIPT_DONE rank={rank}", flush=True)
