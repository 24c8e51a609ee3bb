"""A job that runs on fewer ranks than planned (`kerasdist.planned_size()`, set by
`kerasdist-run --min-np` after hosts were lost) keeps the planned global batch and learning rate.

Each test plans twice the ranks it runs on, as a restart on half the hosts would, by setting the
planned size in the runtime's state (what `KERASDIST_PLANNED_SIZE` sets at `init()`, tested in
tests/launch/test_min_np.py). References are plain Keras in one process on the planned global
batch, or sums written out by hand.
"""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist as kd
from kerasdist import runtime
from kerasdist.learning_rate import batch_scale

kd.init()
RANK, SIZE = kd.rank(), kd.size()
STAND_INS = 2  # planned ranks per running rank
PLANNED = STAND_INS * SIZE
PER_RANK_BATCH = 4
FEATURES = 3


@pytest.fixture(autouse=True)
def planned_twice_the_ranks(monkeypatch):
    monkeypatch.setattr(runtime, "_state", dataclasses.replace(runtime.state(), planned_size=PLANNED))


def global_data(rows, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1 * rng.normal(size=(rows, 1))).astype("float32")
    return x, y


def make_model():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])


def test_planned_size_is_what_the_runtime_was_given():
    assert kd.planned_size() == PLANNED


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize(
    "make_optimizer",
    [lambda: keras.optimizers.SGD(0.05, momentum=0.9), lambda: keras.optimizers.Adam(0.01)],
    ids=["sgd_momentum", "adam"],
)
def test_fit_equals_one_process_on_the_planned_global_batch(make_optimizer, passes):
    global_batch = PLANNED * passes * PER_RANK_BATCH
    x, y = global_data(3 * global_batch)
    reference = make_model()
    reference.compile(make_optimizer(), loss="mse")
    reference.fit(x, y, batch_size=global_batch, epochs=2, shuffle=False, verbose=0)

    # Update t uses rows [t·G, (t+1)·G); this rank's micro-batch j of it is the slot j·SIZE + RANK.
    micro_batches = STAND_INS * passes
    rows = np.concatenate(
        [
            np.arange(start + slot * PER_RANK_BATCH, start + (slot + 1) * PER_RANK_BATCH)
            for start in range(0, len(x), global_batch)
            for slot in (j * SIZE + RANK for j in range(micro_batches))
        ]
    )
    model = make_model()
    optimizer = kd.DistributedOptimizer(make_optimizer(), backward_passes_per_step=passes)
    model.compile(optimizer, loss="mse")
    model.fit(x[rows], y[rows], batch_size=PER_RANK_BATCH, epochs=2, shuffle=False, verbose=0, callbacks=kd.callbacks())

    difference = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), reference.get_weights()))
    assert difference < 1e-5
    assert int(optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) == 6
    # What the user set, and what a checkpoint saves, stays k.
    assert optimizer.backward_passes_per_step == passes
    assert optimizer.get_config()["backward_passes_per_step"] == passes


@pytest.mark.parametrize("op", [kd.Average, kd.Sum], ids=["average", "sum"])
@pytest.mark.parametrize("average", [True, False], ids=["mean_of_micro_batches", "sum_of_micro_batches"])
def test_accumulated_micro_batches_combine_as_the_planned_ranks_would(op, average):
    # Running rank r stands in for planned ranks r·STAND_INS + i; planned rank p's micro-batch m
    # has gradient (p + 1)·(m + 1)·[1, 2]. The planned job gives each planned rank's mean (or
    # sum) of its k micro-batches, averaged (or summed) over the planned ranks.
    lr, k = 0.5, 3
    variable = tf.Variable([1.0, -2.0])
    optimizer = kd.DistributedOptimizer(
        keras.optimizers.SGD(lr), op=op, backward_passes_per_step=k, average_aggregated_gradients=average
    )
    for stand_in in range(STAND_INS):
        planned_rank = RANK * STAND_INS + stand_in
        for micro_batch in range(k):
            optimizer.apply([tf.constant([1.0, 2.0]) * (planned_rank + 1) * (micro_batch + 1)], [variable])
    per_planned_rank = [sum((p + 1) * (m + 1) for m in range(k)) / (k if average else 1) for p in range(PLANNED)]
    update = np.mean(per_planned_rank) if op == kd.Average else np.sum(per_planned_rank)
    np.testing.assert_allclose(variable.numpy(), np.array([1.0, -2.0]) - lr * update * np.array([1.0, 2.0]), rtol=1e-6)
    assert int(optimizer.iterations.numpy()) == 1


def test_one_update_waits_for_the_micro_batches_of_every_planned_rank_even_with_k_1():
    variable = tf.Variable([0.0])
    optimizer = kd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    optimizer.apply([tf.constant([1.0])], [variable])
    assert int(optimizer.iterations.numpy()) == 0 and variable.numpy()[0] == 0.0
    optimizer.apply([tf.constant([3.0])], [variable])
    assert int(optimizer.iterations.numpy()) == 1 and variable.numpy()[0] == pytest.approx(-2.0)
    assert optimizer.backward_passes_per_step == 1


def test_learning_rate_scaling_counts_the_planned_ranks():
    optimizer = kd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    assert batch_scale(optimizer, "linear") == 2 * PLANNED
    assert batch_scale(optimizer, "sqrt") == pytest.approx(np.sqrt(2 * PLANNED))


def test_warmup_ends_at_the_rate_scaled_by_the_planned_ranks():
    x, y = global_data(8 * SIZE * STAND_INS)
    model = make_model()
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    warmup = kd.callbacks.LearningRateWarmup(warmup_epochs=1)
    history = model.fit(x, y, batch_size=2, epochs=2, callbacks=[*kd.callbacks(), warmup], verbose=0)
    assert history.history["learning_rate"][-1] == pytest.approx(0.01 * PLANNED)


def test_sharding_by_running_ranks_keeps_the_planned_updates_per_epoch():
    # The planned job: PLANNED ranks, 5 batches each per epoch. Running on SIZE ranks, each rank's
    # shard is STAND_INS times larger and STAND_INS micro-batches make one update.
    updates_per_epoch = 5
    x, y = global_data(PLANNED * PER_RANK_BATCH * updates_per_epoch)
    x_shard, y_shard = kd.data.shard((x, y), batch_size=PER_RANK_BATCH)
    assert len(x_shard) == STAND_INS * PER_RANK_BATCH * updates_per_epoch
    model = make_model()
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    model.fit(x_shard, y_shard, batch_size=PER_RANK_BATCH, epochs=2, callbacks=kd.callbacks(), verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2 * updates_per_epoch


def test_raising_k_while_standing_in_needs_no_new_trace_and_multiplies_the_wait():
    # Standing in already accumulates, so the accumulators exist even at k = 1 (batch growth
    # raises k this way while training runs).
    variable = tf.Variable([0.0])
    optimizer = kd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    step = tf.function(lambda: optimizer.apply([tf.constant([1.0])], [variable]))
    step()
    step()
    assert int(optimizer.iterations.numpy()) == 1
    assert optimizer.set_backward_passes_per_step(2) is False  # no new trace needed
    for _ in range(2 * STAND_INS - 1):
        step()
    assert int(optimizer.iterations.numpy()) == 1
    step()
    assert int(optimizer.iterations.numpy()) == 2
    assert optimizer.backward_passes_per_step == 2
