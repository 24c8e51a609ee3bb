"""The gradient noise scale of McCandlish et al. 2018, "An Empirical Model of Large-Batch Training".

Data-parallel training computes gradients at two batch sizes anyway: each rank's micro-batch
gradient g (batch B_small = b) and the averaged gradient ḡ (batch B_big = b · ranks · k, with
k accumulated micro-batches). Since E‖g_B‖² = |G|² + tr(Σ)/B, two sizes give unbiased estimates

    |G|²  = (B_big·‖ḡ‖² − B_small·mean‖g‖²) / (B_big − B_small)
    tr(Σ) = (mean‖g‖² − ‖ḡ‖²) / (1/B_small − 1/B_big)

and the critical batch size B_noise = tr(Σ)/|G|², taken as a ratio of two exponential moving
averages (the ratio of unbiased estimates is biased; the EMAs also smooth their high variance).
With ranks × k = 2 or more this costs one scalar per update, reduced in the gradients' own
grouped allreduce. One process with k = 1 has only one batch size and no estimate.
"""

import math

import keras
import tensorflow as tf


class GradientNoiseScale:
    """Tracks B_noise, the batch size beyond which larger batches stop paying off.

    Attach it to a `DistributedOptimizer` (`gradient_noise_scale=`); every update then feeds it
    the mean squared norm of the micro-batch gradients (across ranks and accumulated
    micro-batches) and the squared norm of the averaged gradient. The statistics live in
    variables updated inside the train step, so reading them costs nothing until you do.

    Args:
        batch_size: the per-rank micro-batch size b (samples per `apply()`), needed to express
            tr(Σ) and B_noise in samples. Can be set later (`noise.batch_size = 64`).
        ema_decay: decay of the two moving averages. Defaults to 0.95.

    Example:

    ```python
    import keras, kerasdist
    kerasdist.init()
    noise = kerasdist.GradientNoiseScale(batch_size=32)
    optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2,
                                               gradient_noise_scale=noise)
    # after some training: noise.noise_scale() is B_noise in samples
    ```
    """

    def __init__(self, batch_size=None, ema_decay=0.95):
        if not 0.0 < ema_decay < 1.0:
            raise ValueError(f"ema_decay={ema_decay!r} must be in (0, 1)")
        self.batch_size = batch_size
        self.ema_decay = ema_decay
        self._variables = None

    @property
    def batch_size(self):
        return self._samples_per_micro_batch

    @batch_size.setter
    def batch_size(self, value):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"GradientNoiseScale: batch_size={value!r} must be an int >= 1 (samples per rank)")
        self._samples_per_micro_batch = value

    def build(self, optimizer):
        """Creates the statistics' variables through `optimizer` (so they are saved with it).

        Example:

        ```python
        import keras, kerasdist
        noise = kerasdist.GradientNoiseScale(batch_size=32)
        noise.build(keras.optimizers.SGD(0.1))
        print(noise.built, noise.updates, noise.noise_scale())  # True 0 nan
        ```
        """

        def scalar(name):
            return optimizer.add_variable(shape=(), dtype="float32", name=name)

        self._variables = {
            name: scalar(name)
            for name in (
                "noise_gradient_sq_ema",
                "noise_trace_ema",
                "noise_updates",
                "noise_last_gradient_sq",
                "noise_last_trace",
            )
        }

    @property
    def built(self):
        return self._variables is not None

    def update(self, small_batch_sq_norm, big_batch_sq_norm, big_over_small):
        """Feeds one update's statistics (in the train step).

        `small_batch_sq_norm` is the mean ‖g‖² over micro-batch gradients, `big_batch_sq_norm`
        is ‖ḡ‖², and `big_over_small` = B_big / B_small = ranks × k. tr(Σ) is kept in units of
        the micro-batch (times b gives samples).

        Example:

        One update of 4 micro-batches whose gradients' mean squared norm is 12 and whose
        average's is 6: |G|² = (4·6 − 12)/3 = 4, tr(Σ) = (12 − 6)/(1 − 1/4) = 8 per micro-batch.

        ```python
        import keras, kerasdist
        noise = kerasdist.GradientNoiseScale(batch_size=32)
        noise.build(keras.optimizers.SGD(0.1))
        noise.update(12.0, 6.0, big_over_small=4)
        print(noise.updates)  # 1
        noise.update(12.0, 6.0, big_over_small=1)  # one batch size only: no estimate
        print(noise.updates)  # 1
        ```
        """
        big_over_small = tf.cast(big_over_small, tf.float32)
        usable = big_over_small > 1.0
        safe_ratio = tf.where(usable, big_over_small, 2.0)
        gradient_sq = (safe_ratio * big_batch_sq_norm - small_batch_sq_norm) / (safe_ratio - 1.0)
        trace_in_micro_batches = (small_batch_sq_norm - big_batch_sq_norm) / (1.0 - 1.0 / safe_ratio)
        v = self._variables
        decay = self.ema_decay

        def fold_in():
            v["noise_last_gradient_sq"].assign(gradient_sq)
            v["noise_last_trace"].assign(trace_in_micro_batches)
            v["noise_gradient_sq_ema"].assign(decay * v["noise_gradient_sq_ema"] + (1 - decay) * gradient_sq)
            v["noise_trace_ema"].assign(decay * v["noise_trace_ema"] + (1 - decay) * trace_in_micro_batches)
            v["noise_updates"].assign_add(1.0)

        tf.cond(usable, fold_in, lambda: None)

    def _value(self, name):
        if not self.built:
            return math.nan
        return float(keras.ops.convert_to_numpy(self._variables[name]))

    @property
    def updates(self):
        """How many updates have been folded into the averages (0 before `build`).

        Example:

        ```python
        import keras, kerasdist
        noise = kerasdist.GradientNoiseScale(batch_size=32)
        print(noise.updates)  # 0
        noise.build(keras.optimizers.SGD(0.1))
        noise.update(12.0, 6.0, big_over_small=4)
        print(noise.updates)  # 1
        ```
        """
        return int(self._value("noise_updates")) if self.built else 0

    def gradient_sq_norm(self):
        """The smoothed estimate of |G|², the squared norm of the true gradient.

        Example:

        One update of 4 micro-batches whose gradients' mean squared norm is 12 and whose
        average's is 6: |G|² = (4·6 − 12)/3 = 4, tr(Σ) = (12 − 6)/(1 − 1/4) = 8 per micro-batch.

        ```python
        import keras, kerasdist
        noise = kerasdist.GradientNoiseScale(batch_size=32)
        noise.build(keras.optimizers.SGD(0.1))
        noise.update(12.0, 6.0, big_over_small=4)
        print(round(noise.gradient_sq_norm(), 4))  # 4.0
        ```
        """
        return self._debiased("noise_gradient_sq_ema")

    def trace_covariance(self):
        """The smoothed estimate of tr(Σ), per sample (needs `batch_size`).

        Example:

        One update of 4 micro-batches whose gradients' mean squared norm is 12 and whose
        average's is 6: |G|² = (4·6 − 12)/3 = 4, tr(Σ) = (12 − 6)/(1 − 1/4) = 8 per micro-batch.

        ```python
        import keras, kerasdist
        noise = kerasdist.GradientNoiseScale(batch_size=32)
        noise.build(keras.optimizers.SGD(0.1))
        noise.update(12.0, 6.0, big_over_small=4)
        print(round(noise.trace_covariance(), 4))  # 256.0
        ```
        """
        return self._debiased("noise_trace_ema") * self._batch_size()

    def noise_scale(self):
        """B_noise = tr(Σ) / |G|² in samples, from the two moving averages (nan before any update).

        Example:

        One update of 4 micro-batches whose gradients' mean squared norm is 12 and whose
        average's is 6: |G|² = (4·6 − 12)/3 = 4, tr(Σ) = (12 − 6)/(1 − 1/4) = 8 per micro-batch.

        ```python
        import keras, kerasdist
        noise = kerasdist.GradientNoiseScale(batch_size=32)
        noise.build(keras.optimizers.SGD(0.1))
        noise.update(12.0, 6.0, big_over_small=4)
        print(round(noise.noise_scale(), 4))  # 64.0
        ```
        """
        if self.updates == 0:
            return math.nan
        return self._batch_size() * self._value("noise_trace_ema") / self._value("noise_gradient_sq_ema")

    def _debiased(self, name):
        updates = self.updates
        if updates == 0:
            return math.nan
        return self._value(name) / (1.0 - self.ema_decay**updates)

    def _batch_size(self):
        if not self.batch_size:
            raise ValueError("GradientNoiseScale needs batch_size (the per-rank micro-batch size) to report in samples")
        return float(self.batch_size)
