"""Reference models for kerasdist's examples and benchmarks: plain, uncompiled Keras 3 models.

Nothing is downloaded: weights start from Keras's initializers, so
`keras.utils.set_random_seed(s)` before the call makes them reproducible. All take
channels-last images (Keras's default) and end in a `num_classes`-way `Dense` layer with
`classifier_activation` (`"softmax"`, or `None` for logits), as `keras.applications` does.
`cifar_resnet` uses a small custom layer registered with Keras, so `keras.saving.load_model`
finds it once `kerasdist.models` is imported.
"""

from kerasdist.models.resnet import cifar_resnet, resnet50
from kerasdist.models.simple import mlp, small_cnn

__all__ = ["cifar_resnet", "mlp", "resnet50", "small_cnn"]
