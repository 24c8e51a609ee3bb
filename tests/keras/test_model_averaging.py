"""Periodic model averaging (local SGD, the ModelAveraging callback) against a NumPy simulation.

Every rank holds 8 rows of its own and trains a linear model with SGD (momentum 0.5) on batches
of 2, so an epoch is 4 steps. In the simulation each rank's weights and momentum move alone, and
after every `every` steps, and at each epoch's last step, every rank takes their mean (momentum
too, unless the test keeps it per rank). NumPy alone computes that for all ranks, on every rank.
"""

import keras
import numpy as np
import pytest

import kerasdist as kd
from kerasdist.callbacks import ModelAveraging

kd.init()
RANK, SIZE = kd.rank(), kd.size()
FEATURES, ROWS, BATCH, EPOCHS, LR, MOMENTUM = 3, 8, 2, 3, 0.05, 0.5
STEPS = ROWS // BATCH


def shard(rank):
    rng = np.random.default_rng([rank, 11])
    x = rng.normal(size=(ROWS, FEATURES))
    y = x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3 + 0.1 * rng.normal(size=(ROWS, 1))
    return x.astype("float32"), y.astype("float32")


def simulated_run(every, momentum, average_momentum):
    """The weights after training, and how many times the ranks averaged."""
    w = [np.full((FEATURES, 1), 0.2) for _ in range(SIZE)]
    b = [np.zeros(1) for _ in range(SIZE)]
    vw = [np.zeros((FEATURES, 1)) for _ in range(SIZE)]
    vb = [np.zeros(1) for _ in range(SIZE)]
    shards = [shard(r) for r in range(SIZE)]
    averages = 0
    for epoch in range(EPOCHS):
        window = every(epoch) if callable(every) else every
        since = 0
        for step in range(STEPS):
            for r, (x, y) in enumerate(shards):
                xb, yb = x[step * BATCH : (step + 1) * BATCH], y[step * BATCH : (step + 1) * BATCH]
                error = xb @ w[r] + b[r] - yb
                gw, gb = 2 / BATCH * xb.T @ error, 2 / BATCH * error.sum(0)
                vw[r] = momentum * vw[r] - LR * gw  # Keras SGD: m = momentum * m - lr * g; w += m
                vb[r] = momentum * vb[r] - LR * gb
                w[r], b[r] = w[r] + vw[r], b[r] + vb[r]
            since += 1
            if since == window or step == STEPS - 1:
                since = 0
                if SIZE > 1:
                    averages += 1
                    averaged = [w, b, vw, vb] if average_momentum else [w, b]
                    for per_rank in averaged:
                        per_rank[:] = [np.mean(per_rank, axis=0)] * SIZE
    return (w[RANK], b[RANK]), averages


def local_fit(callback, momentum=MOMENTUM, optimizer=None):
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
    model.set_weights([np.full((FEATURES, 1), 0.2, "float32"), np.zeros(1, "float32")])
    model.compile(optimizer or keras.optimizers.SGD(LR, momentum=momentum), loss="mse")
    x, y = shard(RANK)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[callback])
    return model


@pytest.mark.parametrize(
    "every, average_momentum",
    [(1, True), (3, True), (3, False), (lambda epoch: epoch + 1, True)],
    ids=["every_step", "every_3_steps", "every_3_steps_momentum_kept", "window_growing_per_epoch"],
)
def test_weights_and_momentum_match_the_simulation(every, average_momentum):
    callback = ModelAveraging(every, average_optimizer_state=average_momentum)
    model = local_fit(callback)
    (w, b), averages = simulated_run(every, MOMENTUM, average_momentum)
    kernel, bias = model.get_weights()
    np.testing.assert_allclose(kernel, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bias, b, rtol=1e-5, atol=1e-6)
    assert callback.averages == averages
    if SIZE > 1:
        # Averaged at each epoch's end: every rank holds the same model there.
        everyone = kd.allgather_object(kernel.tobytes())
        assert len(set(everyone)) == 1


def test_averaging_every_step_with_plain_sgd_is_synchronous_sgd_on_the_global_batch():
    """The claim in the docstring, against plain Keras in one process on every rank's batches."""
    model = local_fit(ModelAveraging(1), momentum=0.0)
    reference = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
    reference.set_weights([np.full((FEATURES, 1), 0.2, "float32"), np.zeros(1, "float32")])
    reference.compile(keras.optimizers.SGD(LR), loss="mse")
    shards = [shard(r) for r in range(SIZE)]
    for _ in range(EPOCHS):
        for step in range(STEPS):
            rows = slice(step * BATCH, (step + 1) * BATCH)
            # Equal batches: the gradient of the mean loss over their union is the mean of theirs.
            reference.train_on_batch(
                np.concatenate([x[rows] for x, _ in shards]), np.concatenate([y[rows] for _, y in shards])
            )
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_distributed_optimizer_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="Compile the model with the plain optimizer"):
        local_fit(ModelAveraging(2), optimizer=kd.DistributedOptimizer(keras.optimizers.SGD(LR)))


@pytest.mark.parametrize("every", [0, -1, 2.5, True, "4"])
def test_a_window_that_is_not_a_positive_int_is_refused(every):
    with pytest.raises(ValueError, match="must be an int >= 1"):
        ModelAveraging(every)


def test_kerasdist_callbacks_places_it_before_the_metric_averaging():
    callbacks = kd.callbacks(average_models_every=4)
    kinds = [type(c).__name__ for c in callbacks]
    assert kinds.index("ModelAveraging") < kinds.index("MetricAverage")
