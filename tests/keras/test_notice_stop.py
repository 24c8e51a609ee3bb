"""A notice to leave (SIGUSR1) on the last rank stops every rank at the end of the update it
falls in, Rank0Checkpoint saves that step, `fit` ends with SystemExit(75), and a fit resumed from
that checkpoint ends on the weights of a fit never interrupted.

The stopping point comes from where the test sends the signal and the accumulation window
(3 micro-batches an update), not from the code under test.
"""

import json
import os
import signal
import threading
import time
import zipfile

import keras
import numpy as np
import pytest

import kerasdist as kd
from kerasdist.callbacks.checkpoint import METADATA_ENTRY

kd.init()
RANK, SIZE = kd.rank(), kd.size()
LAST_RANK = SIZE - 1
MICRO_BATCHES, BATCH, STEPS, EPOCHS = 3, 2, 12, 3  # 4 updates an epoch


class NoticeAt(keras.callbacks.Callback):
    """Sends this process the notice signal at the end of one batch on the last rank; records the
    (epoch, batch) of every batch this rank ran."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.seen = (epoch, batch), []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append((self.epoch, batch))
        if RANK == LAST_RANK and (self.epoch, batch) == self.at:
            os.kill(os.getpid(), signal.SIGUSR1)


def _data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(STEPS * BATCH * SIZE, 4)).astype("float32")
    return kd.data.shard((x, x.sum(axis=1, keepdims=True) ** 2), batch_size=BATCH)


def _model():
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(kd.DistributedOptimizer(keras.optimizers.Adam(0.01), backward_passes_per_step=MICRO_BATCHES), "mse")
    return model


def _fit(model, callbacks):
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)


@pytest.mark.skipif(SIZE > 1 and kd.local_size() != SIZE, reason="the checkpoint directory must be one for all ranks")
def test_a_notice_inside_a_window_stops_every_rank_at_its_end_and_the_resume_is_exact(tmp_path_factory):
    directory = kd.broadcast_object(str(tmp_path_factory.mktemp("notice")) if RANK == 0 else None)
    uninterrupted = _model()
    _fit(uninterrupted, kd.callbacks())

    noticed = _model()
    notice = NoticeAt(epoch=1, batch=3)  # the 4th micro-batch: the second window's first
    with pytest.raises(SystemExit) as stopped:
        _fit(noticed, [notice, kd.callbacks.Rank0Checkpoint(directory, resume=True), *kd.callbacks()])
    assert stopped.value.code == 75
    assert notice.seen[-1] == (1, 5)  # that window's last micro-batch, on every rank
    if RANK == 0:
        with zipfile.ZipFile(os.path.join(directory, "epoch0002-batch6.keras")) as archive:
            metadata = json.loads(archive.read(METADATA_ENTRY))
        assert (metadata["epoch"], metadata["batches_of_all_ranks"]) == (1, 6 * SIZE)

    resumed = _model()
    checkpoint = kd.callbacks.Rank0Checkpoint(directory, resume=True)
    assert (checkpoint.initial_epoch, checkpoint.resumed_from.batches_of_all_ranks) == (1, 6 * SIZE)
    _fit(resumed, [checkpoint, *kd.callbacks()])
    assert int(resumed.optimizer.iterations.numpy()) == int(uninterrupted.optimizer.iterations.numpy())
    for got, expected in zip(resumed.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


def test_a_notice_before_fit_stops_every_rank_after_the_first_update_with_no_collective_of_its_own(
    per_batch_agreements,
):
    model = _model()
    if RANK == LAST_RANK:
        os.kill(os.getpid(), signal.SIGUSR1)  # outside fit: taken at the next fit's first update
    with pytest.raises(SystemExit) as stopped:
        _fit(model, kd.callbacks())
    assert stopped.value.code == 75
    assert kd.allgather_object(int(model.optimizer.iterations.numpy())) == [1] * SIZE
    assert per_batch_agreements == []  # the gradients' allreduce carried the notice


def test_a_notice_at_any_moment_stops_every_rank_at_the_same_update(per_batch_agreements):
    model = _model()

    def notice_once_two_updates_are_done():
        while int(model.optimizer.iterations.numpy()) < 2:
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGUSR1)

    if RANK == LAST_RANK:  # a thread: no callback of the test's own, which would ask every batch
        threading.Thread(target=notice_once_two_updates_are_done, daemon=True).start()
    with pytest.raises(SystemExit) as stopped:
        _fit(model, kd.callbacks())
    assert stopped.value.code == 75
    updates = kd.allgather_object(int(model.optimizer.iterations.numpy()))
    assert updates == [updates[0]] * SIZE and 2 <= updates[0] < EPOCHS * STEPS // MICRO_BATCHES, updates
    assert per_batch_agreements == []


def test_notice_received_is_false_everywhere_until_one_rank_is_signalled_then_true_everywhere(monkeypatch):
    """The check a loop of one's own makes: every rank answers alike, whichever rank got it."""
    from kerasdist.notice import notice_state

    monkeypatch.setattr(notice_state, "received", False)
    monkeypatch.setattr(notice_state, "announced", False)
    assert kd.notice_received() is False
    if RANK == LAST_RANK:
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 30  # Python runs the handler between bytecodes, soon
        while not notice_state.received and time.monotonic() < deadline:
            time.sleep(0.01)
    assert kd.notice_received() is True
    assert kd.notice_received() is True  # until the process ends: it is to save and leave
    assert notice_state.announced is (RANK == LAST_RANK)


class _CountingReads:
    """Stands in for the optimizer's `agreed` variable: counts the reads from Python, hands every
    other use (the traced train step's assign) to the variable."""

    def __init__(self, variable):
        self.variable, self.reads = variable, 0

    def numpy(self):
        self.reads += 1
        return self.variable.numpy()

    def __getattr__(self, name):
        return getattr(self.variable, name)


def test_between_batches_a_single_process_asks_no_tensor_whether_a_notice_came_and_more_ranks_read_one():
    # One process has no rank to agree with: an eager read per batch was its per-step cost.
    model = _model()
    flags = model.optimizer._notice_flags
    flags.agreed = _CountingReads(flags.agreed)
    _fit(model, kd.callbacks())
    assert flags.agreed.reads == (0 if SIZE == 1 else EPOCHS * STEPS)
