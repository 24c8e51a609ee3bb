"""Named collectives of every kind with KERASDIST_TIMELINE set; rank 0 alone writes the trace.

A "{rank}" in KERASDIST_TIMELINE is replaced by the launcher's rank before init(), so every rank
gets a path of its own and a rank other than 0 that wrote a timeline would leave a file.
"""

import os

rank_from_launcher = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
os.environ["KERASDIST_TIMELINE"] = os.environ["KERASDIST_TIMELINE"].replace("{rank}", rank_from_launcher)

import tensorflow as tf  # noqa: E402

import kerasdist as kd  # noqa: E402

kd.init()
rank = kd.rank()
print(f"LAUNCH_PID rank={rank} pid={os.getpid()}", flush=True)
x = tf.ones([16, 4])
kd.allreduce(x, op=kd.Sum, name="timeline_allreduce_tensor")  # alone in its cycle: not fused
kd.allreduce(tf.ones([100_000]), op=kd.Sum, name="timeline_large_tensor")  # > 256 KiB: never fused
kd.allreduce(x, op=kd.Sum, name="timeline_compressed_tensor", compression=kd.Compression.fp16)  # alone, 16-bit
kd.allgather(x, name="timeline_allgather_tensor")
kd.broadcast(x, root_rank=0, name="timeline_broadcast_tensor")
kd.grouped_allreduce([x, x * 2, x * 3], op=kd.Sum, name="timeline_grouped_tensor")  # 3 tensors, fused


@tf.function
def in_function(y):
    return kd.allreduce(y, op=kd.Sum, name="timeline_in_function_tensor")


in_function(x)
kd.shutdown()  # the trace is complete once the engine has stopped
print(f"TIMELINE_SCRIPT_DONE rank={rank}", flush=True)
