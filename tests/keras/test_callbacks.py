"""The default callbacks: global metrics, rank-0 output, warmup and schedules.

Expected values come from plain Keras on the union of every rank's data (each rank builds
all shards itself) or from the formulas in docs/algorithms.md written out here.
"""

import math

import keras
import numpy as np
import pytest

import kerasdist as kd
from kerasdist.callbacks import (
    BroadcastGlobalState,
    LearningRateMultiplier,
    LearningRateWarmup,
    MetricAverage,
    Rank0ProgbarLogger,
)
from kerasdist.optimizers import LARS

kd.init()
RANK, SIZE = kd.rank(), kd.size()


def classifier(seed=2):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    return model


def shard_of_unequal_size(rank, seed):
    """Rank r holds 5 + 3r rows: shards differ in size, so an average of per-rank means is wrong."""
    rng = np.random.default_rng([seed, rank])
    x = rng.normal(size=(5 + 3 * rank, 4)).astype("float32")
    return x, rng.integers(0, 3, size=len(x))


def union_of_shards(seed):
    shards = [shard_of_unequal_size(r, seed) for r in range(SIZE)]
    return np.concatenate([s[0] for s in shards]), np.concatenate([s[1] for s in shards])


def metrics():
    return ["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")]


def compiled(model):
    model.compile(
        kd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="sparse_categorical_crossentropy", metrics=metrics()
    )
    return model


def test_evaluate_is_exact_over_unequal_shards():
    model = compiled(classifier())
    x, y = shard_of_unequal_size(RANK, seed=7)
    model.fit(x[:4], y[:4], batch_size=2, verbose=0, callbacks=kd.callbacks())  # attaches MetricAverage
    got = model.evaluate(x, y, batch_size=3, verbose=0, return_dict=True)

    reference = classifier()
    reference.set_weights(model.get_weights())
    reference.compile(loss="sparse_categorical_crossentropy", metrics=metrics())
    all_x, all_y = union_of_shards(seed=7)
    expected = reference.evaluate(all_x, all_y, batch_size=3, verbose=0, return_dict=True)
    assert got.keys() == expected.keys()
    for name in expected:
        assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-6), name


def test_an_evaluation_on_rank_0_alone_runs_inside_local_metrics():
    model = compiled(classifier())
    x, y = shard_of_unequal_size(RANK, seed=7)
    model.fit(x[:4], y[:4], batch_size=2, verbose=0, callbacks=kd.callbacks())  # attaches MetricAverage
    if RANK == 0:
        with kd.callbacks.local_metrics(model):
            got = model.evaluate(x, y, batch_size=3, verbose=0, return_dict=True)
        reference = classifier()
        reference.set_weights(model.get_weights())
        reference.compile(loss="sparse_categorical_crossentropy", metrics=metrics())
        expected = reference.evaluate(x, y, batch_size=3, verbose=0, return_dict=True)
        assert got == pytest.approx(expected, rel=1e-6)
    assert kd.allgather_object("after") == ["after"] * SIZE  # the other ranks were not needed
    assert model.evaluate(x, y, verbose=0) == pytest.approx(kd.allgather_object(model.evaluate(x, y, verbose=0))[0])


def test_metrics_with_count_tables_are_exact_too():
    # AUC, precision and recall keep per-threshold counts, not a total and a count.
    def binary_model():
        keras.utils.set_random_seed(4)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
        model.compile(
            loss="binary_crossentropy",
            metrics=[
                keras.metrics.AUC(num_thresholds=50, name="auc"),
                keras.metrics.Precision(name="precision"),
                keras.metrics.Recall(name="recall"),
            ],
        )
        return model

    x, y = shard_of_unequal_size(RANK, seed=15)
    model = binary_model()  # the same weights on every rank (same seed)
    got = model.evaluate(x, y % 2, batch_size=3, verbose=0, return_dict=True, callbacks=[MetricAverage()])
    reference = binary_model()
    all_x, all_y = union_of_shards(seed=15)
    expected = reference.evaluate(all_x, all_y % 2, batch_size=3, verbose=0, return_dict=True)
    for name in expected:
        assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-6), name


