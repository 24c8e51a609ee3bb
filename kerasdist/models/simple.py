"""Small models that train in seconds on a CPU: a multilayer perceptron and a small CNN."""

import keras


def mlp(
    input_shape,
    num_classes,
    hidden=(256, 128),
    activation="relu",
    dropout=0.0,
    classifier_activation="softmax",
    name="mlp",
):
    """A multilayer perceptron: flatten, `Dense` hidden layers, then the classifier.

    Args:
        input_shape: Tuple, the shape of one example, e.g. `(64,)` or `(8, 8, 1)`; it is
            flattened first.
        num_classes: Int, the number of output units.
        hidden: Sequence of ints, the units of each hidden layer. Defaults to `(256, 128)`.
        activation: The hidden layers' activation. Defaults to `"relu"`.
        dropout: Float in `[0, 1)`, the dropout rate after each hidden layer; 0 adds none.
        classifier_activation: The output activation; `None` returns logits. Defaults to
            `"softmax"`.
        name: The model's name.

    Returns:
        An uncompiled `keras.Model`.

    Example:

    ```python
    import numpy as np
    from kerasdist.models import mlp

    model = mlp((64,), 10, hidden=(64,))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(np.zeros((8, 64)), np.zeros(8), epochs=1, verbose=0)
    ```
    """
    inputs = keras.Input(shape=input_shape)
    x = keras.layers.Flatten()(inputs)
    for units in hidden:
        x = keras.layers.Dense(units, activation=activation)(x)
        if dropout:
            x = keras.layers.Dropout(dropout)(x)
    outputs = keras.layers.Dense(num_classes, activation=classifier_activation)(x)
    return keras.Model(inputs, outputs, name=name)


def small_cnn(
    input_shape=(28, 28, 1),
    num_classes=10,
    filters=(32, 64),
    dropout=0.5,
    classifier_activation="softmax",
    name="small_cnn",
):
    """A LeNet-style CNN (LeCun et al. 1998): per entry of `filters`, a 3x3 ReLU convolution
    and 2x2 max pooling; then flatten, dropout and the classifier.

    With the defaults this is Keras's "Simple MNIST convnet" example with `"same"` padding, so
    that it also takes scikit-learn's 8x8 digits: 50,186 parameters on 28x28x1 and 21,386 on
    8x8x1. Each side of the input must be at least `2 ** len(filters)`.

    Args:
        input_shape: Tuple `(height, width, channels)`. Defaults to `(28, 28, 1)`.
        num_classes: Int, the number of output units. Defaults to 10.
        filters: Sequence of ints, the filters of each convolution. Defaults to `(32, 64)`.
        dropout: Float in `[0, 1)`, the dropout rate before the classifier. Defaults to 0.5.
        classifier_activation: The output activation; `None` returns logits. Defaults to
            `"softmax"`.
        name: The model's name.

    Returns:
        An uncompiled `keras.Model`.

    Example:

    ```python
    from sklearn.datasets import load_digits
    from kerasdist.models import small_cnn

    digits = load_digits()
    model = small_cnn(input_shape=(8, 8, 1), num_classes=10)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(digits.images[..., None] / 16.0, digits.target, epochs=1, verbose=0)
    ```

    References:
        - LeCun, Bottou, Bengio, Haffner, "Gradient-Based Learning Applied to Document
          Recognition", Proceedings of the IEEE 86(11), 1998.
    """
    inputs = keras.Input(shape=input_shape)
    x = inputs
    for count in filters:
        x = keras.layers.Conv2D(count, 3, padding="same", activation="relu")(x)
        x = keras.layers.MaxPooling2D(2)(x)
    x = keras.layers.Flatten()(x)
    if dropout:
        x = keras.layers.Dropout(dropout)(x)
    outputs = keras.layers.Dense(num_classes, activation=classifier_activation)(x)
    return keras.Model(inputs, outputs, name=name)
