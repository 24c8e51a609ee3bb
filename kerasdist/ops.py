"""Collectives on TensorFlow tensors, eager or inside ``tf.function``.

Each call becomes one request to the engine, identified by a name that must match across
ranks: inside a graph the op's node name, in eager mode a per-call counter (or ``name=``).
Gradients follow the convention that the global objective is the sum of the per-rank losses.
"""
import enum
import itertools
import threading

import tensorflow as tf
from tensorflow.python.framework import auto_control_deps

from kerasdist import runtime

_OP_TYPES = ("KerasdistAllreduce", "KerasdistAllgather", "KerasdistBroadcast",
             "KerasdistReducescatter", "KerasdistAlltoall")
# The ops are stateful, so tf.function never prunes one whose result a rank leaves unused (the
# other ranks would wait for it). They need no program order, though: the engine negotiates
# one, and serializing them like other stateful ops would defeat tensor fusion.
auto_control_deps.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS = (
    auto_control_deps.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS | frozenset(_OP_TYPES))


class ReduceOp(enum.IntEnum):
    """How allreduce and reducescatter combine values (values match the C++ engine)."""

    AVERAGE = 0
    SUM = 1
    MIN = 2
    MAX = 3
    PRODUCT = 4


Average, Sum, Min, Max, Product = ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT


class _Cast:
    """Sends float32/float64 tensors in a 16-bit dtype and restores their own afterwards.

    16-bit tensors pass unchanged: float16 through bf16 would lose precision, not bytes.
    """

    def __init__(self, wire_dtype):
        self.wire_dtype = wire_dtype

    def compress(self, tensor):
        if tensor.dtype in (tf.float32, tf.float64):
            return tf.cast(tensor, self.wire_dtype), tensor.dtype
        return tensor, None

    def decompress(self, tensor, original_dtype):
        return tensor if original_dtype is None else tf.cast(tensor, original_dtype)

    def __repr__(self):
        return f"Compression({self.wire_dtype.name})"


class _NoCompression:
    def compress(self, tensor):
        return tensor, None

    def decompress(self, tensor, _):
        return tensor

    def __repr__(self):
        return "Compression.none"


class Compression:
    """Wire formats for allreduce: ``none``, ``fp16`` or ``bf16`` (floats only)."""

    none = _NoCompression()
    fp16 = _Cast(tf.float16)
    bf16 = _Cast(tf.bfloat16)


_counters = {}
_counters_lock = threading.Lock()


# AutoGraph leaves these as written: they hold no tensor-dependent Python control flow, and a
# first collective inside a tf.function reaches init(), whose mpi4py calls AutoGraph cannot
# convert and would warn about one by one.
_not_autographed = tf.autograph.experimental.do_not_convert


def _tensor_name(kind, name):
    """The name every rank gives this call; '' lets the kernel use its graph node name."""
    if name:
        return name
    if not tf.executing_eagerly():
        return ""
    with _counters_lock:
        counter = _counters.setdefault(kind, itertools.count())
        return f"{kind}.{next(counter)}"


def _ops():
    return runtime.state().ops


def _scale(factor):
    return tf.convert_to_tensor(factor, tf.float64)


def _check_reduce_op(op):
    try:
        return ReduceOp(op)
    except ValueError:
        raise ValueError(f"op must be one of kerasdist.Average, Sum, Min, Max, Product; got {op!r}") from None


@_not_autographed
def grouped_allreduce(tensors, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                      compression=Compression.none):
    """Reduces a list of tensors across ranks as one negotiation unit.

    The tensors are ready together, so the small ones (up to 256 KiB) share fused MPI calls
    and come back as views of one buffer; larger ones are reduced in their own memory.

    Args:
      tensors: tensors of any supported numeric dtype; dtypes and shapes may differ.
      op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
      name: optional name, equal on every rank; by default one is derived per call.
      prescale_factor: multiplies each input before the reduction (floats only).
      postscale_factor: multiplies each result after it (floats only).
      compression: ``Compression.none``, ``.fp16`` or ``.bf16``.

    Returns:
      A list of tensors of the same shapes and dtypes.

    Example:
        >>> import tensorflow as tf, kerasdist
        >>> a, b = kerasdist.grouped_allreduce([tf.ones(2), tf.zeros(3)], op=kerasdist.Sum)
        >>> float(a[0]) == kerasdist.size()
        True
    """
    op = _check_reduce_op(op)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    compressed, originals = zip(*(compression.compress(t) for t in tensors))
    reduced = _ops().kerasdist_allreduce(
        list(compressed), _scale(prescale_factor), _scale(postscale_factor),
        tensor_name=_tensor_name("allreduce", name), reduce_op=int(op))
    return [compression.decompress(t, d) for t, d in zip(reduced, originals)]