def test_epoch_logs_are_global_and_equal_on_every_rank():
    model = compiled(classifier())
    x, y = shard_of_unequal_size(RANK, seed=8)
    vx, vy = shard_of_unequal_size(RANK, seed=9)
    # 2 steps per epoch on every rank (5+3r rows cut to 4), unequal validation shards
    history = model.fit(
        x[:4], y[:4], batch_size=2, epochs=2, validation_data=(vx, vy), verbose=0, callbacks=kd.callbacks()
    )
    logs = {name: values[-1] for name, values in history.history.items()}
    everyone = kd.allgather_object(logs)
    assert all(other == everyone[0] for other in everyone)

    reference = classifier()
    reference.set_weights(model.get_weights())
    reference.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    all_vx, all_vy = union_of_shards(seed=9)
    expected = reference.evaluate(all_vx, all_vy, verbose=0, return_dict=True)
    assert logs["val_loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert logs["val_accuracy"] == pytest.approx(expected["accuracy"], abs=1e-7)


def test_train_loss_in_the_logs_is_over_every_ranks_batches():
    # One step per epoch: the logged train loss is the loss before the step, on the union.
    model = compiled(classifier())
    x, y = shard_of_unequal_size(RANK, seed=10)
    before = classifier()
    before.compile(loss="sparse_categorical_crossentropy")
    history = model.fit(x[:4], y[:4], batch_size=4, epochs=1, verbose=0, callbacks=kd.callbacks())
    rows = [shard_of_unequal_size(r, seed=10) for r in range(SIZE)]
    expected = before.evaluate(
        np.concatenate([r[0][:4] for r in rows]), np.concatenate([r[1][:4] for r in rows]), verbose=0
    )
    assert history.history["loss"][0] == pytest.approx(expected, rel=1e-5)


def test_only_the_root_rank_prints_progress(capsys):
    model = compiled(classifier())
    x, y = shard_of_unequal_size(RANK, seed=11)
    model.fit(x[:4], y[:4], batch_size=2, epochs=2, verbose=1, callbacks=kd.callbacks())
    printed = capsys.readouterr().out
    if RANK == 0:
        assert "Epoch 2/2" in printed and "loss" in printed
    else:
        assert printed == ""


def test_callbacks_module_is_callable_and_orders_its_list(tmp_path):
    callbacks = kd.callbacks(warmup_epochs=2, csv_path=tmp_path / f"log{RANK}.csv")
    kinds = [type(c) for c in callbacks]
    assert kinds[:3] == [BroadcastGlobalState, MetricAverage, LearningRateWarmup]
    assert kinds[-3:] == [Rank0ProgbarLogger, kd.callbacks.StopAgreement, kd.callbacks.ReplicaCheck]
    assert (keras.callbacks.CSVLogger in kinds) == (RANK == 0)
    assert kd.callbacks.default_callbacks is not None and kd.callbacks.MetricAverage is MetricAverage


class LearningRateProbe(keras.callbacks.Callback):
    """Records the rate each step runs with and the velocity's change across each rate change:
    `velocity_ratios[i]` is how step `ratio_steps[i]` found the velocity the step before left."""

    def __init__(self):
        super().__init__()
        self.rates, self.velocity_ratios, self.ratio_steps = [], [], []
        self._velocity_after_last_step = None

    def _velocity(self):
        inner = self.model.optimizer.inner_optimizer
        if not inner.built:
            return None
        slots = inner._velocities if isinstance(inner, LARS) else inner.momentums  # SGD's are "momentums"
        return slots[0].numpy().copy() if slots else None

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(float(self.model.optimizer.learning_rate.numpy()))
        now = self._velocity()
        if self._velocity_after_last_step is not None and np.abs(self._velocity_after_last_step).max() > 0:
            self.velocity_ratios.append(float(np.median(now / self._velocity_after_last_step)))
            self.ratio_steps.append(len(self.rates) - 1)

    def on_train_batch_end(self, batch, logs=None):
        self._velocity_after_last_step = self._velocity()


def warmup_rates(base_lr, scale, steps, warmup_epochs, epochs):
    """The README's formula, per step (micro-batch) of each epoch."""
    return [
        base_lr * (1 + (scale - 1) * min(1.0, (e * steps + b) / (warmup_epochs * steps)))
        for e in range(epochs)
        for b in range(steps)
    ]


@pytest.mark.parametrize("scaling", ["linear", "sqrt"])
def test_warmup_rates_follow_the_formula_with_momentum_correction(scaling):
    base_lr, steps, warmup_epochs, epochs = 0.01, 4, 2, 3
    model = classifier()
    model.compile(
        kd.DistributedOptimizer(keras.optimizers.SGD(base_lr, momentum=0.9)), loss="sparse_categorical_crossentropy"
    )
    x, y = shard_of_unequal_size(RANK, seed=12)
    x, y = np.resize(x, (steps * 2, 4)), np.resize(y, steps * 2)
    probe = LearningRateProbe()
    history = model.fit(
        x,
        y,
        batch_size=2,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[BroadcastGlobalState(), LearningRateWarmup(warmup_epochs, scaling=scaling), probe],
    )
    scale = SIZE if scaling == "linear" else math.sqrt(SIZE)
    expected = warmup_rates(base_lr, scale, steps, warmup_epochs, epochs)
    np.testing.assert_allclose(probe.rates, expected, rtol=1e-6)
    assert history.history["learning_rate"][-1] == pytest.approx(base_lr * scale, rel=1e-6)
    # the velocity was multiplied by new/old rate at each change (in float32)
    expected_ratios = [new / old for old, new in zip(expected, expected[1:])]
    np.testing.assert_allclose(probe.velocity_ratios, expected_ratios, rtol=1e-5)


@pytest.mark.parametrize("warmup_epochs", [0.3, 0.001, 1.5])
def test_warmup_reaches_the_scaled_rate_when_its_steps_are_not_a_whole_number(warmup_epochs):
    base_lr, steps, epochs = 0.01, 16, 2
    model = classifier()
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(base_lr)), loss="sparse_categorical_crossentropy")
    x, y = shard_of_unequal_size(RANK, seed=18)
    x, y = np.resize(x, (steps * 2, 4)), np.resize(y, steps * 2)
    probe = LearningRateProbe()
    model.fit(
        x,
        y,
        batch_size=2,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[BroadcastGlobalState(), LearningRateWarmup(warmup_epochs), probe],
    )
    warmup_steps = warmup_epochs * steps
    expected = [base_lr * (1 + (SIZE - 1) * min(1.0, step / warmup_steps)) for step in range(epochs * steps)]
    np.testing.assert_allclose(probe.rates, expected, rtol=1e-6)
    assert probe.rates[-1] == pytest.approx(base_lr * SIZE, rel=1e-6)


