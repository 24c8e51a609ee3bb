"""How gradients travel between ranks: the `reduction=` of `kerasdist.DistributedOptimizer`.

`Allreduce` (the default) averages them exactly, optionally in a 16-bit wire format; `Delayed`
applies each update's gradients one update later, so that their allreduce overlaps the next
step; `OneBit` sends one sign bit per value with error feedback. `GradientReduction` is the base
to subclass for a method of your own.
"""

from kerasdist.reductions.allreduce import Allreduce, reduce_gradients
from kerasdist.reductions.base import GradientReduction
from kerasdist.reductions.delayed import Delayed
from kerasdist.reductions.one_bit import OneBit

__all__ = ["Allreduce", "Delayed", "GradientReduction", "OneBit", "reduce_gradients"]
