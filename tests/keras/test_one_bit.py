"""1-bit gradients with error feedback (`DistributedOptimizer(one_bit_gradients=True)`).

The quantiser is checked value by value against NumPy; training is checked against a NumPy
simulation of every rank: each holds 8 rows of its own, adds its residual to its gradient,
keeps `corrected - scale * sign`, and every rank applies the mean of all ranks' `scale * sign`.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from linear_task import BATCH, assert_weights, compiled_model, fit, shard, simulated_error_feedback_weights

import kerasdist as kd
from kerasdist.reductions import one_bit

kd.init()
RANK, SIZE = kd.rank(), kd.size()


@pytest.mark.parametrize("count", [1, 7, 8, 13, 1000])
def test_quantize_keeps_signs_and_mean_magnitude_and_loses_only_the_residual(count):
    values = np.random.default_rng(count).normal(size=count).astype("float32")
    values[::5] = 0.0  # zero counts as non-negative
    packed, scale, sent = (t.numpy() for t in one_bit.quantize(tf.constant(values)))
    assert packed.dtype == np.uint8 and packed.shape == (one_bit.packed_length(count),)
    expected_bits = np.packbits(np.pad(values >= 0, (0, (-count) % 8)), bitorder="little")
    np.testing.assert_array_equal(packed, expected_bits)
    np.testing.assert_allclose(scale, np.mean(np.abs(values)), rtol=1e-6)
    np.testing.assert_array_equal(sent, np.where(values >= 0, scale, -scale).astype("float32"))
    signs = np.where(values >= 0, 1.0, -1.0)
    decoded = one_bit.decode_mean(tf.constant(packed[np.newaxis]), tf.constant([1.0]), count).numpy()
    np.testing.assert_array_equal(decoded, signs)
    # two ranks' signs and scales, averaged: the second sends the opposite signs
    flipped = np.packbits(np.pad(values < 0, (0, (-count) % 8)), bitorder="little")
    decoded = one_bit.decode_mean(tf.constant(np.stack([packed, flipped])), tf.constant([0.5, 2.0]), count).numpy()
    np.testing.assert_allclose(decoded, (0.5 * signs - 2.0 * signs) / 2, rtol=1e-6)


def test_residual_plus_sent_is_the_corrected_gradient():
    residual = tf.Variable(tf.zeros([13]))
    gradient = tf.constant(np.random.default_rng(3).normal(size=13).astype("float32"))
    for _ in range(3):
        corrected = gradient.numpy() + residual.numpy()
        _, _, sent = one_bit.quantize(tf.constant(corrected))
        one_bit.reduce([gradient], [residual])
        # exact in float32: the residual is the corrected value minus what this rank sent
        np.testing.assert_array_equal(residual.numpy(), corrected - sent.numpy())
        np.testing.assert_allclose(residual.numpy() + sent.numpy(), corrected, rtol=0, atol=1e-6)


def simulated_weights(epochs):
    def one_bit(corrected):
        return np.where(corrected >= 0, 1.0, -1.0) * np.mean(np.abs(corrected))

    return simulated_error_feedback_weights(epochs, SIZE, one_bit)


def test_training_matches_every_rank_quantising_with_error_feedback():
    model = compiled_model(one_bit_gradients=True)
    fit(model, epochs=3)
    assert_weights(model, simulated_weights(3), rtol=1e-4, atol=1e-5)


def test_resumed_from_a_checkpoint_the_residuals_come_back(tmp_path):
    path = os.path.join(str(tmp_path), f"one_bit_rank{RANK}.keras")
    model = compiled_model(one_bit_gradients=True)
    fit(model, epochs=1)
    model.save(path)
    resumed = keras.saving.load_model(path)
    assert resumed.optimizer.one_bit_gradients
    fit(resumed, epochs=2)
    assert_weights(resumed, simulated_weights(3), rtol=1e-4, atol=1e-5)


def test_the_wire_carries_one_bit_per_value_and_a_scale_per_tensor():
    if SIZE == 1:
        pytest.skip("nothing is sent in a world of one")
    model = compiled_model(one_bit_gradients=True)
    x, y = (tf.constant(a[:BATCH]) for a in shard(RANK))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        model.optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    graph = step.get_concrete_function().graph
    sent = [
        op.inputs[0]
        for op in graph.get_operations()
        if op.type.startswith("Kerasdist") and op.type != "KerasdistExecutionCount"
    ]
    assert [op.type for op in graph.get_operations() if op.type.startswith("KerasdistAllreduce")] == []
    # kernel 3 values -> 1 byte, bias 1 value -> 1 byte, two float32 scales -> 8 bytes
    assert [(t.dtype, t.shape.as_list()) for t in sent] == [(tf.uint8, [1, 1 + 1 + 2 * 4])]


@pytest.mark.parametrize(
    "options, complaint",
    [
        ({"delay_gradients": True}, "delay_gradients"),
        ({"compression": kd.Compression.fp16}, "compression"),
        ({"gradient_noise_scale": kd.GradientNoiseScale()}, "one_bit_gradients"),
    ],
    ids=["delay", "compression", "noise_scale"],
)
def test_refuses_what_it_cannot_combine_with(options, complaint):
    with pytest.raises(ValueError, match=complaint):
        kd.DistributedOptimizer(keras.optimizers.SGD(0.1), one_bit_gradients=True, **options)