@pytest.mark.parametrize("momentum_correction", [True, False], ids=["corrected", "uncorrected"])
@pytest.mark.parametrize("inner", ["sgd", "lars"])
def test_warmup_with_accumulated_micro_batches_scales_by_them_and_corrects_velocities_if_asked(
    inner, momentum_correction
):
    # k = 2 micro-batches per update: the batch scale is ranks × 2, the ramp advances per
    # micro-batch (fit's steps), and the velocity (SGD's or LARS's) is rescaled by new/old rate
    # at every change, or left alone without momentum correction.
    base_lr, steps, warmup_epochs, epochs, passes = 0.01, 4, 2, 3, 2
    optimizer = keras.optimizers.SGD(base_lr, momentum=0.9) if inner == "sgd" else LARS(base_lr, momentum=0.9)
    model = classifier()
    model.compile(
        kd.DistributedOptimizer(optimizer, backward_passes_per_step=passes), loss="sparse_categorical_crossentropy"
    )
    x, y = shard_of_unequal_size(RANK, seed=19)
    x, y = np.resize(x, (steps * 2, 4)), np.resize(y, steps * 2)
    probe = LearningRateProbe()
    model.fit(
        x,
        y,
        batch_size=2,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[
            BroadcastGlobalState(),
            LearningRateWarmup(warmup_epochs, momentum_correction=momentum_correction),
            probe,
        ],
    )
    expected = warmup_rates(base_lr, SIZE * passes, steps, warmup_epochs, epochs)
    np.testing.assert_allclose(probe.rates, expected, rtol=1e-6)
    assert probe.ratio_steps[0] == passes  # the first update is at the end of micro-batch k
    expected_ratios = [
        expected[step] / expected[step - 1] if momentum_correction else 1.0 for step in probe.ratio_steps
    ]
    np.testing.assert_allclose(probe.velocity_ratios, expected_ratios, rtol=1e-5)


