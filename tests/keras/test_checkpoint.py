"""Rank0Checkpoint: one writer, no collective while saving, Keras's save_best_only rules, resume.

Every rank runs every test, so the collective constructor (with resume) and the restore are
exercised at the size the suite runs at. The ranks share one temporary directory (rank 0 makes it and broadcasts its
path). Rank r trains on rows r, r + SIZE, ... of one data set with a DistributedOptimizer, so
ranks end up equal only if gradients are averaged and restored state reaches every rank. Expected
behaviour comes from plain Keras (ModelCheckpoint, an uninterrupted fit), not from the callback.
"""

import contextlib
import os
import shutil
import tempfile
import warnings
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist as kd
from kerasdist import ops, runtime
from kerasdist.callbacks import checkpoint as checkpoint_module
from kerasdist.callbacks.checkpoint import PARTIAL_PREFIX, STATE_FILENAME, Rank0Checkpoint
from kerasdist.training_state import build_optimizer

kd.init()
RANK, SIZE = kd.rank(), kd.size()
ROWS, FEATURES, BATCH = 48, 4, 8
STEPS_PER_EPOCH = -(-len(range(RANK, ROWS, SIZE)) // BATCH)
needs_two_ranks = pytest.mark.skipif(SIZE < 2, reason="needs at least 2 ranks (run under mpiexec -n 2)")


@pytest.fixture
def shared_dir():
    path = Path(kd.broadcast_object(tempfile.mkdtemp(prefix="kerasdist-checkpoint-") if RANK == 0 else None))
    yield path
    kd.barrier()  # nobody still reads it
    if RANK == 0:
        shutil.rmtree(path, ignore_errors=True)


def make_model(seed=1, metrics=(), **distributed_options):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(
        optimizer=kd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), **distributed_options),
        loss="mse",
        metrics=list(metrics),
    )
    return model


def this_ranks_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1 * rng.normal(size=(ROWS, 1))).astype("float32")
    return x[RANK::SIZE], y[RANK::SIZE]


def fit(model, epochs, callbacks=(), **kwargs):
    x, y = this_ranks_data()
    return model.fit(
        x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks), **kwargs
    )


def state_values(model):
    """Model weights and optimizer variables (iterations, momentum slots) as numpy arrays."""
    return [v.numpy() for v in model.weights + model.optimizer.variables]


def iterations(model):
    return int(model.optimizer.iterations.numpy())


def checkpoint_files(directory):
    return sorted(name for name in os.listdir(directory) if name.endswith(".keras"))


class _NoCollective:
    def __getattr__(self, name):
        raise AssertionError(f"a collective ran while saving: op {name}")


@contextlib.contextmanager
def collectives_forbidden(monkeypatch):
    """Every kerasdist collective, and the op library behind all of them, fail the test."""
    with monkeypatch.context() as patch:
        for name in (
            "allreduce",
            "grouped_allreduce",
            "allgather",
            "broadcast",
            "broadcast_variables",
            "reducescatter",
            "alltoall",
            "broadcast_object",
            "allgather_object",
            "barrier",
        ):
            patch.setattr(ops, name, _fail_collective(name))
        patch.setattr(runtime.state(), "ops", _NoCollective())
        yield


def _fail_collective(name):
    def fail(*args, **kwargs):
        raise AssertionError(f"a collective ran while saving: kerasdist.{name}")

    return fail


# Without resume nothing is gathered, also when the optimizer keeps per-rank state.
@pytest.mark.parametrize("options", [{}, {"delay_gradients": True}], ids=["plain", "delay_gradients"])
def test_only_the_root_writes_and_saving_runs_no_collective(shared_dir, monkeypatch, options):
    own_dir = shared_dir / f"rank{RANK}"  # only rank 0's may ever appear
    checkpoint = Rank0Checkpoint(own_dir)
    save = checkpoint.on_epoch_end

    def save_without_collectives(epoch, logs=None):
        with collectives_forbidden(monkeypatch):
            save(epoch, logs)

    checkpoint.on_epoch_end = save_without_collectives
    fit(make_model(**options), epochs=2, callbacks=[checkpoint])

    listings = kd.allgather_object(sorted(os.listdir(own_dir)) if own_dir.exists() else None)
    assert listings[0] == [STATE_FILENAME, "epoch0001.keras", "epoch0002.keras"]
    assert listings[1:] == [None] * (SIZE - 1)


