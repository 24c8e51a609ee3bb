"""SyncBatchNormalization: batch normalization over the global batch of all ranks."""

import keras
import tensorflow as tf

from kerasdist import ops, runtime


@keras.saving.register_keras_serializable(package="kerasdist")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """`keras.layers.BatchNormalization` whose training statistics span every rank's batch.

    In training, the mean and (biased) variance that normalise the batch and update the moving
    statistics are those of the global batch: all ranks' local batches together, as Horovod's
    `hvd.SyncBatchNormalization` computes them. Each call in training makes one allreduce of
    `3 · channels` float64 values (count, sum and centred sum of squares per channel). Ranks may
    hold batches of different sizes: the counts travel with the sums. Gradients flow across
    ranks through the allreduce, so the gradient for a rank's inputs includes what they do to
    the other ranks' outputs through the shared statistics.

    Everything else is `BatchNormalization`'s: the arguments, inference (moving statistics, no
    collective), float16/bfloat16 inputs (statistics in float32), masks (a masked-out position
    counts on no rank), renorm. In a world of one it is `BatchNormalization` exactly. Every rank
    must call the layer in training the same number of times, and build its SyncBatchNormalization
    layers in the same order (their allreduces are numbered by it), as for any collective; it does not
    run under XLA (`jit_compile=True`), which `kerasdist.callbacks()` switches off for `fit`.

    Args:
        **kwargs: `keras.layers.BatchNormalization`'s arguments (`axis`, `momentum`, `epsilon`,
            `center`, `scale`, initializers, regularizers, constraints, `renorm`, ...), except
            `synchronized=True`, which asks `tf.distribute` to synchronise instead.

    Example:

    ```python
    import numpy as np
    import kerasdist

    kerasdist.init()
    layer = kerasdist.SyncBatchNormalization(momentum=0.0)
    rows = np.full((2, 1), kerasdist.rank(), "float32")  # rank r's batch: two rows of r
    layer(rows, training=True)
    print(float(layer.moving_mean[0]) == (kerasdist.size() - 1) / 2)  # True
    ```
    """

    def __init__(self, **kwargs):
        if kwargs.pop("synchronized", False):
            raise ValueError(
                "SyncBatchNormalization synchronises over kerasdist's ranks already; "
                "synchronized=True (tf.distribute's replicas) does not apply. Drop the argument."
            )
        super().__init__(**kwargs)

    def get_config(self):
        config = super().get_config()
        config.pop("synchronized", None)
        return config

    def _moments(self, inputs, mask):
        size = runtime.state().size
        if size == 1:
            return super()._moments(inputs, mask)
        ops._refuse_xla(f"kerasdist.SyncBatchNormalization '{self.name}'")
        axes = self._reduction_axes
        if mask is None:
            local_mean, local_variance = tf.nn.moments(inputs, axes)
            count = tf.cast(tf.size(inputs) // tf.size(local_mean), inputs.dtype)
            count = tf.fill(tf.shape(local_mean), count)
        else:
            weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), inputs.dtype), tf.shape(inputs))
            local_mean, local_variance = tf.nn.weighted_moments(inputs, axes, weights)
            count = tf.reduce_sum(weights, axes)
        # Each rank's mean and centred sum of squares (M2) come from two passes over its own
        # rows. Combining them, M2 = Σ M2_r + Σ n_r μ_r² − N μ², cancels as much as
        # E[x²] − E[x]² would when |μ| ≫ σ, so that step runs in float64: in float32 a mean of
        # 1000 with σ = 1 would lose ~5% of the variance (the test far from zero shows it).
        count, local_mean, local_variance = (tf.cast(t, tf.float64) for t in (count, local_mean, local_variance))
        local_sum = count * local_mean
        local_squares = count * local_variance + local_sum * local_mean
        total = ops.allreduce(tf.stack([count, local_sum, local_squares]), op=ops.Sum)
        count, total_sum, total_squares = tf.unstack(total)
        mean = tf.math.divide_no_nan(total_sum, count)
        variance = tf.maximum(tf.math.divide_no_nan(total_squares - total_sum * mean, count), 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
