"""Keras layers that compute across ranks: `SyncBatchNormalization`.

The layer is registered as a Keras serializable under the package "kerasdist"
(`"kerasdist>SyncBatchNormalization"`): once this module is imported, `keras.saving.load_model`
needs no `custom_objects` for it.
"""

from kerasdist.layers.sync_batch_normalization import SyncBatchNormalization

__all__ = ["SyncBatchNormalization"]
