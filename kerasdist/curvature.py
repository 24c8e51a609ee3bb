"""The top Hessian eigenvalue of a model's loss, by power iteration.

Public path of `kerasdist.batch_growth.curvature`, where it lives beside the batch growth that
uses it.
"""

from kerasdist.batch_growth.curvature import HessianEigenpair, HessianPowerIteration, top_hessian_eigenvalue

__all__ = ["HessianEigenpair", "HessianPowerIteration", "top_hessian_eigenvalue"]
