"""SyncBatchNormalization against batch normalization of the global batch, computed without it.

Every rank builds the same global batch from a seed and takes its own rows; rank r holds
2·(r + 1) of them, so the ranks' batches differ in size and the counts must travel with the
sums. References are NumPy formulas in float64, or plain `keras.layers.BatchNormalization` run
on the whole global batch in this one process.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist as kd
from kerasdist import ops
from kerasdist.layers import SyncBatchNormalization

kd.init()
RANK, SIZE = kd.rank(), kd.size()
ROWS = [2 * (r + 1) for r in range(SIZE)]  # rank r's local batch size
SHAPE = (2, 3)  # per-row shape: 2 positions of 3 channels, so the statistics reduce axes 0 and 1
EPSILON = 1e-3
MOMENTUM = 0.75
GAMMA = np.float32([0.5, 1.5, 2.0])
BETA = np.float32([0.1, -0.2, 0.3])
MOVING_MEAN = np.float32([0.2, -0.1, 0.0])
MOVING_VARIANCE = np.float32([1.5, 0.5, 2.0])

multi_rank = pytest.mark.skipif(SIZE == 1, reason="needs 2 or more ranks: in a world of one nothing is synchronised")


def global_batch(seed=0, offset=0.0):
    rng = np.random.default_rng(seed)
    scale = np.float32([1.0, 3.0, 0.5])
    return (offset + rng.normal(size=(sum(ROWS), *SHAPE)) * scale + [1.0, -2.0, 0.5]).astype("float32")


def local_rows(array):
    """This rank's rows of a global-batch array."""
    start = sum(ROWS[:RANK])
    return array[start : start + ROWS[RANK]]


def numpy_batch_norm(x, mean, variance):
    return GAMMA * (x - mean) / np.sqrt(variance + EPSILON) + BETA


def make_layer(layer_class=SyncBatchNormalization, **kwargs):
    layer = layer_class(**{"momentum": MOMENTUM, "epsilon": EPSILON, **kwargs})
    layer.build((None, *SHAPE))
    layer.set_weights([GAMMA, BETA, MOVING_MEAN, MOVING_VARIANCE])
    return layer


