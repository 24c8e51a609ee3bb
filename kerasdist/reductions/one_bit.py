"""1-bit gradients with error feedback (Seide et al. 2014): the `OneBit` reduction.

Each rank adds to its gradient the error it kept at the last update, sends the sign of every
value (one bit) and one scale per tensor, the mean absolute value, and keeps what that lost as
its next error: over the updates, what was sent plus the error kept adds up to the gradients
taken, so the quantisation delays information instead of dropping it. The bits of all tensors
and their scales travel as one uint8 allgather (n/8 bytes of n float32 values, plus 4 bytes a
tensor); every rank then decodes every rank's signs and averages the same values, so the ranks
stay identical. Against an allreduce of float32 (which moves about 2 × 4n bytes per rank over
a ring) that is 64 times fewer bytes at 2 ranks, growing with the number of ranks as
(size − 1) / 8 bytes per value received.
"""

import numpy as np
import tensorflow as tf

from kerasdist import ops, runtime
from kerasdist.reductions.base import GradientReduction

# Eight 0/1 bytes read as one little-endian integer, times this, carry bit i of byte i into bit
# 56 + i with no other term reaching bits 56-63: the top byte is the eight bits packed.
_GATHER_BITS = 0x0102040810204080
# The eight signs (lowest bit first) that each byte value stands for. NumPy, not a TensorFlow
# constant: one made at import would start TensorFlow's runtime before kerasdist.init() sizes
# its thread pools.
_SIGNS_OF_BYTE = np.array([[1.0 if (byte >> i) & 1 else -1.0 for i in range(8)] for byte in range(256)], np.float32)
_SCALE_BYTES = 4  # a float32


def packed_length(count):
    """Bytes that hold `count` sign bits."""
    return (count + 7) // 8


def quantize(corrected):
    """`(packed_signs, scale, sent)` of a float32 tensor: its signs, 8 to a uint8 (value ≥ 0 is
    a set bit, lowest bit first, the last byte padded with zeros), the mean absolute value, and
    the values that stand for it, `±scale`, in its shape."""
    flat = tf.reshape(corrected, [-1])
    scale = tf.reduce_mean(tf.abs(flat))
    non_negative = flat >= 0
    sent = tf.reshape(tf.where(non_negative, scale, -scale), tf.shape(corrected))
    bits = tf.pad(tf.cast(non_negative, tf.uint8), [[0, (-tf.size(flat)) % 8]])
    words = tf.bitcast(tf.reshape(bits, [-1, 8]), tf.uint64)
    packed = tf.bitwise.right_shift(words * tf.constant(_GATHER_BITS, tf.uint64), tf.constant(56, tf.uint64))
    packed = tf.cast(packed, tf.uint8)
    return packed, scale, sent


def decode_mean(packed, scales, count):
    """The mean over rows r of `scales[r] × signs of packed[r]`: `packed` is [ranks, bytes]
    uint8, `scales` [ranks] float32; the first `count` values, float32."""
    ranks = packed.shape[0]
    # Each rank's byte values looked up in its own table of ±scale: one pass per rank.
    tables = scales[:, tf.newaxis, tf.newaxis] * (_SIGNS_OF_BYTE / ranks)
    total = tf.add_n([tf.gather(tables[r], tf.cast(packed[r], tf.int32)) for r in range(ranks)])
    return tf.reshape(total, [-1])[:count]


def reduce(grads, residuals, op=ops.Average):
    """Every rank's 1-bit-quantised `grads` (each plus its residual), averaged (or, with
    `kerasdist.Sum`, summed) across ranks; updates `residuals` to what quantising lost.

    `grads` and `residuals` are lists of one length (dense float tensors and their float32
    variables, in the same order on every rank).
    """
    corrected = [tf.cast(tf.convert_to_tensor(g), tf.float32) + r for g, r in zip(grads, residuals)]
    quantized = [quantize(c) for c in corrected]
    for residual, c, (_, _, sent) in zip(residuals, corrected, quantized):
        residual.assign(c - sent)
    size = runtime.state().size
    if size == 1:
        reduced = [sent for _, _, sent in quantized]
    else:
        scales = tf.bitcast(tf.stack([scale for _, scale, _ in quantized]), tf.uint8)
        message = tf.concat([packed for packed, _, _ in quantized] + [tf.reshape(scales, [-1])], axis=0)
        gathered = tf.reshape(ops.allgather(message[tf.newaxis]), [size, -1])
        every_scale = tf.bitcast(
            tf.reshape(gathered[:, -_SCALE_BYTES * len(corrected) :], [size, len(corrected), _SCALE_BYTES]), tf.float32
        )
        reduced, at = [], 0
        for i, c in enumerate(corrected):
            count = c.shape.num_elements()
            packed = gathered[:, at : at + packed_length(count)]
            reduced.append(tf.reshape(decode_mean(packed, every_scale[:, i], count), tf.shape(c)))
            at += packed_length(count)
    if op == ops.Sum:
        reduced = [r * size for r in reduced]
    return [tf.cast(r, tf.convert_to_tensor(g).dtype) for r, g in zip(reduced, grads)]


class OneBit(GradientReduction):
    """One sign bit per gradient value and a scale per tensor, with error feedback.

    Each rank adds to its gradient what quantising lost at the last update, sends the signs and
    the mean absolute value of each tensor (one uint8 allgather for all of them), and keeps what
    that lost for the next update: over the updates nothing is dropped, only delayed. The
    residuals are optimizer state, each rank's own. Against a float32 allreduce, 64 times fewer
    bytes at 2 ranks. Dense float gradients (an embedding's is made dense).
    `DistributedOptimizer(..., one_bit_gradients=True)` is this reduction.

    Example:

    ```python
    import keras, numpy as np, tensorflow as tf, kerasdist
    kerasdist.init()
    optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(1.0), reduction=kerasdist.reductions.OneBit())
    w = keras.Variable(np.zeros(4, np.float32))
    optimizer.apply([tf.constant([3.0, -1.0, 1.0, -3.0])], [w])
    print(w.numpy().tolist())  # [-2.0, 2.0, -2.0, 2.0]
    print(optimizer.reduction.residuals[0].numpy().tolist())  # [1.0, 1.0, -1.0, -1.0]
    ```
    """

    keeps_gradients_across_updates = True
    gathers = True
    densifies_sparse_gradients = True

    def build(self, optimizer, variables):
        self.residuals = [
            optimizer.add_variable(shape=v.shape, dtype="float32", name="one_bit_residual") for v in variables
        ]

    def per_rank_variables(self):
        return self.residuals

    def reduce(self, gradients, variables, op):
        return reduce(gradients, self.slots(self.residuals, variables), op)
