"""When any rank stops `fit`, every rank stops at the same batch of the same epoch.

A rank that stopped alone would leave the others waiting in their next step's gradient
allreduce (the stall timeout of tests/keras/conftest.py ends such a test within a minute).
The expected stopping points come from where the test puts the NaN or the stop, not from the
code under test.
"""

import keras
import numpy as np
import pytest

import kerasdist as kd

kd.init()
RANK, SIZE = kd.rank(), kd.size()
FEATURES, ROWS, BATCH, EPOCHS = 3, 8, 2, 4
STEPS = ROWS // BATCH
LAST_RANK = SIZE - 1  # the rank that stops alone (rank 0 in one process)


class BatchesRun(keras.callbacks.Callback):
    """Records (epoch, batch) of every training batch this rank ran."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append((self.epoch, batch))

    def on_train_begin(self, logs=None):
        self.seen = []


class StopOnOneRank(keras.callbacks.Callback):
    """Sets `stop_training` on `rank` alone, at the end of `batch` of `epoch` (or of the epoch)."""

    def __init__(self, rank, epoch, batch=None):
        super().__init__()
        self.rank, self.epoch, self.batch = rank, epoch, batch

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if RANK == self.rank and self.batch == batch and self.current_epoch == self.epoch:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if RANK == self.rank and self.batch is None and epoch == self.epoch:
            self.model.stop_training = True


class StopBeforeABatch(keras.callbacks.Callback):
    """Sets `stop_training` on `rank` alone in `on_train_begin` (epoch None) or in `epoch`'s
    `on_epoch_begin`; it overrides no batch hook, as a timer or a logger would not."""

    def __init__(self, rank, epoch=None):
        super().__init__()
        self.rank, self.epoch = rank, epoch

    def on_train_begin(self, logs=None):
        if RANK == self.rank and self.epoch is None:
            self.model.stop_training = True

    def on_epoch_begin(self, epoch, logs=None):
        if RANK == self.rank and epoch == self.epoch:
            self.model.stop_training = True


def shard(rank):
    rng = np.random.default_rng([rank, 41])
    x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5]])).astype("float32")


def compiled_model(learning_rate=0.05):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1, use_bias=False)])
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(learning_rate)), loss="mse")
    return model


def fit(model, x, y, callbacks):
    return model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)


def batches_on_every_rank(counter):
    return kd.allgather_object(counter.seen)


def expected_batches(last_epoch, last_batch):
    return [(epoch, batch) for epoch in range(last_epoch + 1) for batch in range(STEPS)][
        : last_epoch * STEPS + last_batch + 1
    ]


def test_terminate_on_nan_in_one_rank_data_stops_every_rank_at_that_batch():
    nan_batch = 2
    x, y = shard(RANK)
    if RANK == LAST_RANK:
        x[nan_batch * BATCH, 0] = np.nan  # only this rank's loss is NaN at nan_batch; the others' a step later
    counter = BatchesRun()
    fit(compiled_model(), x, y, [counter] + kd.callbacks(extra=[keras.callbacks.TerminateOnNaN()]))
    assert batches_on_every_rank(counter) == [expected_batches(0, nan_batch)] * SIZE


@pytest.mark.parametrize("before_the_list", [False, True], ids=["in_extra", "before_the_list"])
def test_stop_training_set_on_one_rank_at_a_batch_stops_every_rank_there(before_the_list):
    stop = StopOnOneRank(LAST_RANK, epoch=1, batch=1)
    counter = BatchesRun()
    callbacks = [counter, stop] + kd.callbacks() if before_the_list else [counter] + kd.callbacks(extra=[stop])
    history = fit(compiled_model(), *shard(RANK), callbacks)
    assert batches_on_every_rank(counter) == [expected_batches(1, 1)] * SIZE
    assert len(history.history["loss"]) == 2


def test_a_stop_from_a_callback_only_one_rank_holds_stops_every_rank_at_that_batch():
    # Only the last rank has a callback that may stop at a batch: every rank must still agree per batch.
    counter = BatchesRun()
    extra = [StopOnOneRank(LAST_RANK, epoch=0, batch=2)] if RANK == LAST_RANK else []
    fit(compiled_model(), *shard(RANK), [counter] + kd.callbacks(extra=extra))
    assert batches_on_every_rank(counter) == [expected_batches(0, 2)] * SIZE


def test_stop_training_set_on_one_rank_at_an_epoch_end_stops_every_rank_after_that_epoch():
    counter = BatchesRun()
    history = fit(compiled_model(), *shard(RANK), [counter] + kd.callbacks(extra=[StopOnOneRank(LAST_RANK, 1)]))
    assert batches_on_every_rank(counter) == [expected_batches(1, STEPS - 1)] * SIZE
    assert len(history.history["loss"]) == 2


def test_early_stopping_on_per_rank_logs_stops_every_rank_at_the_same_epoch():
    # The last rank's rows are zero, so its own loss is 0 in every epoch: with patience 1 its
    # EarlyStopping stops after epoch 1, while every other rank's own loss keeps falling.
    x, y = shard(RANK)
    if RANK == LAST_RANK:
        x, y = np.zeros_like(x), np.zeros_like(y)
    patience = 1
    counter = BatchesRun()
    stopping = keras.callbacks.EarlyStopping(monitor="loss", patience=patience, min_delta=1e-9)
    history = fit(compiled_model(), x, y, [counter] + kd.callbacks(average_metrics=False, extra=[stopping]))
    assert batches_on_every_rank(counter) == [expected_batches(patience, STEPS - 1)] * SIZE
    assert len(history.history["loss"]) == patience + 1


def test_early_stopping_decides_on_the_global_loss_on_every_rank_wherever_it_is_listed():
    # Learning rate 0: the loss is the same in every epoch, NumPy's mean squared error over the
    # union of the shards. Rank r's rows miss their targets by r + 1, so rank 0's own loss is the
    # smallest; the baseline lies between it and the global loss, so every rank's EarlyStopping
    # stops after epoch 1 only if it reads the global value.
    shards = [shard(rank) for rank in range(SIZE)]
    shards = [(x, y + rank + 1) for rank, (x, y) in enumerate(shards)]
    model = compiled_model(learning_rate=0.0)
    kernel = model.get_weights()[0]  # every rank's initial kernel is equal (one seed)
    global_loss = np.mean(np.concatenate([(x @ kernel - y) ** 2 for x, y in shards]))
    rank0_loss = np.mean((shards[0][0] @ kernel - shards[0][1]) ** 2)
    baseline = (global_loss + rank0_loss) / 2 if SIZE > 1 else global_loss / 2
    stopping = keras.callbacks.EarlyStopping(monitor="loss", baseline=baseline, patience=0)
    history = fit(model, *shards[RANK], [stopping] + kd.callbacks())
    np.testing.assert_allclose(history.history["loss"], [global_loss] * 2, rtol=1e-5)
    assert kd.allgather_object(stopping.stopped_epoch) == [1] * SIZE


@pytest.mark.parametrize("epoch", [None, 0, 2], ids=["train_begin", "first_epoch_begin", "third_epoch_begin"])
def test_a_stop_set_before_a_batch_on_one_rank_stops_every_rank_after_the_next_batch_without_per_batch_sums(
    per_batch_agreements, epoch
):
    # Keras reads the flag first after the next batch: every rank runs that batch, then ends fit.
    model = compiled_model()
    history = fit(model, *shard(RANK), kd.callbacks(extra=[StopBeforeABatch(LAST_RANK, epoch)]))
    last_epoch = 0 if epoch is None else epoch
    assert kd.allgather_object(int(model.optimizer.iterations.numpy())) == [last_epoch * STEPS + 1] * SIZE
    assert len(history.history["loss"]) == last_epoch + 1
    assert per_batch_agreements == []


def test_a_callback_that_may_stop_at_a_batch_is_agreed_on_at_every_batch(per_batch_agreements):
    fit(compiled_model(), *shard(RANK), kd.callbacks(extra=[StopOnOneRank(LAST_RANK, epoch=EPOCHS)]))
    assert len(per_batch_agreements) == (EPOCHS * STEPS if SIZE > 1 else 0)


def test_a_lambda_callback_that_stops_one_rank_at_a_batch_stops_every_rank_there():
    # LambdaCallback sets the functions it is given on the instance, not on its class; no other
    # callback here has a batch hook, so only this one can ask for the per-batch agreement.
    epoch = []

    def stop_at_epoch_1_batch_1(batch, logs):
        if RANK == LAST_RANK and epoch[-1] == 1 and batch == 1:
            model.stop_training = True

    model = compiled_model()
    stopping = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda e, logs: epoch.append(e), on_train_batch_end=stop_at_epoch_1_batch_1
    )
    history = fit(model, *shard(RANK), kd.callbacks(extra=[stopping]))
    assert kd.allgather_object(int(model.optimizer.iterations.numpy())) == [STEPS + 2] * SIZE
    assert len(history.history["loss"]) == 2