def test_training_output_and_moving_statistics_are_those_of_the_global_batch():
    x = global_batch()
    mean, variance = x.astype("float64").mean(axis=(0, 1)), x.astype("float64").var(axis=(0, 1))
    layer = make_layer()

    output = layer(local_rows(x), training=True)

    np.testing.assert_allclose(output.numpy(), local_rows(numpy_batch_norm(x, mean, variance)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.moving_mean.numpy(), MOMENTUM * MOVING_MEAN + (1 - MOMENTUM) * mean, rtol=1e-5)
    np.testing.assert_allclose(
        layer.moving_variance.numpy(), MOMENTUM * MOVING_VARIANCE + (1 - MOMENTUM) * variance, rtol=1e-5
    )


def test_masked_positions_count_on_no_rank():
    x = global_batch(seed=1)
    mask = np.random.default_rng(2).random((len(x), SHAPE[0])) < 0.6
    mask[: ROWS[0]] = False  # rank 0 contributes nothing: its count is 0
    weights = np.broadcast_to(mask[..., None], x.shape)
    count = weights.sum(axis=(0, 1))
    if SIZE == 1:  # rank 0's rows are the whole batch, all masked: Keras's rule gives 0 and 0
        mean, variance = np.zeros(3), np.zeros(3)
    else:
        mean = (x * weights).sum(axis=(0, 1)) / count
        variance = (weights * (x - mean) ** 2).sum(axis=(0, 1)) / count
    layer = make_layer(momentum=0.0)

    layer(local_rows(x), training=True, mask=local_rows(mask))

    np.testing.assert_allclose(layer.moving_mean.numpy(), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.moving_variance.numpy(), variance, rtol=1e-5, atol=1e-6)


def test_statistics_stay_accurate_for_inputs_far_from_zero():
    # mean 1000, standard deviation ~1: E[x²] − E[x]² in float32 would lose ~5% of the variance
    x = global_batch(seed=3, offset=1000.0)
    layer = make_layer(momentum=0.0)

    layer(local_rows(x), training=True)

    np.testing.assert_allclose(layer.moving_variance.numpy(), x.astype("float64").var(axis=(0, 1)), rtol=1e-4)


def reference_gradients(x, upstream):
    """d/d(x, gamma, beta) of sum(output · upstream) for plain BatchNormalization on the global batch."""
    layer = make_layer(keras.layers.BatchNormalization)
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(layer(x, training=True) * upstream)
    return [g.numpy() for g in tape.gradient(loss, [x, layer.gamma, layer.beta])]


@pytest.mark.parametrize("mode", ["eager", "tf.function"])
def test_input_gradients_include_the_other_ranks_outputs_and_averaged_weight_gradients_match(mode):
    x = global_batch(seed=4)
    upstream = np.random.default_rng(5).normal(size=x.shape).astype("float32")  # fixed weights of the loss
    expected_x, expected_gamma, expected_beta = reference_gradients(x, upstream)
    layer = make_layer()

    def local_gradients(x, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            # This rank's part of the global loss, sum over ranks of sum(output · upstream).
            loss = tf.reduce_sum(layer(x, training=True) * upstream)
        return tape.gradient(loss, [x, layer.gamma, layer.beta])

    if mode == "tf.function":
        local_gradients = tf.function(local_gradients)
    grad_x, grad_gamma, grad_beta = local_gradients(tf.constant(local_rows(x)), tf.constant(local_rows(upstream)))

    np.testing.assert_allclose(grad_x.numpy(), local_rows(expected_x), rtol=1e-4, atol=1e-5)
    # DistributedOptimizer averages them; the global loss here is the sum over ranks, so size × average.
    for grad, expected in ((grad_gamma, expected_gamma), (grad_beta, expected_beta)):
        averaged = kd.allreduce(grad, op=kd.Average).numpy()
        np.testing.assert_allclose(SIZE * averaged, expected, rtol=1e-4, atol=1e-5)


FEATURES = 3
PER_RANK_BATCH = 4
STEPS = 3


def fit_model(normalization):
    keras.utils.set_random_seed(7)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(4),
            normalization(momentum=0.5),
            keras.layers.Activation("tanh"),
            keras.layers.Dense(1),
        ]
    )


