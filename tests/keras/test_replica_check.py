"""The replica check: ranks that stop holding the same model end training with an error naming
the first difference, on every rank; what is each rank's own by design raises nothing."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist as kd
from kerasdist.callbacks import ReplicaCheck

kd.init()
RANK, SIZE = kd.rank(), kd.size()
needs_two_ranks = pytest.mark.skipif(SIZE < 2, reason="ranks can differ only between 2 or more ranks")


def data(rows=16, seed=3):
    rng = np.random.default_rng([seed, RANK])
    return rng.normal(size=(rows, 3)).astype("float32"), rng.normal(size=(rows, 1)).astype("float32")


def compiled(*layers, optimizer=None):
    keras.utils.set_random_seed(RANK)
    model = keras.Sequential([keras.Input((3,)), *layers, keras.layers.Dense(1)])
    model.compile(optimizer or kd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.5)), loss="mse")
    return model


def fit(model, callbacks, epochs=2, **options):
    x, y = data()
    return model.fit(x, y, batch_size=4, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks, **options)


class OnRank(keras.callbacks.Callback):
    """Runs `action(model)` at the end of epoch `epoch` (or after batch `batch`) on rank `rank` only."""

    def __init__(self, rank, action, epoch=None, batch=None):
        super().__init__()
        self.rank, self.action, self.epoch, self.batch = rank, action, epoch, batch
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        if self.batch is not None and self.batches == self.batch and RANK == self.rank:
            self.action(self.model)

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch and RANK == self.rank:
            self.action(self.model)


def test_the_default_callbacks_end_with_the_replica_check():
    assert isinstance(kd.callbacks()[-1], ReplicaCheck)
    assert kd.callbacks()[-1].every_n_steps is None
    assert kd.callbacks(check_replicas=5)[-1].every_n_steps == 5
    assert not any(isinstance(callback, ReplicaCheck) for callback in kd.callbacks(check_replicas="off"))


@pytest.mark.parametrize("value", ["sometimes", 0, -2, 1.5, True])
def test_a_bad_check_replicas_value_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=rf"check_replicas={value!r}: expected 'epoch', 'off' or a whole number"):
        kd.callbacks(check_replicas=value)


def test_training_that_keeps_the_replicas_equal_passes_every_check():
    model = compiled(keras.layers.Dense(4, activation="relu"), keras.layers.Dropout(0.2))
    history = fit(model, kd.callbacks(check_replicas=1), epochs=2)
    assert len(history.history["loss"]) == 2


@needs_two_ranks
def test_a_learning_rate_changed_on_one_rank_is_named_with_every_rank_s_value():
    model = compiled()
    halve = OnRank(SIZE - 1, lambda m: m.optimizer.learning_rate.assign(0.025), epoch=0)
    with pytest.raises(kd.ReplicaDivergenceError) as error:
        fit(model, kd.callbacks(extra=[halve]), epochs=3)
    message = str(error.value)
    assert "at the end of epoch 1" in message
    assert f"the learning rate of optimizer '{model.optimizer.name}'" in message
    others = "rank 0 has 0.05" if SIZE == 2 else f"ranks {', '.join(map(str, range(SIZE - 1)))} have 0.05"
    assert f"{others}, rank {SIZE - 1} has 0.025" in message
    assert "ReduceLROnPlateau" in message  # the likely cause, named
    assert int(model.optimizer.iterations.numpy()) == 4  # stopped in the epoch it happened, not later


@needs_two_ranks
def test_a_weight_changed_on_one_rank_is_named_with_how_far_it_is_from_rank_0_s():
    model = compiled(keras.layers.Dense(2))

    def nudge(m):
        kernel = m.layers[0].kernel
        kernel.assign(kernel.numpy() + np.array([[0.0, 0.375]] + [[0.0, 0.0]] * 2, "float32"))

    with pytest.raises(kd.ReplicaDivergenceError) as error:
        fit(model, kd.callbacks(extra=[OnRank(1, nudge, epoch=1)]), epochs=3)
    message = str(error.value)
    assert f"variable '{model.layers[0].kernel.path}'" in message
    assert "rank 1 has values up to 0.375 from rank 0's" in message
    assert ("rank 0 has" if SIZE == 2 else "ranks 0, 2 have") + " rank 0's values" in message
    assert "at the end of epoch 2" in message


@needs_two_ranks
def test_with_a_step_interval_a_difference_is_found_at_the_next_checked_step():
    model = compiled()
    change = OnRank(1, lambda m: m.layers[0].bias.assign([1.0]), batch=3)  # 4 steps an epoch
    with pytest.raises(kd.ReplicaDivergenceError, match="after step 4 of this fit"):
        fit(model, [kd.callbacks.BroadcastGlobalState(), change, ReplicaCheck(every_n_steps=2)], epochs=2)


@needs_two_ranks
def test_on_divergence_warn_warns_on_every_rank_and_training_goes_on():
    model = compiled()
    change = OnRank(1, lambda m: m.layers[0].bias.assign([1.0]), epoch=0)
    with pytest.warns(UserWarning, match="the ranks no longer hold the same training state at the end of epoch 1"):
        history = fit(model, [kd.callbacks.BroadcastGlobalState(), change, ReplicaCheck(on_divergence="warn")])
    assert len(history.history["loss"]) == 2


@needs_two_ranks
def test_a_variable_named_per_rank_may_differ():
    model = compiled()
    change = OnRank(1, lambda m: m.layers[0].bias.assign([1.0]), epoch=0)
    fit(model, [kd.callbacks.BroadcastGlobalState(), change, ReplicaCheck(per_rank=["*/bias"])])


@needs_two_ranks
def test_a_restore_on_some_ranks_only_is_refused_before_the_first_step(tmp_path):
    # The probe's case: BackupAndRestore on rank 0 only, after a run that left its backup behind.
    backup = os.path.join(kd.broadcast_object(str(tmp_path)), "backup")
    on_root = [keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)] if RANK == 0 else []
    fit(compiled(), on_root + kd.callbacks(), epochs=2)
    model = compiled()
    with pytest.raises(ValueError, match="holds state on rank 0 and none yet on rank 1.*BackupAndRestore"):
        fit(model, on_root + kd.callbacks(), epochs=4)


class StartAt(keras.callbacks.Callback):
    """Resumes `fit` at `epoch` on this rank, as a backup callback would."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_train_begin(self, logs=None):
        self.model._initial_epoch = self.epoch


