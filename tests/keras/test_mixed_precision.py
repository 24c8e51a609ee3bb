"""DistributedOptimizer under Keras mixed precision against one process on the union of the shards.

The reference is plain Keras in one process (its `compile` adds the `LossScaleOptimizer` for
mixed_float16), fed global batch t; rank r trains on slice r of that batch. The distributed
model must end with the reference's weights, loss scale and applied steps, and skip an
overflowing step when the reference does: on every rank together.
"""

import keras
import numpy as np
import pytest

import kerasdist as kd

kd.init()
RANK, SIZE = kd.rank(), kd.size()
PER_RANK_BATCH, STEPS, FEATURES = 4, 4, 5
# Forward and backward passes run in 16 bits, and the reference sums its global batch in
# another order than the ranks do: weights agree to 16-bit rounding, not bit for bit (measured
# at 2 and 3 ranks: 2e-5 for float16, 3e-4 for bfloat16; the weights move by about 0.1).
TOLERANCE = {"mixed_float16": 2e-4, "mixed_bfloat16": 2e-3}

WRAPPINGS = {
    # compile adds the loss scaling under mixed_float16
    "plain": lambda: keras.optimizers.SGD(0.05, momentum=0.5),
    "loss_scale_optimizer": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05, momentum=0.5)),
}


@pytest.fixture
def policy(request):
    keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    keras.mixed_precision.set_global_policy("float32")


def global_data(seed=0):
    rng = np.random.default_rng(seed)
    # Small values: at Keras's initial loss scale (2**15) no gradient overflows float16, neither
    # a rank's (the mean of its own rows) nor the reference's, so only the planted value skips.
    x = 0.5 * rng.normal(size=(STEPS * SIZE * PER_RANK_BATCH, FEATURES)).astype("float32")
    y = 0.2 * (x @ rng.normal(size=(FEATURES, 1)) + 0.1 * rng.normal(size=(len(x), 1))).astype("float32")
    return x, y


def this_ranks_rows(array):
    """Slice RANK of every global batch."""
    batches = array.reshape(STEPS, SIZE, PER_RANK_BATCH, -1)
    return batches[:, RANK].reshape(STEPS * PER_RANK_BATCH, -1)


def make_model():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])


def train_reference(make_optimizer, x, y):
    reference = make_model()
    reference.compile(make_optimizer(), loss="mse")
    reference.fit(x, y, batch_size=SIZE * PER_RANK_BATCH, shuffle=False, verbose=0)
    return reference


def train_distributed(make_optimizer, x, y):
    model = make_model()
    optimizer = kd.DistributedOptimizer(make_optimizer())
    model.compile(optimizer, loss="mse")
    assert model.optimizer is optimizer, "compile wrapped the DistributedOptimizer in a second loss scaler"
    model.fit(
        this_ranks_rows(x),
        this_ranks_rows(y),
        batch_size=PER_RANK_BATCH,
        shuffle=False,
        verbose=0,
        callbacks=kd.callbacks(),
    )
    return model


def loss_scale(optimizer):
    """The dynamic loss scale of the LossScaleOptimizer in or around `optimizer`."""
    while not hasattr(optimizer, "dynamic_scale"):
        optimizer = optimizer.inner_optimizer
    return float(optimizer.dynamic_scale.numpy())


def assert_same_training(model, reference, tolerance):
    for weights, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(weights, expected, atol=tolerance)
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())
    every_ranks_weights = kd.allgather_object(model.get_weights())
    for weights in every_ranks_weights[1:]:
        for w, w0 in zip(weights, every_ranks_weights[0]):
            np.testing.assert_array_equal(w, w0)


@pytest.mark.parametrize("wrapping", sorted(WRAPPINGS))
@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_float16_fit_equals_one_process_with_one_loss_scale(policy, wrapping):
    x, y = global_data()
    reference = train_reference(WRAPPINGS[wrapping], x, y)
    model = train_distributed(WRAPPINGS[wrapping], x, y)
    assert_same_training(model, reference, TOLERANCE[policy])
    assert loss_scale(model.optimizer) == loss_scale(reference.optimizer) == 2.0**15


@pytest.mark.parametrize("policy", ["mixed_bfloat16"], indirect=True)
def test_bfloat16_fit_equals_one_process(policy):
    x, y = global_data()
    reference = train_reference(WRAPPINGS["plain"], x, y)
    model = train_distributed(WRAPPINGS["plain"], x, y)
    assert_same_training(model, reference, TOLERANCE[policy])


@pytest.mark.parametrize("wrapping", sorted(WRAPPINGS))
@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_a_float16_overflow_on_one_rank_skips_that_step_on_every_rank(policy, wrapping):
    x, y = global_data()
    # A value beyond float16's range in the last rank's slice of global batch 1 only: that
    # rank's gradients are not finite, every other rank's are.
    overflowing_step, overflowing_rank = 1, SIZE - 1
    x[(overflowing_step * SIZE + overflowing_rank) * PER_RANK_BATCH, 0] = 1e6
    reference = train_reference(WRAPPINGS[wrapping], x, y)
    model = train_distributed(WRAPPINGS[wrapping], x, y)
    assert int(reference.optimizer.iterations.numpy()) == STEPS - 1  # the reference skipped it
    assert_same_training(model, reference, TOLERANCE[policy])
    assert loss_scale(model.optimizer) == loss_scale(reference.optimizer) == 2.0**14


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_a_saved_model_loads_with_its_loss_scale_and_no_second_scaler(policy, tmp_path):
    x, y = global_data()
    x[PER_RANK_BATCH * SIZE, 0] = 1e6  # global batch 1 overflows: the scale halves
    model = train_distributed(WRAPPINGS["plain"], x, y)
    path = tmp_path / f"rank{RANK}.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded.optimizer, kd.DistributedOptimizer)
    assert loss_scale(loaded.optimizer) == loss_scale(model.optimizer) == 2.0**14
    for saved, restored in zip(model.optimizer.variables, loaded.optimizer.variables, strict=True):
        np.testing.assert_array_equal(saved.numpy(), restored.numpy())


@pytest.mark.parametrize(
    "option",
    [dict(delay_gradients=True), dict(one_bit_gradients=True), dict(gradient_noise_scale=kd.GradientNoiseScale())],
    ids=["delay_gradients", "one_bit_gradients", "gradient_noise_scale"],
)
@pytest.mark.parametrize("wrapping", sorted(WRAPPINGS))
@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_options_that_keep_gradients_across_updates_refuse_loss_scaling(policy, wrapping, option):
    with pytest.raises(ValueError, match="not with loss scaling"):
        kd.DistributedOptimizer(WRAPPINGS[wrapping](), **option)


def test_an_optimizer_created_before_the_float16_policy_is_refused_at_fit():
    optimizer = kd.DistributedOptimizer(WRAPPINGS["plain"]())
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = make_model()
        model.compile(optimizer, loss="mse")
        x, y = global_data()
        with pytest.raises(ValueError, match=r"created before .*set_global_policy\('mixed_float16'\)"):
            model.fit(this_ranks_rows(x), this_ranks_rows(y), batch_size=PER_RANK_BATCH, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