def test_a_checkpoint_is_the_whole_model_with_its_optimizer_state(shared_dir):
    model = make_model()
    fit(model, epochs=2, callbacks=[Rank0Checkpoint(shared_dir)])

    kd.barrier()  # rank 0 may still be saving
    latest = Rank0Checkpoint.latest(shared_dir)
    assert (latest.path, latest.epoch) == (str(shared_dir / "epoch0002.keras"), 2)
    restored = keras.saving.load_model(latest.path)
    assert isinstance(restored.optimizer, kd.DistributedOptimizer)
    assert iterations(restored) == iterations(model) == 2 * STEPS_PER_EPOCH
    for saved, now in zip(state_values(restored), state_values(model), strict=True):
        np.testing.assert_array_equal(saved, now)


def test_latest_is_none_in_a_directory_without_checkpoints(shared_dir):
    assert Rank0Checkpoint.latest(shared_dir) is None
    assert Rank0Checkpoint.latest(shared_dir / "missing") is None


# (monitor, mode, compile metrics, monitored value per epoch); None: the logs lack the monitor.
SAVE_BEST_CASES = {
    "loss_auto_is_min_and_ties_do_not_save": ("val_loss", "auto", (), [3.0, 2.0, 2.5, 1.0, 1.0]),
    "accuracy_auto_is_max": ("val_accuracy", "auto", ("accuracy",), [0.5, 0.7, 0.6, 0.9, 0.8]),
    "explicit_max": ("val_loss", "max", (), [1.0, 0.5, 2.0, 2.0, 3.0]),
    "explicit_min": ("val_mae", "min", ("mae",), [0.3, 0.4, 0.2, 0.25, 0.1]),
    "missing_monitor_warns_and_saves": ("val_loss", "auto", (), [None, 2.0, None, 3.0, 1.0]),
}


@pytest.mark.parametrize("case", list(SAVE_BEST_CASES))
def test_save_best_only_saves_the_epochs_keras_model_checkpoint_saves(shared_dir, case):
    monitor, mode, metrics, values = SAVE_BEST_CASES[case]
    model = make_model(metrics=metrics)
    if metrics:
        fit(model, epochs=1)  # builds the compiled metrics, which mode="auto" consults
    logs = [{"loss": 1.0} if value is None else {"loss": 1.0, monitor: value} for value in values]
    ours = Rank0Checkpoint(shared_dir / "ours", monitor=monitor, mode=mode, save_best_only=True)
    ours.set_model(model)
    with warnings_if(None in values):
        for epoch, epoch_logs in enumerate(logs):
            ours.on_epoch_end(epoch, dict(epoch_logs))
    if RANK != 0:
        return
    reference_dir = shared_dir / "keras"
    reference = keras.callbacks.ModelCheckpoint(
        str(reference_dir / "epoch{epoch:04d}.keras"), monitor=monitor, mode=mode, save_best_only=True
    )
    reference.set_model(model)
    with warnings_if(None in values):
        for epoch, epoch_logs in enumerate(logs):
            reference.on_epoch_end(epoch, dict(epoch_logs))
    assert checkpoint_files(shared_dir / "ours") == checkpoint_files(reference_dir)
    assert Rank0Checkpoint.latest(shared_dir / "ours").best == reference.best


def warnings_if(expected):
    return pytest.warns(UserWarning, match="val_loss") if expected and RANK == 0 else contextlib.nullcontext()


def test_the_best_value_survives_a_resume(shared_dir):
    model = make_model()
    first = Rank0Checkpoint(shared_dir, save_best_only=True)
    first.set_model(model)
    for epoch, value in enumerate([2.0, 1.0, 1.5]):
        first.on_epoch_end(epoch, {"val_loss": value})

    resumed = Rank0Checkpoint(shared_dir, save_best_only=True, resume=True)
    assert (resumed.initial_epoch, resumed.best) == (2, 1.0)
    resumed.set_model(model)
    resumed.on_epoch_end(3, {"val_loss": 1.2})  # worse than the best before the interruption
    kd.barrier()  # rank 0 may still be saving
    assert Rank0Checkpoint.latest(shared_dir).epoch == 2
    resumed.on_epoch_end(4, {"val_loss": 0.5})
    kd.barrier()  # rank 0 may still be saving
    assert Rank0Checkpoint.latest(shared_dir).epoch == 5
    assert checkpoint_files(shared_dir) == ["epoch0001.keras", "epoch0002.keras", "epoch0005.keras"]


