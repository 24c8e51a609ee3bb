"""`fit` with unequal steps per epoch (the Join callback), against a NumPy simulation of the run.

Rank r holds 4 + 2r training rows, so it runs 2 + r batches of 2 per epoch. At each step the
ranks that still have a batch contribute its mean-squared-error gradient; the applied gradient is
their mean (joined ranks send zeros and are not counted); every rank ends the epoch with the
weights of the rank that ran longest. The simulation below computes that with NumPy alone.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist as kd
from kerasdist.callbacks import Join, LearningRateWarmup

kd.init()
RANK, SIZE = kd.rank(), kd.size()
FEATURES, BATCH, EPOCHS, LR = 3, 2, 2, 0.05


def shard(rank, purpose="train"):
    rng = np.random.default_rng([rank, 0 if purpose == "train" else 1])
    rows = (4 + 2 * rank) if purpose == "train" else (3 + rank)
    x = rng.normal(size=(rows, FEATURES))
    y = x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3 + 0.1 * rng.normal(size=(rows, 1))
    return x.astype("float32"), y.astype("float32")


def linear_model():
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
    model.set_weights([np.full((FEATURES, 1), 0.2, "float32"), np.zeros(1, "float32")])
    return model


def simulated_run():
    """Per epoch: (weights after it, train loss over every rank's batches, val loss)."""
    w, b = np.full((FEATURES, 1), 0.2), np.zeros(1)
    shards = [shard(r) for r in range(SIZE)]
    val_x, val_y = map(np.concatenate, zip(*(shard(r, "val") for r in range(SIZE))))
    longest = max(len(x) for x, _ in shards) // BATCH
    epochs = []
    for _ in range(EPOCHS):
        weighted_losses, rows = 0.0, 0
        for step in range(longest):
            grads = []
            for x, y in shards:
                if step * BATCH < len(x):
                    xb, yb = x[step * BATCH : (step + 1) * BATCH], y[step * BATCH : (step + 1) * BATCH]
                    error = xb @ w + b - yb
                    weighted_losses += np.mean(error**2) * len(xb)
                    rows += len(xb)
                    grads.append((2 / len(xb) * xb.T @ error, 2 / len(xb) * error.sum(0)))
            w = w - LR * np.mean([g for g, _ in grads], axis=0)
            b = b - LR * np.mean([g for _, g in grads], axis=0)
        epochs.append((w.copy(), weighted_losses / rows, np.mean((val_x @ w + b - val_y) ** 2)))
    return epochs


def test_fit_with_unequal_steps_matches_the_simulation_on_every_rank():
    model = linear_model()
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    x, y = shard(RANK)
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        validation_data=shard(RANK, "val"),
        callbacks=kd.callbacks(uneven_steps=True),
    )
    expected = simulated_run()
    np.testing.assert_allclose(model.get_weights()[0], expected[-1][0], rtol=1e-5)
    np.testing.assert_allclose(history.history["loss"], [e[1] for e in expected], rtol=1e-5)
    np.testing.assert_allclose(history.history["val_loss"], [e[2] for e in expected], rtol=1e-5)
    gathered = kd.allgather_object([w.tobytes() for w in model.get_weights()])
    assert all(g == gathered[0] for g in gathered), "ranks ended the run with different weights"


class _RateAtEachStep(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.rates = {}

    def on_train_batch_begin(self, batch, logs=None):
        self.rates[(self._epoch, batch)] = float(self.model.optimizer.learning_rate)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch


def test_warmup_sets_the_same_rate_on_every_rank_at_each_step_whatever_the_callback_order():
    # The warmup reads steps per epoch at on_train_begin; listed before Join, it must still see
    # the longest rank's count, or ranks with fewer steps would warm up faster.
    model = linear_model()
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    recorder = _RateAtEachStep()
    callbacks = [LearningRateWarmup(warmup_epochs=2, scaling="linear"), recorder, *kd.callbacks()[:1], Join()]
    model.fit(*shard(RANK), batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
    everyone = kd.allgather_object(recorder.rates)
    for step, rate in recorder.rates.items():
        assert all(rates[step] == rate for rates in everyone if step in rates), (step, everyone)
    steps = 2 + (SIZE - 1)  # the longest rank's count: progress is measured in its steps
    assert recorder.rates[(0, 1)] == pytest.approx(LR * (1 + (SIZE - 1) * 1 / (2 * steps)), rel=1e-6)


def test_an_unknown_step_count_is_refused_on_every_rank_of_several():
    model = linear_model()
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    x, y = shard(RANK)
    unknown_length = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda *_: True).batch(BATCH)
    if SIZE == 1:  # nothing to join: fit runs as without Join
        model.fit(unknown_length, epochs=1, shuffle=False, verbose=0, callbacks=kd.callbacks(uneven_steps=True))
        return
    with pytest.raises(ValueError, match=r"Join needs every rank's number of steps per epoch.*assert_cardinality"):
        model.fit(unknown_length, epochs=1, shuffle=False, verbose=0, callbacks=kd.callbacks(uneven_steps=True))
    assert kd.allgather_object("after") == ["after"] * SIZE  # every rank got here: no hang