def test_fit_equals_one_process_with_plain_batch_normalization_on_the_global_batch():
    rng = np.random.default_rng(8)
    global_size = SIZE * PER_RANK_BATCH
    x = rng.normal(size=(STEPS * global_size, FEATURES)).astype("float32") * [1.0, 2.0, 0.5] + [0.0, 1.0, -1.0]
    y = (x @ rng.normal(size=(FEATURES, 1))).astype("float32")
    # Ranks that built different numbers of models before (say an evaluation model on rank 0)
    # give layers different automatic names: the collective's name must not depend on them.
    for _ in range(RANK):
        keras.Sequential([keras.Input((1,)), SyncBatchNormalization()]).build((None, 1))
    reference = fit_model(keras.layers.BatchNormalization)
    reference.compile(keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    reference.fit(x, y, batch_size=global_size, epochs=2, shuffle=False, verbose=0)

    model = fit_model(SyncBatchNormalization)
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
    steps = [
        slice(s * global_size + RANK * PER_RANK_BATCH, s * global_size + (RANK + 1) * PER_RANK_BATCH)
        for s in range(STEPS)
    ]
    model.fit(
        np.concatenate([x[s] for s in steps]),
        np.concatenate([y[s] for s in steps]),
        batch_size=PER_RANK_BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=kd.callbacks(),
    )

    # every weight, the moving mean and variance included
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


class CountingAllreduce:
    def __init__(self, allreduce):
        self.allreduce, self.calls = allreduce, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.allreduce(*args, **kwargs)


def test_inference_uses_the_moving_statistics_and_runs_no_collective(monkeypatch):
    counting = CountingAllreduce(ops.allreduce)
    monkeypatch.setattr(ops, "allreduce", counting)
    monkeypatch.setattr(ops, "grouped_allreduce", counting)
    x = global_batch(seed=9)
    layer = make_layer()

    output = layer(local_rows(x), training=False)

    np.testing.assert_allclose(output.numpy(), numpy_batch_norm(local_rows(x), MOVING_MEAN, MOVING_VARIANCE), rtol=1e-5)
    np.testing.assert_array_equal(layer.moving_mean.numpy(), MOVING_MEAN)
    assert counting.calls == 0


@multi_rank
def test_training_makes_one_allreduce_per_call(monkeypatch):
    counting = CountingAllreduce(ops.allreduce)
    monkeypatch.setattr(ops, "allreduce", counting)
    layer = make_layer()

    layer(local_rows(global_batch()), training=True)

    assert counting.calls == 1


@pytest.mark.skipif(SIZE > 1, reason="in a world of one only: with more ranks the statistics differ by design")
@pytest.mark.parametrize("masked", [False, True])
def test_in_a_world_of_one_it_is_batch_normalization_exactly(masked):
    x = global_batch(seed=10)
    mask = np.random.default_rng(11).random((len(x), SHAPE[0])) < 0.7 if masked else None
    sync, plain = make_layer(), make_layer(keras.layers.BatchNormalization)

    outputs = [layer(x, training=True, mask=mask).numpy() for layer in (sync, plain)]

    np.testing.assert_array_equal(outputs[0], outputs[1])
    for got, expected in zip(sync.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(got, expected)


def test_float16_inputs_give_float16_outputs_from_float32_statistics():
    x = global_batch(seed=12).astype("float16")
    mean, variance = x.astype("float64").mean(axis=(0, 1)), x.astype("float64").var(axis=(0, 1))
    layer = make_layer(dtype="mixed_float16")

    output = layer(local_rows(x), training=True)

    assert output.dtype == tf.float16 and layer.moving_mean.dtype == "float32"
    np.testing.assert_allclose(
        output.numpy().astype("float64"), local_rows(numpy_batch_norm(x.astype("float64"), mean, variance)), atol=1e-2
    )
    np.testing.assert_allclose(layer.moving_mean.numpy(), MOMENTUM * MOVING_MEAN + (1 - MOMENTUM) * mean, rtol=1e-5)


@multi_rank
def test_under_xla_it_fails_at_trace_time_naming_the_layer_and_the_fix():
    layer = make_layer()
    with pytest.raises(ValueError, match="SyncBatchNormalization.*jit_compile=False"):
        tf.function(lambda x: layer(x, training=True), jit_compile=True)(tf.constant(local_rows(global_batch())))


def test_synchronized_true_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="synchronized=True"):
        SyncBatchNormalization(synchronized=True)


def test_get_config_round_trips_and_both_import_paths_name_the_class():
    layer = SyncBatchNormalization(axis=1, momentum=0.9, epsilon=1e-4, center=False, renorm=True)
    config = layer.get_config()
    rebuilt = SyncBatchNormalization.from_config(config)
    assert rebuilt.get_config() == config
    assert (rebuilt.axis, rebuilt.momentum, rebuilt.epsilon, rebuilt.center, rebuilt.renorm) == (
        1,
        0.9,
        1e-4,
        False,
        True,
    )
    assert keras.saving.get_registered_name(SyncBatchNormalization) == "kerasdist>SyncBatchNormalization"
    assert kd.SyncBatchNormalization is kd.layers.SyncBatchNormalization is SyncBatchNormalization


def test_a_saved_model_with_the_layer_loads_with_its_statistics(tmp_path):
    model = keras.Sequential([keras.Input(SHAPE), make_layer()])
    model.layers[0](local_rows(global_batch(seed=13)), training=True)  # moving statistics move
    path = tmp_path / "model.keras"
    model.save(path)

    restored = keras.saving.load_model(path)

    assert isinstance(restored.layers[0], SyncBatchNormalization)
    for got, expected in zip(restored.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, expected)
    x = global_batch(seed=14)
    np.testing.assert_array_equal(restored.predict(x, verbose=0), model.predict(x, verbose=0))