@_not_autographed
def allreduce(tensor, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
              compression=Compression.none):
    """Reduces ``tensor`` across ranks; every rank gets the result.

    ``Average`` divides the sum by ``size()`` (integer tensors: truncating, like TF). An
    ``IndexedSlices`` (an embedding gradient) is gathered instead of densified.

    Example:
        >>> import tensorflow as tf, kerasdist
        >>> total = kerasdist.allreduce(tf.constant([1.0, 2.0]), op=kerasdist.Sum)
        >>> total.numpy().tolist() == [kerasdist.size() * 1.0, kerasdist.size() * 2.0]
        True
    """
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_indexed_slices(tensor, _check_reduce_op(op), name, prescale_factor * postscale_factor,
                                         compression)
    return grouped_allreduce([tensor], op, name, prescale_factor, postscale_factor, compression)[0]


def _allreduce_indexed_slices(slices, op, name, scale, compression):
    if op not in (Sum, Average):
        raise ValueError("IndexedSlices can only be reduced with Sum or Average")
    values, original = compression.compress(slices.values)
    values = compression.decompress(allgather(values, name=name and f"{name}.values"), original)
    indices = allgather(slices.indices, name=name and f"{name}.indices")
    if op == Average:
        scale = scale / runtime.state().size
    values = values * tf.cast(scale, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


@_not_autographed
def allgather(tensor, name=None):
    """Concatenates every rank's ``tensor`` along dim 0, in rank order.

    The first dimension may differ between ranks; the others must match.

    Example:
        >>> import tensorflow as tf, kerasdist
        >>> rows = kerasdist.allgather(tf.fill([kerasdist.rank() + 1, 2], kerasdist.rank()))
        >>> int(rows.shape[0]) == kerasdist.size() * (kerasdist.size() + 1) // 2
        True
    """
    return _ops().kerasdist_allgather(tf.convert_to_tensor(tensor), tensor_name=_tensor_name("allgather", name))


@_not_autographed
def broadcast(tensor, root_rank, name=None):
    """Every rank receives ``root_rank``'s ``tensor`` (same shape and dtype on all ranks).

    Example:
        >>> import tensorflow as tf, kerasdist
        >>> int(kerasdist.broadcast(tf.constant(kerasdist.rank()), root_rank=0))
        0
    """
    return _ops().kerasdist_broadcast(tf.convert_to_tensor(tensor), tensor_name=_tensor_name("broadcast", name),
                                      root_rank=int(root_rank))


_PACK_BELOW_BYTES = 64 * 1024


@_not_autographed
def broadcast_variables(variables, root_rank=0):
    """Assigns ``root_rank``'s values to ``variables`` on every rank, in place.

    Small variables (biases, normalisation parameters, optimizer counters: most of a model's
    variables by count) travel packed, one broadcast per dtype; each large one goes on its own,
    which avoids copying it into a buffer.

    Example:
        >>> import tensorflow as tf, kerasdist
        >>> v = tf.Variable(float(kerasdist.rank()))
        >>> kerasdist.broadcast_variables([v], root_rank=0)
        >>> float(v.numpy())
        0.0
    """
    small_by_dtype = {}
    for variable in variables:
        value = tf.convert_to_tensor(variable)
        if value.shape.num_elements() * value.dtype.size >= _PACK_BELOW_BYTES:
            variable.assign(broadcast(value, root_rank))
        else:
            small_by_dtype.setdefault(value.dtype, []).append((variable, value))
    for group in small_by_dtype.values():
        packed = broadcast(tf.concat([tf.reshape(value, [-1]) for _, value in group], axis=0), root_rank)
        parts = tf.split(packed, [value.shape.num_elements() for _, value in group])
        for (variable, value), part in zip(group, parts):
            variable.assign(tf.reshape(part, value.shape))


@_not_autographed
def reducescatter(tensor, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0):
    """Reduces across ranks, then rank r keeps its dim-0 shard of the result.

    Rank r gets ``n // size + (1 if r < n % size else 0)`` rows: lower ranks take the remainder.

    Example:
        >>> import tensorflow as tf, kerasdist
        >>> shard = kerasdist.reducescatter(tf.ones([kerasdist.size() * 2, 3]), op=kerasdist.Sum)
        >>> shard.shape.as_list()
        [2, 3]
    """
    op = _check_reduce_op(op)
    return _ops().kerasdist_reducescatter(
        tf.convert_to_tensor(tensor), _scale(prescale_factor), _scale(postscale_factor),
        tensor_name=_tensor_name("reducescatter", name), reduce_op=int(op))


@_not_autographed
def alltoall(tensor, splits=None, name=None):
    """Sends ``splits[j]`` rows of ``tensor`` to rank j; returns the rows received, in rank order.

    Without ``splits``, dim 0 must divide evenly by ``size()``.

    Example:
        >>> import tensorflow as tf, kerasdist
        >>> got = kerasdist.alltoall(tf.fill([kerasdist.size()], kerasdist.rank()))
        >>> got.numpy().tolist() == list(range(kerasdist.size()))
        True
    """
    output, _ = _alltoall(tensor, splits, name)
    return output


def _alltoall(tensor, splits, name):
    splits = tf.zeros([0], tf.int32) if splits is None else tf.cast(splits, tf.int32)
    return _ops().kerasdist_alltoall(tf.convert_to_tensor(tensor), splits,
                                     tensor_name=_tensor_name("alltoall", name))


@_not_autographed
def broadcast_object(obj, root_rank=0):
    """Returns ``root_rank``'s picklable ``obj`` on every rank."""
    return runtime.state().comm.bcast(obj, root=root_rank)


@_not_autographed
def allgather_object(obj):
    """Returns the list of every rank's picklable ``obj``, in rank order."""
    return runtime.state().comm.allgather(obj)


@_not_autographed
def barrier():
    """Returns once every rank has called it."""
    runtime.state().comm.Barrier()


# Gradients. With loss = sum over ranks of loss_r, each rank's input feeds every rank's output.

@tf.RegisterGradient("KerasdistAllreduce")
def _allreduce_grad(op, *grads):
    reduce_op = ReduceOp(op.get_attr("reduce_op"))
    if reduce_op not in (Sum, Average):
        raise ValueError(f"kerasdist.allreduce with op={reduce_op.name} has no gradient; use Sum or Average")
    prescale, postscale, _ = op.inputs[-3:]
    summed = grouped_allreduce(list(grads), reduce_op, prescale_factor=prescale, postscale_factor=postscale)
    return summed + [None, None, None]


@tf.RegisterGradient("KerasdistAllgather")
def _allgather_grad(op, grad):
    summed = allreduce(grad, op=Sum)
    rows = allgather(tf.shape(op.inputs[0], out_type=tf.int64)[:1])
    rank = runtime.state().rank
    start = tf.reduce_sum(rows[:rank])
    return [summed[start:start + rows[rank]], None]


@tf.RegisterGradient("KerasdistBroadcast")
def _broadcast_grad(op, grad):
    summed = allreduce(grad, op=Sum)
    if runtime.state().rank != op.get_attr("root_rank"):
        summed = tf.zeros_like(summed)
    return [summed, None]


@tf.RegisterGradient("KerasdistReducescatter")
def _reducescatter_grad(op, grad):
    reduce_op = ReduceOp(op.get_attr("reduce_op"))
    if reduce_op not in (Sum, Average):
        raise ValueError(f"kerasdist.reducescatter with op={reduce_op.name} has no gradient; use Sum or Average")
    scale = op.inputs[1] * op.inputs[2]
    if reduce_op == Average:
        scale /= runtime.state().size
    gathered = allgather(grad)
    return [gathered * tf.cast(scale, gathered.dtype), None, None, None]


@tf.RegisterGradient("KerasdistAlltoall")
def _alltoall_grad(op, grad, _):
    returned, _ = _alltoall(grad, op.outputs[1], None)
    return [returned, None, None]
