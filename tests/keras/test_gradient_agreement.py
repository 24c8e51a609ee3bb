"""Ranks whose gradients do not line up (a `None` gradient, or a variable trainable on some ranks
only) get an error on every rank that names the variable, the ranks and the fix, before any
gradient travels; ranks that agree train as before, whatever their layers are called."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist as kd

kd.init()
RANK, SIZE = kd.rank(), kd.size()
needs_two_ranks = pytest.mark.skipif(SIZE < 2, reason="needs at least 2 ranks (run under mpiexec -n 2)")
FEATURES, BATCH = 3, 4


def data():
    rng = np.random.default_rng(RANK)
    return rng.normal(size=(4 * BATCH, FEATURES)).astype("float32"), rng.normal(size=(4 * BATCH, 1)).astype("float32")


class TwoBranches(keras.Model):
    """`first(x)`, plus `second(x)` when `uses_second`; both layers are built either way."""

    def __init__(self, uses_second):
        super().__init__()
        self.first = keras.layers.Dense(1, name="first")
        self.second = keras.layers.Dense(1, name="second")
        self.uses_second = uses_second

    def call(self, x):
        if self.uses_second:
            return self.first(x) + self.second(x)
        return self.first(x)


def two_branch_model(uses_second):
    keras.utils.set_random_seed(1)
    model = TwoBranches(uses_second)
    model.build((None, FEATURES))
    model.second.build((None, FEATURES))
    return model


@needs_two_ranks
def test_a_gradient_that_is_none_on_one_rank_only_is_named_on_every_rank():
    model = two_branch_model(uses_second=RANK != SIZE - 1)  # the last rank never calls `second`
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x, y = data()
    with pytest.raises(tf.errors.OpError) as raised:
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=kd.callbacks())
    message = str(raised.value)
    assert "second/kernel" in message and "second/bias" in message, message
    assert f"no gradient on rank {SIZE - 1}" in message, message
    assert "a layer that some ranks do not use" in message, message


@needs_two_ranks
def test_a_variable_trainable_on_some_ranks_only_is_named_on_every_rank():
    if RANK == 0:  # earlier work took more automatic names here: the ranks number their layers apart
        keras.Sequential([keras.layers.Dense(1)])
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(4, name="hidden"), keras.layers.Dense(1)])
    model.get_layer("hidden").trainable = RANK != 1
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x, y = data()
    with pytest.raises(tf.errors.OpError) as raised:
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=kd.callbacks())
    message = str(raised.value)
    assert "The ranks train different variables" in message, message
    assert "hidden/kernel" in message and "hidden/bias" in message, message
    trainers = ", ".join(str(r) for r in range(SIZE) if r != 1)
    assert f"are trainable on rank{'s' if SIZE > 2 else ''} {trainers} but not trainable on rank 1." in message, message
    assert "`trainable`" in message, message


@needs_two_ranks
@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_a_tape_gradient_that_is_none_on_one_rank_only_is_named_on_every_rank(traced):
    used, sometimes_used = tf.Variable(1.0, name="used"), tf.Variable(2.0, name="sometimes_used")

    def step():
        with kd.DistributedGradientTape(tf.GradientTape()) as tape:
            loss = 3.0 * used + (sometimes_used if RANK != SIZE - 1 else 0.0)
        return tape.gradient(loss, [used, sometimes_used])

    with pytest.raises((ValueError, tf.errors.OpError)) as raised:
        tf.function(step)() if traced else step()
    assert f"'sometimes_used' has no gradient on rank {SIZE - 1}" in str(raised.value), str(raised.value)


def test_ranks_whose_layers_are_named_differently_train_as_usual():
    if RANK == 1:
        keras.layers.Dense(1)  # one more automatic name taken: this rank's layers are numbered on
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=kd.callbacks())
    every_ranks = kd.allgather_object(model.get_weights())
    for weights in every_ranks[1:]:
        for mine, rank_0s in zip(weights, every_ranks[0], strict=True):
            np.testing.assert_array_equal(mine, rank_0s)
