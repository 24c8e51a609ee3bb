"""An epoch that a callback stops in the middle (`stop_training` at a batch: a time budget
before a requeue, `TerminateOnNaN`) is saved by `Rank0Checkpoint` as the part of an epoch it is,
so a resumed fit trains the rest of that epoch and ends on the weights of a fit never stopped.
Saved as a whole epoch, the resume skipped the rest of it."""

import os

import keras
import numpy as np
import pytest

import kerasdist as kd

kd.init()
RANK, SIZE = kd.rank(), kd.size()
BATCH, STEPS, EPOCHS = 2, 6, 3


class StopAt(keras.callbacks.Callback):
    """Stops fit at the end of one batch on the last rank only (StopAgreement stops the others)."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if RANK == SIZE - 1 and (self.epoch, batch) == self.at:
            self.model.stop_training = True


def _data():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(STEPS * BATCH * SIZE, 3)).astype("float32")
    return kd.data.shard((x, np.tanh(x).sum(axis=1, keepdims=True)), batch_size=BATCH)


def _model():
    keras.utils.set_random_seed(6)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), "mse")
    return model


def _fit(model, callbacks):
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)


@pytest.mark.skipif(SIZE > 1 and kd.local_size() != SIZE, reason="the checkpoint directory must be one for all ranks")
def test_an_epoch_stopped_at_a_batch_is_resumed_where_it_stopped(tmp_path_factory):
    directory = kd.broadcast_object(str(tmp_path_factory.mktemp("cut")) if RANK == 0 else None)
    uninterrupted = _model()
    _fit(uninterrupted, kd.callbacks())

    stopped = _model()
    _fit(stopped, [StopAt(epoch=1, batch=2), kd.callbacks.Rank0Checkpoint(directory, resume=True), *kd.callbacks()])
    latest = kd.callbacks.Rank0Checkpoint.latest(directory)
    assert (latest.epoch, latest.batches_of_all_ranks) == (1, 3 * SIZE)
    assert os.path.basename(latest.path) == "epoch0002-batch3.keras"

    resumed = _model()
    _fit(resumed, [kd.callbacks.Rank0Checkpoint(directory, resume=True), *kd.callbacks()])
    assert int(resumed.optimizer.iterations.numpy()) == EPOCHS * STEPS
    for got, expected in zip(resumed.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


@pytest.mark.skipif(SIZE > 1 and kd.local_size() != SIZE, reason="the checkpoint directory must be one for all ranks")
def test_a_stop_while_a_resume_passes_over_trained_batches_keeps_the_position_reached(tmp_path_factory):
    """A resumed epoch first passes over the batches trained before (drawn, not trained). A stop
    there (a notice, or a launcher growing the job, that comes as it starts) saves the state it
    resumed, at the position it resumed from; it had saved the batches passed over so far (1
    here), so the next resume trained 2 batches twice."""
    directory = kd.broadcast_object(str(tmp_path_factory.mktemp("cut-twice")) if RANK == 0 else None)
    uninterrupted = _model()
    _fit(uninterrupted, kd.callbacks())

    _fit(_model(), [StopAt(epoch=1, batch=2), kd.callbacks.Rank0Checkpoint(directory, resume=True), *kd.callbacks()])
    _fit(_model(), [StopAt(epoch=1, batch=0), kd.callbacks.Rank0Checkpoint(directory, resume=True), *kd.callbacks()])
    latest = kd.callbacks.Rank0Checkpoint.latest(directory)
    assert (latest.epoch, latest.batches_of_all_ranks) == (1, 3 * SIZE)

    resumed = _model()
    _fit(resumed, [kd.callbacks.Rank0Checkpoint(directory, resume=True), *kd.callbacks()])
    assert int(resumed.optimizer.iterations.numpy()) == EPOCHS * STEPS
    for got, expected in zip(resumed.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


@pytest.mark.skipif(SIZE > 1 and kd.local_size() != SIZE, reason="the checkpoint directory must be one for all ranks")
def test_a_model_with_metrics_resumes_inside_an_epoch(tmp_path_factory):
    """Passing over the batches trained before, no step has built the compiled metrics yet; asking
    them for their result there raised 'Cannot get result() since the metric has not yet been
    built' on every rank (the digits example resumed after a notice so)."""
    directory = kd.broadcast_object(str(tmp_path_factory.mktemp("cut-metrics")) if RANK == 0 else None)

    def model_with_metrics():
        model = _model()
        model.compile(model.optimizer, "mse", metrics=["mae"])
        return model

    uninterrupted = model_with_metrics()
    _fit(uninterrupted, kd.callbacks())
    _fit(
        model_with_metrics(),
        [StopAt(epoch=1, batch=2), kd.callbacks.Rank0Checkpoint(directory, resume=True)] + [*kd.callbacks()],
    )
    resumed = model_with_metrics()
    x, y = _data()
    history = resumed.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[kd.callbacks.Rank0Checkpoint(directory, resume=True), *kd.callbacks()],
    )
    assert int(resumed.optimizer.iterations.numpy()) == EPOCHS * STEPS
    assert sorted(history.history) == ["loss", "mae"] and len(history.history["mae"]) == EPOCHS - 1
    for got, expected in zip(resumed.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
