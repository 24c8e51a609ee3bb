"""Residual networks (He, Zhang, Ren, Sun 2016): the CIFAR family and ResNet-50."""

import keras


@keras.saving.register_keras_serializable(package="kerasdist")
class ZeroPaddedShortcut(keras.layers.Layer):
    """The paper's option A shortcut where a stage halves the resolution: keep every second
    row and column and append zero channels up to `filters`, adding no parameters."""

    def __init__(self, filters, **kwargs):
        super().__init__(**kwargs)
        self.filters = filters

    def call(self, inputs):
        subsampled = inputs[:, ::2, ::2, :]
        extra_channels = self.filters - inputs.shape[-1]
        return keras.ops.pad(subsampled, [[0, 0], [0, 0], [0, 0], [0, extra_channels]])

    def get_config(self):
        return {**super().get_config(), "filters": self.filters}


def _conv_bn(x, filters, strides=1):
    x = keras.layers.Conv2D(
        filters, 3, strides=strides, padding="same", use_bias=False, kernel_initializer="he_normal"
    )(x)
    return keras.layers.BatchNormalization()(x)


def _basic_block(x, filters, strides):
    shortcut = x if strides == 1 else ZeroPaddedShortcut(filters)(x)
    y = keras.layers.ReLU()(_conv_bn(x, filters, strides))
    y = _conv_bn(y, filters)
    return keras.layers.ReLU()(keras.layers.Add()([shortcut, y]))


def cifar_resnet(depth=20, input_shape=(32, 32, 3), num_classes=10, classifier_activation="softmax", name=None):
    """The CIFAR-10 ResNet of He et al. 2016, section 4.2: `depth = 6n + 2` layers.

    A 3x3 convolution with 16 filters, then three stages of `n` basic blocks (two 3x3
    convolutions, each followed by batch normalisation) with 16, 32 and 64 filters, the last two
    stages starting at stride 2; global average pooling and the classifier. Shortcuts are
    identities, zero-padded where the shape changes (the paper's option A), so parameter counts
    match the paper: about 0.27M for ResNet-20, 0.46M for 32, 0.66M for 44, 0.85M for 56 and
    1.7M for 110. Convolutions start from He-normal weights. The paper trains with SGD,
    momentum 0.9 and weight decay 1e-4, batch 128, learning rate 0.1 divided by 10 at 32k and
    48k steps.

    Args:
        depth: Int, `6n + 2` for some `n >= 1` (20, 32, 44, 56, 110, ...). Defaults to 20.
        input_shape: Tuple `(height, width, channels)`. Defaults to `(32, 32, 3)`.
        num_classes: Int, the number of output units. Defaults to 10.
        classifier_activation: The output activation; `None` returns logits. Defaults to
            `"softmax"`.
        name: The model's name. Defaults to `f"resnet{depth}"`.

    Returns:
        An uncompiled `keras.Model`.

    Example:

    ```python
    import numpy as np
    from kerasdist.models import cifar_resnet

    model = cifar_resnet(depth=20)
    print(model.count_params())                                          # 271098
    print(sum(int(np.prod(w.shape)) for w in model.trainable_weights))  # 269722
    probabilities = model(np.zeros((2, 32, 32, 3)))                      # shape (2, 10)
    ```

    References:
        - He, Zhang, Ren, Sun, "Deep Residual Learning for Image Recognition", CVPR 2016,
          arXiv 1512.03385.
    """
    if depth < 8 or (depth - 2) % 6:
        raise ValueError(f"cifar_resnet: depth must be 6n + 2 with n >= 1 (20, 32, 44, 56, 110, ...); got {depth}")
    blocks_per_stage = (depth - 2) // 6
    inputs = keras.Input(shape=input_shape)
    x = keras.layers.ReLU()(_conv_bn(inputs, 16))
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(blocks_per_stage):
            x = _basic_block(x, filters, strides=2 if stage > 0 and block == 0 else 1)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(num_classes, activation=classifier_activation)(x)
    return keras.Model(inputs, outputs, name=name or f"resnet{depth}")


def resnet50(input_shape=(224, 224, 3), num_classes=1000, classifier_activation="softmax", name="resnet50"):
    """ResNet-50 (He et al. 2016) as `keras.applications.ResNet50`, randomly initialised.

    25,636,712 parameters with 1000 classes (25,583,592 trainable), whatever the input size;
    each side of the input must be at least 32.

    Args:
        input_shape: Tuple `(height, width, 3)`. Defaults to `(224, 224, 3)`.
        num_classes: Int, the number of output units. Defaults to 1000.
        classifier_activation: The output activation; `None` returns logits. Defaults to
            `"softmax"`.
        name: The model's name.

    Returns:
        An uncompiled `keras.Model`.

    Example:

    ```python
    from kerasdist.models import resnet50

    model = resnet50(input_shape=(64, 64, 3), num_classes=100)
    print(model.count_params())  # 23792612
    ```

    References:
        - He, Zhang, Ren, Sun, "Deep Residual Learning for Image Recognition", CVPR 2016,
          arXiv 1512.03385.
    """
    return keras.applications.ResNet50(
        weights=None,
        input_shape=input_shape,
        classes=num_classes,
        classifier_activation=classifier_activation,
        name=name,
    )