def test_keep_last_deletes_the_oldest_checkpoints(shared_dir):
    fit(make_model(), epochs=5, callbacks=[Rank0Checkpoint(shared_dir, keep_last=2)])
    kd.barrier()  # rank 0 may still be saving
    assert checkpoint_files(shared_dir) == ["epoch0004.keras", "epoch0005.keras"]
    assert Rank0Checkpoint.latest(shared_dir).epoch == 5


def test_a_name_without_fields_is_overwritten_and_records_its_epoch(shared_dir):
    model = make_model()
    fit(model, epochs=3, callbacks=[Rank0Checkpoint(shared_dir, filename="model.keras")])
    kd.barrier()  # rank 0 may still be saving
    latest = Rank0Checkpoint.latest(shared_dir)
    assert (os.path.basename(latest.path), latest.epoch) == ("model.keras", 3)
    assert checkpoint_files(shared_dir) == ["model.keras"]
    assert iterations(keras.saving.load_model(latest.path)) == 3 * STEPS_PER_EPOCH


def test_the_filename_takes_the_epoch_and_the_logs_like_model_checkpoint(shared_dir):
    history = fit(
        make_model(), epochs=2, callbacks=[Rank0Checkpoint(shared_dir, filename="{epoch:02d}-loss{loss:.4f}.keras")]
    )
    names = [f"{epoch:02d}-loss{loss:.4f}.keras" for epoch, loss in enumerate(history.history["loss"], start=1)]
    if RANK == 0:  # the names come from the root's logs
        assert checkpoint_files(shared_dir) == names


class _StateAtTrainBegin(keras.callbacks.Callback):
    """Records the model's state when fit starts, after the callbacks before it have run."""

    def on_train_begin(self, logs=None):
        self.values = state_values(self.model)
        self.weights = [w.numpy() for w in self.model.weights]
        self.iterations = iterations(self.model)
        optimizer = self.model.optimizer
        self.per_rank_values = [v.numpy() for v in optimizer.per_rank_variables()]
        self.micro_step = int(optimizer._micro_step.numpy())


def test_resume_restores_every_rank_and_continues_like_an_uninterrupted_run(shared_dir):
    uninterrupted = make_model()
    reference = fit(uninterrupted, epochs=4).history["loss"]

    interrupted = make_model()
    fit(interrupted, epochs=2, callbacks=[Rank0Checkpoint(shared_dir)])
    saved = state_values(interrupted)

    # A new process would build its model afresh: different weights on every rank.
    model = make_model(seed=100 + RANK)
    checkpoint = Rank0Checkpoint(shared_dir, resume=True)
    assert checkpoint.initial_epoch == 2
    assert checkpoint.resumed_from.path == str(shared_dir / "epoch0002.keras")
    probe = _StateAtTrainBegin()
    history = fit(model, epochs=4, initial_epoch=checkpoint.initial_epoch, callbacks=[checkpoint, probe])

    assert probe.iterations == 2 * STEPS_PER_EPOCH
    for restored, expected in zip(probe.values, saved, strict=True):
        np.testing.assert_array_equal(restored, expected)
    assert history.epoch == [2, 3]
    np.testing.assert_allclose(history.history["loss"], reference[2:], rtol=0, atol=1e-6)
    for now, expected in zip(state_values(model), state_values(uninterrupted), strict=True):
        np.testing.assert_allclose(now, expected, rtol=0, atol=1e-6)
    kd.barrier()  # rank 0 may still be saving
    assert checkpoint_files(shared_dir) == [f"epoch000{epoch}.keras" for epoch in (1, 2, 3, 4)]


# Optimizer state that differs between ranks: held local gradients, error-feedback residuals, and
# partial sums of a window (4 micro-batches: at 1, 2 and 3 ranks an epoch of 6, 3 or 2 steps ends
# inside a window).
PER_RANK_STATE = {
    "delay_gradients": {"delay_gradients": True},
    "one_bit_gradients": {"one_bit_gradients": True},
    "accumulation_across_the_epoch_end": {"backward_passes_per_step": 4},
}