@pytest.mark.parametrize("passes", [1, 2])
def test_schedule_without_staircase_follows_the_fractional_epoch_every_batch(passes):
    # With k = 2 accumulated micro-batches the batch scale is ranks × 2.
    base_lr, steps, epochs = 0.02, 4, 3
    model = classifier()
    model.compile(
        kd.DistributedOptimizer(keras.optimizers.SGD(base_lr), backward_passes_per_step=passes),
        loss="sparse_categorical_crossentropy",
    )
    x, y = shard_of_unequal_size(RANK, seed=20)
    x, y = np.resize(x, (steps * 2, 4)), np.resize(y, steps * 2)
    probe = LearningRateProbe()
    model.fit(
        x,
        y,
        batch_size=2,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[LearningRateMultiplier(lambda epoch: 1.0 / (1.0 + epoch), staircase=False), probe],
    )
    expected = [base_lr * SIZE * passes / (1.0 + e + b / steps) for e in range(epochs) for b in range(steps)]
    np.testing.assert_allclose(probe.rates, expected, rtol=1e-6)


def test_schedule_multiplies_the_scaled_rate_within_its_epochs():
    base_lr = 0.02
    model = classifier()
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(base_lr)), loss="sparse_categorical_crossentropy")
    x, y = shard_of_unequal_size(RANK, seed=13)
    probe = LearningRateProbe()
    callbacks = [
        LearningRateMultiplier(0.5, start_epoch=1, end_epoch=3),
        LearningRateMultiplier(lambda epoch: 0.1 * epoch, start_epoch=3),
        probe,
    ]
    model.fit(x[:4], y[:4], batch_size=2, epochs=5, shuffle=False, verbose=0, callbacks=callbacks)
    per_epoch = probe.rates[::2]
    expected = [base_lr, base_lr * SIZE * 0.5, base_lr * SIZE * 0.5, base_lr * SIZE * 0.3, base_lr * SIZE * 0.4]
    np.testing.assert_allclose(per_epoch, expected, rtol=1e-6)


def test_a_rate_schedule_object_cannot_be_warmed_up():
    model = classifier()
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.9)
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(schedule)), loss="sparse_categorical_crossentropy")
    x, y = shard_of_unequal_size(RANK, seed=14)
    with pytest.raises(ValueError, match="LearningRateSchedule object"):
        model.fit(x[:4], y[:4], batch_size=2, verbose=0, callbacks=[LearningRateWarmup(1)])


def test_bad_callback_arguments_are_named():
    with pytest.raises(ValueError, match="scaling="):
        LearningRateWarmup(scaling="cubic")
    with pytest.raises(ValueError, match="warmup_epochs=0"):
        LearningRateWarmup(warmup_epochs=0)
    for not_finite in (math.nan, math.inf):
        with pytest.raises(ValueError, match=f"warmup_epochs={not_finite} must be a finite number"):
            LearningRateWarmup(warmup_epochs=not_finite)
        with pytest.raises(ValueError, match="warmup_epochs="):
            kd.callbacks(warmup_epochs=not_finite)
    for not_a_number in ("3", None, True):
        with pytest.raises(TypeError, match=f"warmup_epochs={not_a_number!r} must be a number of epochs"):
            LearningRateWarmup(warmup_epochs=not_a_number)


@pytest.mark.skipif(SIZE == 1, reason="needs ranks that disagree")
def test_unequal_steps_per_epoch_fail_on_every_rank_before_training():
    model = compiled(classifier())
    x, y = shard_of_unequal_size(RANK, seed=16)  # 5 + 3r rows: 3, 4, 6 batches of 2
    with pytest.raises(ValueError, match="different numbers of steps per epoch in fit"):
        model.fit(x, y, batch_size=2, verbose=0, callbacks=kd.callbacks())
    assert kd.allgather_object("after") == ["after"] * SIZE  # every rank got here: no hang


