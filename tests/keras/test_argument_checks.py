"""Arguments that used to be accepted without a word, or refused with a misleading message, are
refused on every rank before training: each error names what is wrong and what is allowed."""

import keras
import numpy as np
import pytest

import kerasdist as kd
from kerasdist.callbacks import AdaptiveBatchGrowth, ModelAveraging

kd.init()
RANK, SIZE = kd.rank(), kd.size()


def linear_model(optimizer):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer, loss="mse")
    return model


@pytest.mark.parametrize("argument", ["one_bit_gradients", "delay_gradients"])
@pytest.mark.parametrize("value", ["no", 2, 0, None])
def test_a_flag_that_is_not_a_bool_is_refused_by_name(argument, value):
    with pytest.raises(TypeError, match=rf"{argument}={value!r}: expected True or False"):
        kd.DistributedOptimizer(keras.optimizers.SGD(0.1), **{argument: value})


@pytest.mark.parametrize("batch_size", [0, -4, 2.5, True])
def test_a_noise_scale_batch_size_below_one_sample_is_refused(batch_size):
    with pytest.raises(ValueError, match=rf"batch_size={batch_size!r} must be an int >= 1"):
        kd.GradientNoiseScale(batch_size)
    noise = kd.GradientNoiseScale()
    with pytest.raises(ValueError, match="must be an int >= 1"):
        noise.batch_size = batch_size


def test_a_model_averaging_window_past_a_million_steps_is_refused():
    with pytest.raises(ValueError, match=r"at most 1000000 .*got 1000000000000"):
        ModelAveraging(10**12)
    assert ModelAveraging(10**6).every == 10**6


def test_a_window_function_returning_an_absurd_window_is_refused_at_the_epoch_start():
    model = linear_model(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match=r"every\(0\) must be .*at most 1000000"):
        model.fit(
            np.ones((4, 3)), np.ones((4, 1)), batch_size=2, verbose=0, callbacks=[ModelAveraging(lambda e: 10**7)]
        )


def test_one_bit_gradients_with_uneven_steps_are_refused_when_fit_starts():
    model = linear_model(kd.DistributedOptimizer(keras.optimizers.SGD(0.1), one_bit_gradients=True))
    rows = 4 + 2 * RANK  # ranks run different numbers of steps
    with pytest.raises(ValueError, match="does not work with one_bit_gradients=True"):
        model.fit(
            np.ones((rows, 3)), np.ones((rows, 1)), batch_size=2, verbose=0, callbacks=kd.callbacks(uneven_steps=True)
        )
    assert int(model.optimizer.iterations.numpy()) == 0  # refused before the first step


@pytest.mark.skipif(SIZE > 1, reason="several ranks give the noise scale two batch sizes with k = 1")
def test_noise_scale_growth_in_one_process_without_micro_batches_is_refused_at_fit_start():
    model = linear_model(kd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    growth = AdaptiveBatchGrowth(signal="noise_scale", batch_size=2)
    with pytest.raises(ValueError, match="needs two batch sizes .* would never grow"):
        model.fit(np.ones((4, 3)), np.ones((4, 1)), batch_size=2, verbose=0, callbacks=[growth])
    assert int(model.optimizer.iterations.numpy()) == 0


@pytest.mark.skipif(SIZE > 1, reason="several ranks give the noise scale two batch sizes with k = 1")
def test_noise_scale_growth_in_one_process_that_will_grow_when_overdue_says_why_it_logs_nan():
    model = linear_model(kd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    growth = AdaptiveBatchGrowth(signal="noise_scale", batch_size=2, max_epochs_without_growth=1)
    with pytest.warns(UserWarning, match="B_noise is nan until max_epochs_without_growth=1 grows the batch"):
        model.fit(np.ones((4, 3)), np.ones((4, 1)), batch_size=2, verbose=0, callbacks=[growth])


@pytest.mark.skipif(SIZE < 2, reason="models can differ between ranks only with 2 or more ranks")
def test_a_different_model_on_one_rank_is_named_as_such_on_every_rank():
    units = 4 + (RANK == SIZE - 1)  # the last rank's hidden layer is one unit wider
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(units), keras.layers.Dense(1)])
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    with pytest.raises(ValueError, match="the ranks' models or optimizer states differ") as error:
        model.fit(np.ones((4, 3)), np.ones((4, 1)), batch_size=2, verbose=0, callbacks=kd.callbacks())
    assert f"rank 0 has '{model.weights[0].path}' of shape (3, 4)" in str(error.value)
    assert f"rank {SIZE - 1} has '{model.weights[0].path}' of shape (3, 5)" in str(error.value)