@pytest.mark.parametrize("options", PER_RANK_STATE.values(), ids=PER_RANK_STATE.keys())
def test_resume_gives_each_rank_its_own_optimizer_state_and_continues_like_an_uninterrupted_run(shared_dir, options):
    uninterrupted = make_model(**options)
    fit(uninterrupted, epochs=4)

    interrupted = make_model(**options)
    fit(interrupted, epochs=2, callbacks=[Rank0Checkpoint(shared_dir, resume=True)])
    own_state = state_values(interrupted)

    model = make_model(seed=100 + RANK, **options)  # a new process: different weights on every rank
    checkpoint = Rank0Checkpoint(shared_dir, resume=True)
    probe = _StateAtTrainBegin()
    fit(model, epochs=4, callbacks=[checkpoint, probe])

    for restored, expected in zip(probe.values, own_state, strict=True):
        np.testing.assert_array_equal(restored, expected)
    for now, expected in zip(state_values(model), state_values(uninterrupted), strict=True):
        np.testing.assert_allclose(now, expected, rtol=0, atol=1e-6)


@needs_two_ranks
def test_a_checkpoint_with_the_roots_part_only_starts_the_per_rank_state_afresh_and_says_so(shared_dir):
    options = PER_RANK_STATE["accumulation_across_the_epoch_end"]
    saved = make_model(**options)
    fit(saved, epochs=1, callbacks=[Rank0Checkpoint(shared_dir)])  # without resume: nothing gathered
    assert int(saved.optimizer._micro_step.numpy()) > 0  # the epoch ended inside a window
    model = make_model(seed=100 + RANK, **options)
    probe = _StateAtTrainBegin()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, epochs=2, callbacks=[Rank0Checkpoint(shared_dir, resume=True), probe])
    messages = [str(w.message) for w in caught if "starts afresh" in str(w.message)]

    assert len(messages) == (1 if RANK == 0 else 0), messages
    if RANK == 0:
        assert "holds only the root's part" in messages[0] and "backward_passes_per_step" in messages[0]
    # The window saved after the epoch's last step was not empty; on resume it is, on every rank.
    assert probe.per_rank_values and probe.micro_step == 0
    for partial in probe.per_rank_values:
        np.testing.assert_array_equal(partial, np.zeros_like(partial))
    for restored, expected in zip(probe.weights, saved.weights, strict=True):  # equal on every rank
        np.testing.assert_array_equal(restored, expected.numpy())


def test_a_root_rank_other_than_0_alone_writes_and_restores_every_rank(shared_dir):
    # Every rank names its own directory: only the root's gets checkpoints, so a resume that
    # looked anywhere else would find none.
    root = SIZE - 1
    own_dir = shared_dir / f"rank{RANK}"
    model = make_model()
    fit(model, epochs=2, callbacks=[Rank0Checkpoint(own_dir, root_rank=root)])
    saved = state_values(model)
    listings = kd.allgather_object(sorted(os.listdir(own_dir)) if own_dir.exists() else None)
    assert listings[root] == [STATE_FILENAME, "epoch0001.keras", "epoch0002.keras"]
    assert [listing for r, listing in enumerate(listings) if r != root] == [None] * (SIZE - 1)

    resumed = make_model(seed=100 + RANK)  # different weights on every rank
    checkpoint = Rank0Checkpoint(own_dir, resume=True, root_rank=root)
    assert checkpoint.initial_epoch == 2
    probe = _StateAtTrainBegin()
    fit(resumed, epochs=3, callbacks=[checkpoint, probe])
    assert probe.iterations == 2 * STEPS_PER_EPOCH
    for restored, expected in zip(probe.values, saved, strict=True):
        np.testing.assert_array_equal(restored, expected)


def test_resume_is_a_no_op_without_a_checkpoint(shared_dir):
    checkpoint = Rank0Checkpoint(shared_dir, resume=True)
    assert (checkpoint.initial_epoch, checkpoint.resumed_from) == (0, None)
    model = make_model()
    history = fit(model, epochs=1, callbacks=[checkpoint])
    assert history.epoch == [0]
    kd.barrier()  # rank 0 may still be saving
    assert Rank0Checkpoint.latest(shared_dir).epoch == 1


def test_fit_continues_from_the_checkpoint_without_initial_epoch_and_only_once(shared_dir):
    fit(make_model(), epochs=1, callbacks=[Rank0Checkpoint(shared_dir)])
    model = make_model()
    assert fit(model, epochs=3, callbacks=[Rank0Checkpoint(shared_dir, resume=True)]).epoch == [1, 2]
    assert fit(model, epochs=1).epoch == [0]  # a later fit starts where its caller says


