"""Every variable of the model and of each of its optimizers is rank 0's before any step uses it,
also when `fit`'s first step creates them: a subclassed model without input shapes, a custom
`train_step` with two optimizers (a GAN's shape), a model partly built before `fit`, eagerly or
traced. Checked against one plain Keras process started from rank 0's seed, on the global batch."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist as kd

kd.init()
RANK, SIZE = kd.rank(), kd.size()
ROWS_PER_RANK, BATCH, EPOCHS = 8, 2, 2


def global_data():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(ROWS_PER_RANK * SIZE, 4)).astype("float32")
    y = rng.normal(size=(ROWS_PER_RANK * SIZE, 1)).astype("float32")
    return x, y


def this_rank_s_rows(array):
    """Step t of every rank together is rows [t·B·size, (t+1)·B·size) of the global data."""
    steps = ROWS_PER_RANK // BATCH
    blocks = array.reshape(steps, SIZE, BATCH, *array.shape[1:])
    return blocks[:, RANK].reshape(ROWS_PER_RANK, *array.shape[1:])


class TwoOptimizers(keras.Model):
    """A GAN's shape: a generator and a critic, each with its own optimizer, built by the first step."""

    def __init__(self):
        super().__init__()
        self.generator = keras.layers.Dense(3)
        self.critic = keras.layers.Dense(1)

    def compile(self, generator_optimizer, critic_optimizer, **kwargs):
        super().compile(**kwargs)
        self.generator_optimizer = generator_optimizer
        self.critic_optimizer = critic_optimizer

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            critic_loss = tf.reduce_mean(tf.square(self.critic(self.generator(x)) - y))
        variables = self.critic.trainable_variables
        self.critic_optimizer.apply(tape.gradient(critic_loss, variables), variables)
        with tf.GradientTape() as tape:
            generator_loss = tf.reduce_mean(tf.square(self.critic(self.generator(x)) - 1.0))
        variables = self.generator.trainable_variables
        self.generator_optimizer.apply(tape.gradient(generator_loss, variables), variables)
        return {"critic_loss": critic_loss, "generator_loss": generator_loss}


class PartlyBuilt(keras.Model):
    """Built before `fit` (`model.built`), but its second layer only by the first call."""

    def __init__(self):
        super().__init__()
        self.first = keras.layers.Dense(3)
        self.second = keras.layers.Dense(1)

    def build(self, input_shape):
        self.first.build(input_shape)
        self.built = True

    def call(self, x):
        return self.second(self.first(x))


def two_optimizer_model(distributed, run_eagerly):
    model = TwoOptimizers()
    wrap = kd.DistributedOptimizer if distributed else (lambda optimizer: optimizer)
    model.compile(wrap(keras.optimizers.Adam(0.05)), wrap(keras.optimizers.SGD(0.1)), run_eagerly=run_eagerly)
    return model


def partly_built_model(distributed, run_eagerly):
    model = PartlyBuilt()
    model.build((None, 4))
    optimizer = keras.optimizers.Adam(0.05)
    model.compile(kd.DistributedOptimizer(optimizer) if distributed else optimizer, loss="mse", run_eagerly=run_eagerly)
    return model


MODELS = {"two optimizers": two_optimizer_model, "partly built": partly_built_model}


def weights_after_training(make_model, distributed, run_eagerly):
    x, y = global_data()
    # Each rank starts from weights of its own; one process starts from rank 0's.
    keras.utils.set_random_seed(RANK if distributed else 0)
    model = make_model(distributed, run_eagerly)
    if distributed:
        x, y = this_rank_s_rows(x), this_rank_s_rows(y)
        batch, callbacks = BATCH, [kd.callbacks.BroadcastGlobalState()]
    else:
        batch, callbacks = BATCH * SIZE, []
    model.fit(x, y, batch_size=batch, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
    return [v.numpy() for v in model.variables]


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["traced", "eager"])
@pytest.mark.parametrize("kind", MODELS)
def test_a_model_built_by_the_first_step_trains_as_one_process_does(kind, run_eagerly, capfd):
    trained = weights_after_training(MODELS[kind], distributed=True, run_eagerly=run_eagerly)
    expected = weights_after_training(MODELS[kind], distributed=False, run_eagerly=run_eagerly)
    assert len(trained) == len(expected)
    for got, want in zip(trained, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Nothing had to be repaired at the first update: the weights were rank 0's before the step.
    assert "different trainable weights" not in capfd.readouterr().err
