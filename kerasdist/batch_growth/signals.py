"""What tells `AdaptiveBatchGrowth` to grow: each signal measures one number and judges it.

A signal gets the model once (`set_model`), is measured at every check (`measure`, the same
float on every rank) and says whether a finite measurement calls for the grown batch
(`wants_more_batch`); it hears when the batch did grow (`batch_grew`), for whatever reason.
"""

from kerasdist.curvature import HessianPowerIteration


class GrowthSignal:
    """The interface `AdaptiveBatchGrowth` uses; see the module docstring.

    Attributes:
        name: the `signal=` name that selects it.
        log_key: the key of its measurement in the epoch logs and the callback's `history`.
    """

    name = None
    log_key = None

    def set_model(self, model, batch_size):
        """Takes the compiled model before training; `batch_size` is the per-rank batch of `fit`."""
        self.model = model

    def measure(self):
        """The current value, identical on every rank; nan when there is none yet."""
        raise NotImplementedError

    def wants_more_batch(self, value, grown_batch):
        """Whether the finite measurement `value` calls for growing the effective batch to `grown_batch`."""
        raise NotImplementedError

    def batch_grew(self, value):
        """Told after the batch grew at a check that measured `value`."""


class NoiseScaleSignal(GrowthSignal):
    """The critical batch B_noise (McCandlish et al. 2018) from the optimizer's gradient statistics.

    Grows while the grown batch stays at or below B_noise. The statistics are the optimizer's
    `gradient_statistics()`: its `GradientNoiseScale`, attached if it has none yet.
    """

    name = "noise_scale"
    log_key = "noise_scale"

    def set_model(self, model, batch_size):
        super().set_model(model, batch_size)
        self.statistics = model.optimizer.gradient_statistics(batch_size)

    def measure(self):
        return self.statistics.noise_scale()

    def wants_more_batch(self, value, grown_batch):
        return grown_batch <= value


class CurvatureSignal(GrowthSignal):
    """The top Hessian eigenvalue λ of the loss on a fixed sample (Yao et al. 2018, ABS).

    The first value is the reference λ_ref; the batch grows when λ ≤ λ_ref / 2, and whenever it
    grows λ_ref ← λ. Each rank evaluates on its own sample; the products are averaged
    (`HessianPowerIteration`).

    Args:
        curvature_data: `(x, y)`, a sample of this rank's data.
        loss_fn: the loss; defaults to the model's compiled loss.
        iterations, tolerance: the power-iteration budget.
    """

    name = "curvature"
    log_key = "hessian_top_eigenvalue"

    def __init__(self, curvature_data, loss_fn=None, iterations=10, tolerance=1e-2):
        if curvature_data is None:
            raise ValueError("signal='curvature' needs curvature_data=(x, y), a sample of this rank's data")
        self.curvature_data = curvature_data
        self.loss_fn = loss_fn
        self.iterations = iterations
        self.tolerance = tolerance
        self.reference_eigenvalue = None
        self._power_iteration = None

    def measure(self):
        if self._power_iteration is None:  # kept: it traces its tf.function once
            self._power_iteration = HessianPowerIteration(self.model, self.loss_fn or self.model.loss)
        x, y = self.curvature_data
        return self._power_iteration(x, y, iterations=self.iterations, tolerance=self.tolerance).eigenvalue

    def wants_more_batch(self, value, grown_batch):
        if self.reference_eigenvalue is None:
            self.reference_eigenvalue = value
            return False
        return value <= self.reference_eigenvalue / 2

    def batch_grew(self, value):
        self.reference_eigenvalue = value


def named_signal(name, curvature_data=None, loss_fn=None, iterations=10, tolerance=1e-2):
    """The built-in signal called `name` ("noise_scale" or "curvature"); the rest is the curvature's."""
    if name == NoiseScaleSignal.name:
        return NoiseScaleSignal()
    if name == CurvatureSignal.name:
        return CurvatureSignal(curvature_data, loss_fn, iterations, tolerance)
    raise ValueError(f"signal={name!r}; expected one of {(CurvatureSignal.name, NoiseScaleSignal.name)}")