def test_leftovers_of_an_interrupted_save_are_removed_and_never_taken_for_checkpoints(shared_dir):
    fit(make_model(), epochs=1, callbacks=[Rank0Checkpoint(shared_dir)])
    if RANK == 0:
        (shared_dir / f"{PARTIAL_PREFIX}epoch0002.keras").write_bytes(b"half a zip")
        (shared_dir / f"{PARTIAL_PREFIX}{STATE_FILENAME}").write_text('{"latest": "epo')
    kd.barrier()
    assert Rank0Checkpoint.latest(shared_dir).epoch == 1
    checkpoint = Rank0Checkpoint(shared_dir, resume=True)
    assert checkpoint.initial_epoch == 1
    assert sorted(os.listdir(shared_dir)) == [STATE_FILENAME, "epoch0001.keras"]


@pytest.mark.parametrize("filename", ["epoch{epoch:04d}.keras", "model.keras"])
def test_a_crash_before_the_save_is_recorded_leaves_a_latest_whose_epoch_matches_its_contents(
    shared_dir, monkeypatch, filename
):
    model = make_model()
    build_optimizer(model)
    checkpoint = Rank0Checkpoint(shared_dir, filename=filename)
    checkpoint.set_model(model)
    model.optimizer.iterations.assign(1)  # stands for "the state after epoch 1"
    checkpoint.on_epoch_end(0)

    def crash(*args):
        raise OSError("simulated crash after the checkpoint file was renamed into place")

    monkeypatch.setattr(checkpoint_module, "_write_atomically", crash)
    model.optimizer.iterations.assign(2)
    with pytest.raises(OSError, match="simulated") if RANK == 0 else contextlib.nullcontext():
        checkpoint.on_epoch_end(1)
    kd.barrier()  # rank 0 may still be saving
    latest = Rank0Checkpoint.latest(shared_dir)
    # A numbered file not yet recorded does not count; an overwritten one carries its own epoch.
    assert latest.epoch == (1 if "{epoch" in filename else 2)
    assert iterations(keras.saving.load_model(latest.path)) == latest.epoch


def test_without_resume_the_root_alone_checks_the_directory_and_no_collective_runs(shared_dir, monkeypatch):
    not_a_directory = shared_dir / "a_file"
    if RANK == 0:
        not_a_directory.write_text("")
    kd.barrier()
    with collectives_forbidden(monkeypatch):
        if RANK == 0:
            with pytest.raises(FileExistsError, match="cannot write checkpoints to .*a_file.*not a directory"):
                Rank0Checkpoint(not_a_directory)
        else:
            Rank0Checkpoint(not_a_directory)  # only rank 0 ever touches it


def test_with_resume_a_root_that_cannot_use_the_directory_fails_every_rank_with_the_same_error(shared_dir):
    not_a_directory = shared_dir / "a_file"
    if RANK == 0:
        not_a_directory.write_text("")
    kd.barrier()
    with pytest.raises(FileExistsError, match="cannot write checkpoints to .*a_file.*not a directory"):
        Rank0Checkpoint(not_a_directory, resume=True)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to any directory")
def test_with_resume_an_unwritable_directory_fails_every_rank(shared_dir):
    read_only = shared_dir / "read_only"
    if RANK == 0:
        read_only.mkdir(mode=0o500)
    kd.barrier()
    with pytest.raises(PermissionError, match="cannot write checkpoints"):
        Rank0Checkpoint(read_only, resume=True)


def test_built_on_the_root_alone_as_horovod_scripts_do_it_saves_and_later_collectives_pair(shared_dir):
    model = make_model()
    callbacks = kd.callbacks()
    if RANK == 0:
        callbacks.append(Rank0Checkpoint(shared_dir))
    fit(model, epochs=2, callbacks=callbacks)
    assert kd.broadcast_object("hello" if RANK == 0 else None) == "hello"
    if RANK == 0:
        assert Rank0Checkpoint.latest(shared_dir).epoch == 2


@needs_two_ranks
def test_resume_built_on_the_root_alone_fails_every_rank_naming_the_fix(shared_dir):
    error = None
    try:
        if RANK == 0:
            Rank0Checkpoint(shared_dir, resume=True)
        kd.broadcast_object("the other ranks moved on")
    except Exception as caught:  # noqa: BLE001 - asserted below
        error = caught
    assert kd.allgather_object("in step") == ["in step"] * SIZE
    if RANK == 0:
        assert isinstance(error, RuntimeError), repr(error)
        assert "Rank0Checkpoint(resume=True) is a collective: construct it on every rank" in str(error)
    else:
        assert isinstance(error, tf.errors.FailedPreconditionError), repr(error)
        assert "rank 0 waits in 'Rank0Checkpoint(resume=True)'" in error.message


