"""Large-batch optimizers: LARS, LAMB and LARC (a trust ratio around any optimizer), with their
last per-layer trust ratios readable.

Pure Keras 3 (no collectives), so importable without kerasdist's compiled library. The classes
are registered as Keras serializables under the package "kerasdist" (`"kerasdist>LARS"`,
`"kerasdist>LAMB"`, `"kerasdist>LARC"`): once this module is imported, `keras.saving.load_model`
needs no `custom_objects` for them.
"""

from kerasdist.optimizers.lamb import LAMB
from kerasdist.optimizers.larc import LARC
from kerasdist.optimizers.lars import LARS

__all__ = ["LAMB", "LARC", "LARS"]