@needs_two_ranks
def test_ranks_that_start_at_different_epochs_are_refused_before_the_first_step():
    model = compiled()
    with pytest.raises(kd.ReplicaDivergenceError) as error:
        fit(model, [StartAt(2 if RANK == 0 else 0)] + kd.callbacks(), epochs=4)
    message = str(error.value)
    assert "started, so each would go on training its own model. the epoch: rank 0 has epoch 3, rank" in message
    assert "epoch 1" in message and "BackupAndRestore" in message
    assert int(model.optimizer.iterations.numpy()) == 0  # not one step paired across epochs


@needs_two_ranks
@pytest.mark.parametrize(
    "callback, what",
    [
        (lambda: keras.callbacks.ReduceLROnPlateau("loss", patience=1), "ReduceLROnPlateau changes the learning rate"),
        (
            lambda: keras.callbacks.EarlyStopping("loss", restore_best_weights=True),
            "EarlyStopping restores the best epoch's weights",
        ),
    ],
)
def test_a_decision_from_per_rank_metrics_is_refused_before_training(callback, what):
    model = compiled()
    with pytest.raises(ValueError, match=rf"{what} .*each rank's own \(no kerasdist.callbacks.MetricAverage"):
        fit(model, kd.callbacks(average_metrics=False, extra=[callback()]))
    assert int(model.optimizer.iterations.numpy()) == 0


@needs_two_ranks
def test_the_same_decisions_from_averaged_metrics_pass():
    model = compiled()
    extra = [
        keras.callbacks.ReduceLROnPlateau("loss", patience=0, factor=0.5, min_delta=10.0),
        keras.callbacks.EarlyStopping("loss", patience=1, min_delta=10.0, restore_best_weights=True),
    ]
    fit(model, kd.callbacks(extra=extra), epochs=4)
    assert float(model.optimizer.learning_rate.numpy()) < 0.05  # the rate was reduced, alike everywhere


@needs_two_ranks
def test_the_moving_statistics_of_batch_normalization_are_each_rank_s_own():
    model = compiled(keras.layers.BatchNormalization())
    fit(model, kd.callbacks(check_replicas=1))
    moving_means = kd.allgather_object(model.layers[0].moving_mean.numpy().tolist())
    assert moving_means[0] != moving_means[1]  # they differed, and no check objected


@needs_two_ranks
def test_the_moving_statistics_of_sync_batch_normalization_are_checked():
    model = compiled(kd.SyncBatchNormalization())
    change = OnRank(1, lambda m: m.layers[0].moving_mean.assign([0.5, 0.5, 0.5]), epoch=0)
    with pytest.raises(kd.ReplicaDivergenceError, match="moving_mean"):
        fit(model, kd.callbacks(extra=[change]))


@needs_two_ranks
def test_model_averaging_with_each_rank_s_own_optimizer_slots_raises_nothing():
    model = compiled(optimizer=keras.optimizers.SGD(0.05, momentum=0.5))
    averaging = kd.callbacks.ModelAveraging(every=3, average_optimizer_state=False)
    fit(model, [kd.callbacks.BroadcastGlobalState(), averaging, ReplicaCheck(every_n_steps=1)])


@needs_two_ranks
def test_the_same_values_in_another_order_on_one_rank_are_a_difference():
    values = [1.0, 2.0, 3.0, 4.0]
    weights = tf.Variable(values[::-1] if RANK == 1 else values, name="swapped")  # equal sums of bits
    with pytest.raises(kd.ReplicaDivergenceError, match="variable 'swapped"):
        kd.check_replicas(weights)


@needs_two_ranks
def test_check_replicas_in_a_custom_loop_names_the_variable():
    weights = tf.Variable([1.0, 2.0, 3.0 + RANK], name="weights")
    with pytest.raises(kd.ReplicaDivergenceError, match="variable 'weights:0'|variable 'weights'"):
        kd.check_replicas(weights, epoch=0)
    kd.check_replicas(tf.Variable([1.0, 2.0]), epoch=0)  # equal: returns


@needs_two_ranks
def test_ranks_with_different_models_are_told_which_variable_differs_in_shape():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2 + RANK)])
    with pytest.raises(kd.ReplicaDivergenceError, match=r"rank 0 has variable '.*kernel' \[3, 2\] float32, rank 1 has"):
        kd.check_replicas(model)


def test_check_replicas_refuses_what_it_cannot_compare():
    with pytest.raises(TypeError, match="expected Keras models, optimizers or variables"):
        kd.check_replicas("model")
    with pytest.raises(ValueError, match="on_divergence='ignore'"):
        kd.check_replicas(on_divergence="ignore")
