"""The default reduction: the exact average (or sum), in buckets of grouped allreduces."""

import tensorflow as tf

from kerasdist import ops, runtime
from kerasdist.reductions.base import GradientReduction

COMPRESSIONS = {"none": ops.Compression.none, "fp16": ops.Compression.fp16, "bf16": ops.Compression.bf16}


def compression_name(compression):
    if isinstance(compression, str):
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression={compression!r}; expected one of {sorted(COMPRESSIONS)}")
        return compression
    for name, known in COMPRESSIONS.items():
        if compression is known:
            return name
    raise ValueError(f"compression={compression!r}; expected kerasdist.Compression.none, .fp16 or .bf16")


class Allreduce(GradientReduction):
    """Every rank's gradients averaged (or summed) exactly: the default reduction.

    Dense gradients travel in buckets, each one grouped allreduce (see `reduce_gradients`), so
    inside a `tf.function` communication overlaps the rest of the backward pass.

    Args:
        compression: `kerasdist.Compression.none` (default), `.fp16` or `.bf16`: the wire
            format of float gradients (the result is cast back to each gradient's dtype).
        sparse_as_dense: reduce embedding (`IndexedSlices`) gradients as dense tensors instead
            of gathering them; better when most rows are touched every step.

    Example:

    ```python
    import keras, kerasdist
    kerasdist.init()
    reduction = kerasdist.reductions.Allreduce(compression=kerasdist.Compression.bf16)
    optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.1), reduction=reduction)
    print(optimizer.compression is kerasdist.Compression.bf16)  # True
    ```
    """

    def __init__(self, compression=ops.Compression.none, sparse_as_dense=False):
        self._compression_name = compression_name(compression)
        self.sparse_as_dense = bool(sparse_as_dense)

    @property
    def compression(self):
        return COMPRESSIONS[self._compression_name]

    @property
    def densifies_sparse_gradients(self):
        return self.sparse_as_dense

    def reduce(self, gradients, variables, op):
        return reduce_gradients(gradients, op, self.compression, self.sparse_as_dense)

    def reduce_with_statistics(self, gradients, op, statistics):
        """`reduce`, plus float32 scalars `statistics` averaged in the same allreduce (uncompressed,
        so a squared norm cannot overflow float16). Returns (gradients, statistics)."""
        return _reduce(gradients, op, self.compression, self.sparse_as_dense, statistics)

    def get_config(self):
        return {"compression": self._compression_name, "sparse_as_dense": self.sparse_as_dense}


def reduce_gradients(grads, op=ops.Average, compression=ops.Compression.none, sparse_as_dense=False):
    """Combines a list of per-rank gradients across ranks; `None` entries stay `None`.

    Dense gradients go out in buckets of about `KERASDIST_BUCKET_BYTES` (by default an eighth
    of their bytes, between 64 KiB and 4 MiB, or one bucket when every rank is on one host
    without a GPU), last variables first,
    one grouped allreduce each (small tensors of a bucket fuse into one MPI call). Inside a
    `tf.function` a bucket's allreduce starts as soon as backprop has produced its gradients,
    so communication overlaps the rest of the backward pass. `IndexedSlices` (embedding
    gradients) are gathered, not densified, unless `sparse_as_dense`. In a world of one this
    returns `grads` unchanged and adds no op to the graph.

    Example:

    ```python
    import numpy as np, tensorflow as tf, kerasdist
    from kerasdist.reductions import reduce_gradients
    kerasdist.init()
    mine = tf.constant([1.0, 2.0]) * (kerasdist.rank() + 1)  # rank r holds (r + 1) * [1, 2]
    reduced = reduce_gradients([mine, None])
    mean = (kerasdist.size() + 1) / 2
    print(np.allclose(reduced[0], [mean, 2 * mean]), reduced[1])  # True None
    ```
    """
    return _reduce(grads, op, compression, sparse_as_dense)[0]


def _reduce(grads, op, compression, sparse_as_dense, statistics=()):
    """`reduce_gradients`, plus float32 `statistics` reduced with the last bucket (uncompressed,
    so a squared norm cannot overflow float16). Returns (grads, statistics)."""
    grads, statistics = list(grads), list(statistics)
    if runtime.state().size == 1:
        return grads, statistics
    if sparse_as_dense:
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    dense_positions = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
    reduced = list(grads)
    buckets = _buckets(
        dense_positions, grads, _bucket_bytes(runtime.state().knobs.bucket_bytes, [grads[i] for i in dense_positions])
    ) or [[]]
    for bucket in buckets:
        # Statistics depend on every gradient: they ride with the last bucket, after its
        # gradients, uncompressed.
        riders = statistics if bucket is buckets[-1] else []
        out = ops.grouped_allreduce(
            [grads[i] for i in bucket] + riders,
            op,
            compression=[compression] * len(bucket) + [ops.Compression.none] * len(riders),
        )
        for i, g in zip(bucket, out):
            reduced[i] = g
    for i, g in enumerate(grads):
        if isinstance(g, tf.IndexedSlices):
            reduced[i] = ops.allreduce(g, op=op, compression=compression)
    return reduced, (out[len(buckets[-1]) :] if statistics else [])


# KERASDIST_BUCKET_BYTES=auto: about this many buckets, within these sizes. Over a 50 Mbit/s link
# ResNet-20's step was shortest with 8 buckets of those tried (1, 2, 4, 8; docs/network.md,
# "Overlap"); the floor keeps tiny models from paying a negotiation per
# few layers, the cap keeps the buckets of large models from waiting for too many layers.
# With every rank on one CPU host, one bucket: shared memory leaves no transfer time to hide and
# every CPU is busy with backprop, so each extra bucket's negotiation only takes CPU from it
# (keras_scaling's E(2) was far lower with four buckets than with one).
AUTO_BUCKETS = 8
AUTO_BUCKET_BYTES_MIN, AUTO_BUCKET_BYTES_MAX = 64 * 2**10, 4 * 2**20


def _nbytes(tensor):
    return (tensor.shape.num_elements() or 0) * tensor.dtype.size


def _bucket_bytes(setting, grads):
    """The bucket size `setting` (KERASDIST_BUCKET_BYTES) gives for these dense gradients."""
    if setting != "auto":
        return setting
    if runtime.state().one_cpu_host:
        return 0
    total = sum(_nbytes(g) for g in grads)
    return min(AUTO_BUCKET_BYTES_MAX, max(AUTO_BUCKET_BYTES_MIN, total // AUTO_BUCKETS))


def _buckets(positions, grads, bucket_bytes):
    """`positions` of `grads` in reduction buckets of about `bucket_bytes` (0: one bucket).

    Backprop produces the last variables' gradients first, so buckets are filled from the end:
    the first bucket can travel while earlier layers are still being differentiated. Shapes and
    order decide, so every rank makes the same buckets.
    """
    buckets, current, filled = [], [], 0
    for i in reversed(positions):
        current.append(i)
        filled += _nbytes(grads[i])
        if bucket_bytes and filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    return buckets + ([current] if current else [])
