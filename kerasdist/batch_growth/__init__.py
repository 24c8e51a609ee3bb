"""Adaptive batch growth: grow the effective batch while training, from what the loss says.

- `AdaptiveBatchGrowth` (also `kerasdist.callbacks.AdaptiveBatchGrowth`), the callback: at its
  checks it asks a signal, multiplies k (`DistributedOptimizer.backward_passes_per_step`)
  through `DistributedOptimizer.set_backward_passes_per_step`, and rescales the learning rate
  (`kerasdist.learning_rate`).
- `signals`: `GrowthSignal`, the interface the callback uses, and the two signals behind
  `signal="noise_scale"` and `signal="curvature"`.
- `GradientNoiseScale` (also `kerasdist.GradientNoiseScale`, defined in
  `kerasdist.gradient_statistics` beside the optimizer that feeds it): the statistics the
  optimizer gathers from every update.
- `top_hessian_eigenvalue` and `HessianPowerIteration` (defined in `kerasdist.curvature`, a
  tool of its own): the top Hessian eigenvalue by power iteration, which the curvature signal
  follows.
"""

from kerasdist.batch_growth.callback import AdaptiveBatchGrowth
from kerasdist.batch_growth.signals import CurvatureSignal, GrowthSignal, NoiseScaleSignal
from kerasdist.curvature import HessianEigenpair, HessianPowerIteration, top_hessian_eigenvalue
from kerasdist.gradient_statistics import GradientNoiseScale

__all__ = [
    "AdaptiveBatchGrowth",
    "CurvatureSignal",
    "GradientNoiseScale",
    "GrowthSignal",
    "HessianEigenpair",
    "HessianPowerIteration",
    "NoiseScaleSignal",
    "top_hessian_eigenvalue",
]