class _WeightsAtTrainBegin(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.weights = self.model.get_weights()


def test_a_root_rank_other_than_0_is_broadcast_from_and_alone_prints_and_writes(tmp_path, capsys):
    root = SIZE - 1
    per_rank = tmp_path / f"rank{RANK}"  # each rank's own directory: only the root's may fill
    per_rank.mkdir()
    model = compiled(classifier(seed=100 + RANK))  # every rank starts from its own weights
    initial = kd.allgather_object(model.get_weights())
    x, y = shard_of_unequal_size(RANK, seed=21)
    at_begin = _WeightsAtTrainBegin()
    model.fit(
        x[:4],
        y[:4],
        batch_size=2,
        epochs=2,
        verbose=1,
        callbacks=kd.callbacks(root_rank=root, csv_path=per_rank / "log.csv", extra=[at_begin]),
    )
    for got, expected in zip(at_begin.weights, initial[root], strict=True):
        np.testing.assert_array_equal(got, expected)
    printed = capsys.readouterr().out
    if RANK == root:
        assert "Epoch 2/2" in printed
        assert (per_rank / "log.csv").read_text().count("\n") == 3  # header + 2 epochs
    else:
        assert printed == "" and list(per_rank.iterdir()) == []


def test_without_metric_averaging_each_rank_reports_its_own_shard():
    callbacks = kd.callbacks(average_metrics=False)
    assert MetricAverage not in [type(c) for c in callbacks]
    model = compiled(classifier())
    x, y = shard_of_unequal_size(RANK, seed=22)
    model.fit(x[:4], y[:4], batch_size=2, verbose=0, callbacks=callbacks)
    got = model.evaluate(x, y, batch_size=3, verbose=0, return_dict=True)

    reference = classifier()
    reference.set_weights(model.get_weights())
    reference.compile(loss="sparse_categorical_crossentropy", metrics=metrics())
    expected = reference.evaluate(x, y, batch_size=3, verbose=0, return_dict=True)  # this rank's rows only
    for name in expected:
        assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-6), name


@pytest.mark.skipif(SIZE < 2, reason="needs 2 ranks to compare their dropout masks")
def test_dropout_seed_states_stay_per_rank_while_the_weights_are_shared():
    keras.utils.set_random_seed(300 + RANK)  # own weights and own dropout seed on every rank
    model = compiled(
        keras.Sequential([keras.Input((4,)), keras.layers.Dropout(0.5), keras.layers.Dense(3, activation="softmax")])
    )
    x, y = shard_of_unequal_size(RANK, seed=23)
    model.fit(x[:4], y[:4], batch_size=2, verbose=0, callbacks=kd.callbacks())
    weights = kd.allgather_object(model.get_weights())
    for other in weights[1:]:
        for a, b in zip(other, weights[0], strict=True):
            np.testing.assert_array_equal(a, b)
    seed_states = kd.allgather_object(
        [v.numpy().tolist() for v in model.variables if v.path.endswith("seed_generator_state")]
    )
    assert seed_states[0] and len({repr(state) for state in seed_states}) == SIZE
    masks = kd.allgather_object((model.layers[0](np.ones((16, 4), "float32"), training=True).numpy() != 0).tolist())
    assert len({repr(mask) for mask in masks}) == SIZE  # every rank draws its own mask


def test_tensorboard_and_csv_logs_are_written_by_the_root_rank_only(tmp_path):
    per_rank = tmp_path / f"rank{RANK}"  # each rank's own directory: only rank 0's may fill
    model = compiled(classifier())
    x, y = shard_of_unequal_size(RANK, seed=17)
    model.fit(
        x[:4],
        y[:4],
        batch_size=2,
        epochs=2,
        verbose=0,
        callbacks=kd.callbacks(tensorboard_dir=per_rank / "tb", csv_path=per_rank / "log.csv"),
    )
    if RANK == 0:
        assert list((per_rank / "tb" / "train").glob("events.out.tfevents.*"))
        assert (per_rank / "log.csv").read_text().count("\n") == 3  # header + 2 epochs
    else:
        assert not per_rank.exists()


def test_the_multiplier_callback_keeps_its_earlier_name():
    assert kd.callbacks.LearningRateSchedule is kd.callbacks.LearningRateMultiplier
