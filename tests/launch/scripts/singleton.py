"""The whole public API in a plain `python singleton.py` (an MPI world of one):
every collective is the identity. Prints SINGLETON_OK at the end; any failed
check raises."""

import numpy as np
import tensorflow as tf

import kerasdist as kd


def same(got, expected):
    got = tf.convert_to_tensor(got)
    expected = tf.convert_to_tensor(expected)
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    np.testing.assert_array_equal(got.numpy(), expected.numpy())


x = tf.constant([[1.0, -2.5], [3.0, 4.25]])

# A collective before any explicit init initializes implicitly.
same(kd.allreduce(x, op=kd.Sum), x)
assert kd.is_initialized()
kd.init()
kd.init()  # idempotent
assert kd.is_initialized()
assert (kd.rank(), kd.size()) == (0, 1)
assert (kd.local_rank(), kd.local_size()) == (0, 1)
assert (kd.cross_rank(), kd.cross_size()) == (0, 1)
assert kd.mpi_built() is True
assert isinstance(kd.nccl_built(), bool)

for op in (kd.Sum, kd.Average, kd.Min, kd.Max, kd.Product):
    same(kd.allreduce(x, op=op), x)
same(kd.allreduce(x), x)
same(kd.allreduce(x, op=kd.Sum, prescale_factor=2.0, postscale_factor=3.0), 6.0 * x)
for dtype in (tf.uint8, tf.int8, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float64):
    t = tf.cast(tf.constant([[1, 2], [3, 4]]), dtype)
    same(kd.allreduce(t, op=kd.Sum), t)
    same(kd.allreduce(t, op=kd.Average), t)
    same(kd.allgather(t), t)
    same(kd.broadcast(t, root_rank=0), t)
    same(kd.reducescatter(t, op=kd.Sum), t)
    same(kd.alltoall(t), t)
b = tf.constant([True, False, True])
same(kd.allgather(b), b)
same(kd.broadcast(b, 0), b)

ints = tf.constant([7, 8], tf.int32)
outs = kd.grouped_allreduce([x, ints], op=kd.Sum)
same(outs[0], x)
same(outs[1], ints)
same(kd.reducescatter(x), x)
same(kd.alltoall(x, splits=[2]), x)
same(kd.alltoall(x, splits=tf.constant([2])), x)
for compression in (kd.Compression.none, kd.Compression.fp16, kd.Compression.bf16):
    same(kd.allreduce(x, op=kd.Sum, compression=compression), x)
    same(kd.grouped_allreduce([x, ints], op=kd.Sum, compression=compression)[1], ints)

obj = {"a": [1, 2, 3], "b": "text"}
assert kd.broadcast_object(obj, root_rank=0) == obj
assert kd.broadcast_object(obj) == obj
assert kd.allgather_object(obj) == [obj]
kd.barrier()

v = tf.Variable([1.0, 2.0])
kd.broadcast_variables([v], root_rank=0)
same(v.read_value(), tf.constant([1.0, 2.0]))


@tf.function
def in_function(t):
    return (
        kd.allreduce(t, op=kd.Sum),
        kd.allgather(t),
        kd.broadcast(t, 0),
        kd.reducescatter(t, op=kd.Sum),
        kd.alltoall(t),
    )


for out in in_function(x):
    same(out, x)

w = tf.constant([[0.5, 1.0], [2.0, -1.0]])
for forward in (
    lambda t: kd.allreduce(t, op=kd.Sum),
    lambda t: kd.allreduce(t, op=kd.Average),
    kd.allgather,
    lambda t: kd.broadcast(t, 0),
    lambda t: kd.reducescatter(t, op=kd.Sum),
):
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(w * forward(x))
    same(tape.gradient(loss, x), w)

for bad in (
    lambda: kd.broadcast(x, root_rank=1),
    lambda: kd.allgather(tf.constant(1.0)),
    lambda: kd.alltoall(x, splits=[1]),
):
    try:
        bad()
    except tf.errors.InvalidArgumentError:
        pass
    else:
        raise AssertionError("invalid input was accepted")
same(kd.allreduce(x, op=kd.Sum), x)  # still fine after the errors

kd.shutdown()
assert not kd.is_initialized()
print("SINGLETON_OK", flush=True)