def test_a_record_that_is_not_json_is_named_on_every_rank(shared_dir):
    if RANK == 0:
        (shared_dir / STATE_FILENAME).write_text("{not json")
    kd.barrier()
    with pytest.raises(ValueError, match=f"{STATE_FILENAME} is not a checkpoint record written by Rank0Checkpoint"):
        Rank0Checkpoint(shared_dir, resume=True)


@pytest.mark.parametrize("damage", ["truncated", "flipped_byte"])
def test_resume_from_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(shared_dir, damage):
    fit(make_model(), epochs=3, callbacks=[Rank0Checkpoint(shared_dir)])
    if RANK == 0:
        latest = shared_dir / "epoch0003.keras"
        data = latest.read_bytes()
        if damage == "truncated":
            latest.write_bytes(data[: len(data) // 2])
        else:  # inside the first stored entry: its CRC no longer matches
            middle = len(data) // 4
            latest.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :])
    kd.barrier()
    with (
        pytest.warns(UserWarning, match="epoch0003.keras .*cannot be read.*newest intact one.*epoch0002.keras")
        if RANK == 0
        else contextlib.nullcontext()
    ):
        checkpoint = Rank0Checkpoint(shared_dir, resume=True)
    assert checkpoint.initial_epoch == 2

    resumed = make_model(seed=5)
    fit(resumed, epochs=3, callbacks=[checkpoint])
    assert iterations(resumed) == 3 * STEPS_PER_EPOCH


def test_a_checkpoint_of_another_model_fails_every_rank_when_fit_starts(shared_dir):
    fit(make_model(), epochs=1, callbacks=[Rank0Checkpoint(shared_dir)])
    other = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    other.compile(optimizer=kd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    with pytest.raises(ValueError):
        fit(other, epochs=2, callbacks=[Rank0Checkpoint(shared_dir, resume=True)])
    kd.barrier()  # every rank got here: no rank was left waiting for the state broadcast


@pytest.mark.parametrize(
    "arguments",
    [
        {"filename": "epoch{epoch}.h5"},
        {"filename": "sub/epoch{epoch}.keras"},
        {"keep_last": 0},
        {"root_rank": SIZE},
    ],
    ids=["not_keras", "a_path", "keep_none", "root_outside_the_job"],
)
def test_invalid_arguments_are_refused_before_any_collective(shared_dir, arguments):
    with pytest.raises(ValueError):
        Rank0Checkpoint(shared_dir, **arguments)


def test_a_link_planted_where_a_save_writes_is_never_written_through(shared_dir):
    """Earlier saves wrote to a fixed name beside the checkpoint, which anyone who may write to
    the directory could have made a link to one of the user's files."""
    if RANK == 0:
        victim = shared_dir / "victim.txt"
        victim.write_text("the user's own file")
        for written in ("epoch0001.keras", STATE_FILENAME):
            (shared_dir / f"{PARTIAL_PREFIX}{written}").symlink_to(victim)
    kd.barrier()
    checkpoint = Rank0Checkpoint(shared_dir)
    if RANK == 0:  # a link planted after the directory was prepared (which removes leftovers)
        for written in ("epoch0001.keras", STATE_FILENAME):
            link = shared_dir / f"{PARTIAL_PREFIX}{written}"
            if not link.is_symlink():
                link.symlink_to(victim)
    fit(make_model(), epochs=1, callbacks=[checkpoint])
    kd.barrier()
    if RANK == 0:
        assert victim.read_text() == "the user's own file"
        saved = shared_dir / "epoch0001.keras"
        assert not saved.is_symlink() and zipfile.is_zipfile(saved)


def test_checkpoint_files_take_the_users_umask(shared_dir):
    previous = os.umask(0o027)  # group may read, others nothing
    try:
        fit(make_model(), epochs=1, callbacks=[Rank0Checkpoint(shared_dir)])
    finally:
        os.umask(previous)
    kd.barrier()  # rank 0 has written
    if RANK == 0:
        written = [*checkpoint_files(shared_dir), STATE_FILENAME]
        assert {name: oct(os.stat(shared_dir / name).st_mode & 0o777) for name in written} == {
            name: oct(0o640) for name in written
        }
