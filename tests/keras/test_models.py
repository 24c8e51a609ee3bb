"""kerasdist.models: each reference model builds, runs a forward pass with the expected output
shape, has the parameter count computed here by hand (or quoted from its paper), and starts
from the same weights under the same seed. No collectives: every rank runs these alone."""

import keras
import numpy as np
import pytest

from kerasdist import models
from kerasdist.models.resnet import ZeroPaddedShortcut


def trainable_count(model):
    return sum(int(np.prod(weight.shape)) for weight in model.trainable_weights)


def dense_parameters(units_in, units_out):
    return units_in * units_out + units_out


def conv3x3_parameters(channels_in, channels_out, bias=True):
    return 9 * channels_in * channels_out + (channels_out if bias else 0)


def test_mlp_flattens_its_input_and_has_the_dense_parameters():
    model = models.mlp((8, 8, 1), 10, hidden=(32, 16))
    assert model.count_params() == dense_parameters(64, 32) + dense_parameters(32, 16) + dense_parameters(16, 10)
    probabilities = model(np.random.rand(4, 8, 8, 1)).numpy()
    assert probabilities.shape == (4, 10)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)


def test_mlp_adds_a_dropout_after_each_hidden_layer_and_can_return_logits():
    model = models.mlp((5,), 3, hidden=(4, 4, 4), dropout=0.2, classifier_activation=None)
    assert sum(isinstance(layer, keras.layers.Dropout) for layer in model.layers) == 3
    logits = model(np.random.rand(64, 5) * 10).numpy()
    assert not np.allclose(logits.sum(axis=1), 1.0)


@pytest.mark.parametrize("side", [8, 28])
def test_small_cnn_has_the_expected_parameters_and_output_shape(side):
    model = models.small_cnn(input_shape=(side, side, 1), num_classes=10)
    pooled_side = side // 4  # two 2x2 poolings after "same" convolutions
    assert model.count_params() == (
        conv3x3_parameters(1, 32) + conv3x3_parameters(32, 64) + dense_parameters(pooled_side * pooled_side * 64, 10)
    )
    assert model(np.zeros((3, side, side, 1))).shape == (3, 10)


def test_small_cnn_learns_the_8x8_digits():
    from sklearn.datasets import load_digits

    keras.utils.set_random_seed(0)
    digits = load_digits()
    images, labels = digits.images[..., None] / 16.0, digits.target
    model = models.small_cnn(input_shape=(8, 8, 1), num_classes=10)
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(images[:1400], labels[:1400], batch_size=32, epochs=3, verbose=0)
    _, accuracy = model.evaluate(images[1400:], labels[1400:], verbose=0)
    assert accuracy > 0.85


def option_a_resnet_trainable_parameters(depth, num_classes=10):
    """He et al. 2016, 4.2: 3x3 convolutions without bias, each with a batch norm (gamma, beta);
    identity shortcuts, zero-padded where the width changes, add nothing."""
    blocks = (depth - 2) // 6
    total = conv3x3_parameters(3, 16, bias=False) + 2 * 16
    channels_in = 16
    for width in (16, 32, 64):
        for _ in range(blocks):
            total += conv3x3_parameters(channels_in, width, bias=False) + 2 * width
            total += conv3x3_parameters(width, width, bias=False) + 2 * width
            channels_in = width
    return total + dense_parameters(64, num_classes)


def test_resnet20_has_the_papers_parameter_count_and_output_shape():
    model = models.cifar_resnet(depth=20)
    assert trainable_count(model) == option_a_resnet_trainable_parameters(20) == 269_722
    assert round(trainable_count(model) / 1e6, 2) == 0.27  # He et al. 2016, Table 6
    assert model.name == "resnet20"
    assert model(np.zeros((2, 32, 32, 3))).shape == (2, 10)


def test_resnet56_matches_table_6():
    model = models.cifar_resnet(depth=56)
    assert trainable_count(model) == option_a_resnet_trainable_parameters(56)
    assert round(trainable_count(model) / 1e6, 2) == 0.85


def test_cifar_resnet_has_6n_plus_2_weighted_layers():
    model = models.cifar_resnet(depth=32, input_shape=(17, 17, 3), num_classes=4)
    weighted = [layer for layer in model.layers if isinstance(layer, (keras.layers.Conv2D, keras.layers.Dense))]
    assert len(weighted) == 32
    assert model(np.zeros((1, 17, 17, 3))).shape == (1, 4)  # odd sides halve to 9, then 5


@pytest.mark.parametrize("depth", [0, 19, 21])
def test_cifar_resnet_rejects_depths_that_are_not_6n_plus_2(depth):
    with pytest.raises(ValueError, match="6n \\+ 2"):
        models.cifar_resnet(depth=depth)


def test_zero_padded_shortcut_subsamples_and_appends_zero_channels():
    inputs = np.random.rand(2, 5, 4, 3).astype("float32")
    outputs = ZeroPaddedShortcut(8)(inputs).numpy()
    expected = np.concatenate([inputs[:, ::2, ::2, :], np.zeros((2, 3, 2, 5), "float32")], axis=-1)
    np.testing.assert_array_equal(outputs, expected)


def test_cifar_resnet_survives_saving_and_loading(tmp_path):
    model = models.cifar_resnet(depth=8, input_shape=(16, 16, 3))
    path = str(tmp_path / "resnet8.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    images = np.random.rand(2, 16, 16, 3).astype("float32")
    np.testing.assert_allclose(restored(images), model(images), rtol=1e-6, atol=1e-7)


def test_resnet50_is_the_keras_application_with_its_parameter_count():
    model = models.resnet50(input_shape=(64, 64, 3))
    assert model.count_params() == 25_636_712
    assert model(np.zeros((1, 64, 64, 3))).shape == (1, 1000)


@pytest.mark.parametrize(
    "build",
    [
        lambda: models.mlp((6,), 3, hidden=(8,)),
        lambda: models.small_cnn(input_shape=(8, 8, 1)),
        lambda: models.cifar_resnet(depth=8, input_shape=(8, 8, 3)),
    ],
    ids=["mlp", "small_cnn", "cifar_resnet"],
)
def test_weights_are_reproducible_under_a_seed(build):
    def weights_with_seed(seed):
        keras.utils.set_random_seed(seed)
        return [weight.numpy() for weight in build().weights]

    first, again, other = weights_with_seed(1), weights_with_seed(1), weights_with_seed(2)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(first, other))
