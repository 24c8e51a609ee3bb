"""Checkpoints that one rank writes atomically, and resuming training from them."""

import collections
import contextlib
import io
import json
import math
import os
import signal
import tempfile
import threading
import warnings
import zipfile
import zlib

import numpy as np
import tensorflow as tf

from kerasdist import _compat, runtime, training_state
from kerasdist.coordination import on_root_for_every_rank
from kerasdist.notice import notice_state

# Names Rank0Checkpoint owns in its directory.
STATE_FILENAME = "checkpoint_state.json"  # {"latest": file name, "kept": file names, oldest first}
PARTIAL_PREFIX = ".kerasdist-partial-"  # a file being written; never a checkpoint
METADATA_ENTRY = "kerasdist_checkpoint.json"  # inside each .keras archive: epoch, monitor, best, ranks
# Inside a .keras archive saved with resume=True by several ranks: row r holds rank r's per-rank
# optimizer variables, byte for byte (the archive's own optimizer variables are the root's).
PER_RANK_STATE_ENTRY = "kerasdist_per_rank_state.npy"
PER_RANK_STATE_COLLECTIVE = "Rank0Checkpoint(resume=True): per-rank optimizer state"

SavedCheckpoint = collections.namedtuple(
    "SavedCheckpoint", ["path", "epoch", "monitor", "best", "batches_of_all_ranks"], defaults=[0]
)
SavedCheckpoint.__doc__ = """A checkpoint on disk: its `path`, the number of epochs completed when it
was saved (`epoch`, the `initial_epoch` to continue from), the `best` value of `monitor`
seen by then (`None` unless it was saved with `save_best_only=True`) and, for one saved in the
middle of epoch `epoch` on notice, the batches of that epoch the ranks had trained on, added up
over the ranks (`batches_of_all_ranks`; 0 for an epoch end)."""


class Rank0Checkpoint(_compat.MonitorCallback):
    """Saves the model at the end of epochs from one rank, atomically, and resumes from it.

    Only `root_rank` writes (the other ranks never touch `directory`, not even to create it), and
    saving runs no collective (except the gather of per-rank state below), so the other ranks go
    on training meanwhile. Each checkpoint is a
    complete `.keras` file (`model.save`: architecture, weights and optimizer state, including a
    `kerasdist.DistributedOptimizer` and the optimizer it wraps). It is written under a temporary
    name, flushed to disk and renamed into place, and only then recorded as the latest in
    `directory/checkpoint_state.json` (written the same way), and the epoch it belongs to is stored
    inside the file itself: a crash or `kill -9` at any moment leaves a complete, loadable
    checkpoint recorded as the latest, with its true epoch (the previous one, or the new one once
    it is complete, which matters when every save goes to one file name). A SIGTERM (a scheduler
    ending or requeueing the job) that arrives during a save takes effect once the save is
    complete, so the epoch is kept and nothing half-written is left. Leftover temporary files
    (named `.kerasdist-partial-*`) are never taken for checkpoints and are removed the next time
    a `Rank0Checkpoint` is constructed on the directory. One training job per directory.

    `monitor`, `mode` and `save_best_only` mean what they mean for `keras.callbacks.
    ModelCheckpoint`. List this callback after `kerasdist.callbacks.MetricAverage`, so that the
    logs it monitors are the global ones.

    When every rank stopped `fit` on a notice to leave (`StopAgreement`,
    `KERASDIST_NOTICE_SIGNAL`) in the middle of an epoch, this callback saves that step whatever
    `save_best_only` says, as `filename` with `-batchN` before `.keras` (N: the batches of the epoch
    each rank had done). Resuming from it, `fit` starts that epoch and passes over the batches
    already trained on without training on them (it draws them from the data and drops them), so
    the run goes on exactly where it stopped, also on another number of ranks when the data is
    sharded by `kerasdist.data.shard` (the batches added up over the ranks divided by the ranks
    now). That epoch's logs then cover only the batches trained after the resume. An epoch that a
    callback stops at a batch (`stop_training`: a time budget before a requeue, `TerminateOnNaN`)
    is saved the same way, unless `save_best_only` (its logs cover part of an epoch): never as a
    whole epoch, which a resume would skip the rest of.

    With `resume=True`, the constructor looks up the latest checkpoint in `directory` on
    `root_rank` and tells every rank its epoch (`initial_epoch`, 0 when there is none); at the
    start of `fit`, `root_rank` loads the model and optimizer variables from it and broadcasts
    them to every rank. `fit` then continues from `initial_epoch` by itself (as with
    `keras.callbacks.BackupAndRestore`); passing `initial_epoch=checkpoint.initial_epoch` to `fit`
    as well says so explicitly. The best monitored value is restored too, so `save_best_only`
    goes on comparing against the best value of the interrupted run.

    Some optimizer state differs between ranks: a `DistributedOptimizer`'s partial sums with
    `backward_passes_per_step`, the gradients `delay_gradients` holds, the `one_bit_gradients`
    residuals. With `resume=True` every rank sends its part to `root_rank` at each epoch end (a
    collective every rank reaches, since every rank constructed the callback), each checkpoint
    stores every rank's part, and on resume each rank gets its own back: the run continues exactly
    as an uninterrupted one. A checkpoint saved without `resume` (which gathers nothing) or by
    another number of ranks cannot give each rank its part: that state then starts afresh (an
    empty window, nothing held, zero residuals), with a warning on `root_rank`.

    Without `resume`, nothing here is a collective: build it on every rank, or on `root_rank`
    alone as Horovod's recipe does (`if rank == 0: callbacks.append(...)`). A directory
    `root_rank` cannot create or write to then raises there, at construction. With
    `resume=True` the constructor is a collective: every rank must construct it (with the same
    arguments except `directory`, which only `root_rank` uses), since every rank must learn the
    epoch to continue from; built on one rank only, it fails within seconds
    (`KERASDIST_MISMATCH_TIMEOUT_S`) once the other ranks wait in a collective of their own. A
    directory `root_rank` cannot use, or a checkpoint it cannot load, then raises the same error
    on every rank instead of leaving the others waiting. If the latest checkpoint is damaged (a
    truncated copy, a full disk), resuming warns and continues from the newest intact one the
    record keeps.

    Args:
        directory: where `root_rank` writes checkpoints; created if needed.
        filename: name of each checkpoint in `directory`, ending in `.keras`, formatted like
            `ModelCheckpoint`'s `filepath` with `epoch` (counted from 1) and the epoch's logs,
            e.g. `"{epoch:03d}-{val_loss:.3f}.keras"`. A name without fields (`"best.keras"`) is
            overwritten by each save. Defaults to `"epoch{epoch:04d}.keras"`.
        monitor: the log entry `save_best_only` watches. Defaults to `"val_loss"`.
        mode: `"auto"`, `"min"` or `"max"`, as for `ModelCheckpoint`. Defaults to `"auto"`.
        save_best_only: save only when `monitor` improved on the best value so far. When the logs
            lack `monitor`, Keras's rule applies: warn and save. Defaults to `False`.
        keep_last: keep only this many of the newest checkpoints this callback wrote, deleting
            older ones; `None` (default) keeps all.
        resume: continue from the latest checkpoint in `directory`, if there is one.
        root_rank: the rank that writes and restores. Defaults to 0.
        verbose: 1 prints a line on `root_rank` for each save or skipped save. Defaults to 0.

    Attributes:
        initial_epoch: the epoch training continues from: the latest checkpoint's epoch count
            with `resume=True` and a checkpoint found, otherwise 0. Equal on every rank.
        resumed_from: the `SavedCheckpoint` resumed from, or `None`.

    Raises:
        ValueError: for a `filename` that is not a plain `.keras` file name, a `keep_last` below
            1 or a `root_rank` outside the job; with `resume=True`, on every rank, for a record
            (`checkpoint_state.json`) that is not one Rank0Checkpoint wrote.
        OSError: on `root_rank` (on every rank with `resume=True`) when `root_rank` cannot create
            or write to `directory`; with `resume=True`, when the record names a missing latest
            checkpoint or no checkpoint it names can be read.

    Example:

    ```python
    import keras
    import numpy as np
    import kerasdist
    from kerasdist.callbacks import Rank0Checkpoint

    kerasdist.init()
    x = np.random.rand(256, 8).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)),
                  loss="mse")
    # Run this script again after an interruption: it continues after the last saved epoch.
    checkpoint = Rank0Checkpoint("checkpoints", monitor="loss", keep_last=3, resume=True)
    model.fit(x, y, epochs=10, initial_epoch=checkpoint.initial_epoch, verbose=0,
              callbacks=[checkpoint])
    latest = Rank0Checkpoint.latest("checkpoints")  # a SavedCheckpoint(path, epoch, ...)
    restored = keras.saving.load_model(latest.path)
    ```
    """

    def __init__(
        self,
        directory,
        filename="epoch{epoch:04d}.keras",
        monitor="val_loss",
        mode="auto",
        save_best_only=False,
        keep_last=None,
        resume=False,
        root_rank=0,
        verbose=0,
    ):
        super().__init__(monitor, mode)
        _check_filename(filename)
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last={keep_last!r} must be None (keep all) or an integer >= 1")
        world = runtime.state()
        if not 0 <= root_rank < world.size:
            raise ValueError(f"root_rank={root_rank} is not a rank of this job of {world.size} process(es)")
        self.directory = os.fspath(directory)
        self.filename = filename
        self.save_best_only = save_best_only
        self.keep_last = keep_last
        self.resume = resume
        self.root_rank = root_rank
        self.verbose = verbose
        self._is_root = world.rank == root_rank

        latest, kept = None, []
        if resume:
            # Every rank must learn the epoch to continue from: a collective, under a name of its own
            # so that a constructor run on one rank only fails as a mismatch naming it.
            try:
                latest, kept = on_root_for_every_rank(
                    self._prepare_directory, root_rank, name="Rank0Checkpoint(resume=True)"
                )
            except tf.errors.FailedPreconditionError as error:
                raise RuntimeError(
                    "Rank0Checkpoint(resume=True) is a collective: construct it on every rank, not only "
                    f"under `if rank == {root_rank}:` (every rank must learn the epoch to resume from; only "
                    f"rank {root_rank} writes). Without resume it may be built on rank {root_rank} alone. "
                    f"[{error.message}]"
                ) from None
        elif self._is_root:
            self._prepare_directory()  # without resume nothing is shared: no collective here
        self.resumed_from = latest
        self.initial_epoch = latest.epoch if latest else 0
        self._kept = kept if latest else []
        if latest and save_best_only and latest.monitor == monitor:
            self.best = latest.best
        self._restore_pending = latest is not None
        self._set_initial_epoch = False
        self._batches_to_pass_over = _batches_to_pass_over(latest, world.size, root_rank == world.rank)
        self._batches_done = 0  # of the current epoch
        self._position_resumed = 0  # batches of the current epoch a resume passes over, as trained

    @staticmethod
    def latest(directory):
        """The newest complete checkpoint in `directory` as a `SavedCheckpoint`, or `None`.

        Reads the directory directly (no collective): call it where the directory is visible.
        A damaged latest checkpoint gives way, with a warning, to the newest intact one.
        Raises `FileNotFoundError` when the record names a latest checkpoint deleted since.

        Example:

        ```python
        import keras, numpy as np, tempfile, kerasdist
        kerasdist.init()
        directory = kerasdist.broadcast_object(tempfile.mkdtemp() if kerasdist.rank() == 0 else None)
        print(kerasdist.callbacks.Rank0Checkpoint.latest(directory))  # None
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
        saver = kerasdist.callbacks.Rank0Checkpoint(directory)
        model.fit(np.ones((8, 3)), np.ones((8, 1)), epochs=2, verbose=0, callbacks=[saver, *kerasdist.callbacks()])
        latest = kerasdist.callbacks.Rank0Checkpoint.latest(directory)
        print(latest.epoch, latest.batches_of_all_ranks)  # 2 0
        ```
        """
        return _read_latest(os.fspath(directory))[0]

    def _prepare_directory(self):
        """On the root: make sure checkpoints can be written, drop leftovers, find the latest."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            handle, probe = tempfile.mkstemp(prefix=PARTIAL_PREFIX, dir=self.directory)
            os.close(handle)
            os.remove(probe)
        except OSError as error:
            reason = (
                "it exists and is not a directory"
                if os.path.exists(self.directory) and not os.path.isdir(self.directory)
                else error.strerror or str(error)
            )
            raise type(error)(
                f"Rank0Checkpoint: rank {self.root_rank} cannot write checkpoints to {self.directory!r} "
                f"({reason}); pass a directory that rank {self.root_rank} can create and write to"
            ) from error
        for name in os.listdir(self.directory):
            if name.startswith(PARTIAL_PREFIX):  # from a save that was interrupted
                os.remove(os.path.join(self.directory, name))
        return _read_latest(self.directory) if self.resume else (None, [])

    def on_train_begin(self, logs=None):
        if self._restore_pending:
            self._restore_pending = False
            self._restore()

    def _restore(self):
        # Keras creates optimizer variables at the first step; they must exist to be loaded into.
        if not training_state.build_optimizer(self.model) or not self.model.built:
            raise ValueError(
                "Rank0Checkpoint(resume=True) needs a model that is built when fit() starts; "
                "give it an input shape (keras.Input or model.build) before fit()"
            )
        path = self.resumed_from.path
        per_rank = training_state.per_rank_variables(self.model)
        saved_rows = []  # filled on the root only

        def load():
            self.model.load_weights(path)
            rows, why_not = _saved_per_rank_state(path, per_rank)
            saved_rows.append(rows)
            return why_not

        why_not = on_root_for_every_rank(load, self.root_rank)
        training_state.broadcast_training_state(self.model, self.root_rank)
        if why_not is None and per_rank and runtime.state().size > 1:
            training_state.scatter_per_rank_state(
                per_rank, saved_rows[0] if saved_rows else None, self.root_rank, PER_RANK_STATE_COLLECTIVE
            )
        elif why_not is not None:
            training_state.reset_per_rank_state(self.model)
            if self._is_root and why_not:
                warnings.warn(
                    f"Rank0Checkpoint: {path} {why_not}, so each rank's own optimizer state "
                    f"({training_state.describe_per_rank_state(per_rank)}) starts afresh: an empty "
                    "accumulation window, no held gradients (the next update applies nothing), zero "
                    "residuals. The rest of the state is restored.",
                    stacklevel=2,
                )
        if self._is_root and self.verbose > 0:
            within = f", batch {self._batches_to_pass_over}" if self._batches_to_pass_over else ""
            _compat.print_msg(f"Rank0Checkpoint: resumed from {path} after epoch {self.initial_epoch}{within}")
        _compat.set_initial_epoch(self.model, self.initial_epoch)
        self._set_initial_epoch = True

    def on_train_end(self, logs=None):
        if self._set_initial_epoch:  # a later fit() starts where its caller says
            _compat.set_initial_epoch(self.model, None)
            self._set_initial_epoch = False

    def on_epoch_begin(self, epoch, logs=None):
        self._batches_done = 0
        self._position_resumed = 0
        if self._batches_to_pass_over and epoch == self.initial_epoch:
            self._pass_over_trained_batches(self._batches_to_pass_over)
            self._position_resumed = self._batches_to_pass_over
        self._batches_to_pass_over = 0

    def on_train_batch_end(self, batch, logs=None):
        self._batches_done = batch + 1  # counting from the epoch's start, batches passed over too

    def _pass_over_trained_batches(self, batches):
        """Makes the epoch's first `batches` steps draw their batches and drop them, untrained."""
        train_function = self.model.train_function
        per_call = self.model.steps_per_execution
        left = [batches // per_call]
        if not left[0]:
            return

        def pass_over(iterator):
            for _ in range(per_call):
                next(iterator)
            left[0] -= 1
            if left[0] == 0:
                self.model.train_function = train_function
            # No logs: nothing trained, and compiled metrics are built only by a step that does.
            return {}

        self.model.train_function = pass_over

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        per_rank_rows = self._gather_per_rank_state()
        # Every rank checks the monitor and the file name, so a mistake fails on all of them.
        if self.save_best_only and self.monitor_op is None:
            self._set_monitor_op()
        name = _format_filename(self.filename, epoch, logs)
        on_notice = notice_state.taken_at is not None and notice_state.taken_at[0] == epoch
        # A stop while the resume passes over trained batches holds the state it resumed, so it
        # is at the position it resumed from, not at the batches passed over so far.
        batches = max(notice_state.taken_at[1] if on_notice else self._batches_done, self._position_resumed)
        if on_notice:
            notice_state.taken_at = (epoch, batches)  # what StopAgreement reports
        # Stopped inside the epoch (a notice, or a callback that set stop_training at a batch):
        # saved as such, so that a resume trains the rest of the epoch instead of taking it as done.
        cut = (on_notice or self.model.stop_training) and batches < ((self.params or {}).get("steps") or math.inf)
        if on_notice:
            notice_state.saved = True  # a notice's step is saved whatever save_best_only says
        if cut:
            if self._is_root and (on_notice or not self.save_best_only):
                name = f"{name[: -len('.keras')]}-batch{batches}.keras"
                self._save(name, epoch, per_rank_rows, batches * runtime.state().size)
            return
        if not self._is_root or not (on_notice or self._should_save(epoch, logs, name)):
            return
        self._save(name, epoch + 1, per_rank_rows)

    def _gather_per_rank_state(self):
        """Every rank's per-rank optimizer variables, on the root (None elsewhere, or with none).

        A collective, at every epoch end whether or not the root then saves (only the root knows).
        Only with resume=True: then every rank built this callback (its constructor is a
        collective too), so every rank comes here at the same point and nothing waits for ever.
        Without resume the callback may live on the root alone, and saving runs no collective.
        """
        variables = training_state.per_rank_variables(self.model)
        if not self.resume or runtime.state().size == 1 or not variables:
            return None
        return training_state.gather_per_rank_state(variables, self.root_rank, PER_RANK_STATE_COLLECTIVE)

    def _should_save(self, epoch, logs, name):
        if not self.save_best_only:
            if self.verbose > 0:
                _compat.print_msg(f"\nEpoch {epoch + 1}: saving model to {name}")
            return True
        current = logs.get(self.monitor)
        if current is None:
            warnings.warn(
                f"Rank0Checkpoint: can save the best model only with {self.monitor!r} in the "
                f"logs (it has {sorted(logs)}); saving this epoch",
                stacklevel=2,
            )
            return True
        best_text = "None" if self.best is None else f"{self.best:.5f}"
        if not self._is_improvement(current, self.best):
            if self.verbose > 0:
                _compat.print_msg(f"\nEpoch {epoch + 1}: {self.monitor} did not improve from {best_text}")
            return False
        if self.verbose > 0:
            _compat.print_msg(
                f"\nEpoch {epoch + 1}: {self.monitor} improved from {best_text} to "
                f"{float(current):.5f}, saving model to {name}"
            )
        self.best = float(current)
        return True

    def _save(self, name, epochs_done, per_rank_rows=None, batches_of_all_ranks=0):
        """Writes one checkpoint so that a crash at any point leaves the previous one usable."""
        with _sigterm_held_back():
            self._write_checkpoint(name, epochs_done, per_rank_rows, batches_of_all_ranks)

    def _write_checkpoint(self, name, epochs_done, per_rank_rows, batches_of_all_ranks):
        path = os.path.join(self.directory, name)
        metadata = {
            "epoch": epochs_done,
            "batches_of_all_ranks": batches_of_all_ranks,
            "monitor": self.monitor,
            "best": self.best if self.save_best_only else None,
            "ranks": runtime.state().size,
            "per_rank_variables": training_state.variables_layout(training_state.per_rank_variables(self.model)),
        }
        with _partial_file_for(path) as partial:
            self.model.save(partial)
            # The epoch travels inside the archive, so it is replaced together with the weights
            # even when every save goes to the same file name.
            with zipfile.ZipFile(partial, "a") as archive:
                archive.writestr(METADATA_ENTRY, json.dumps(metadata))
                if per_rank_rows is not None:
                    rows = io.BytesIO()
                    np.save(rows, per_rank_rows, allow_pickle=False)
                    archive.writestr(PER_RANK_STATE_ENTRY, rows.getvalue())
        self._kept = [kept for kept in self._kept if kept != name] + [name]
        dropped = []
        if self.keep_last is not None:
            dropped, self._kept = self._kept[: -self.keep_last], self._kept[-self.keep_last :]
        _write_atomically(
            os.path.join(self.directory, STATE_FILENAME), json.dumps({"latest": name, "kept": self._kept})
        )
        for old in dropped:  # only after the record no longer names them
            try:
                os.remove(os.path.join(self.directory, old))
            except FileNotFoundError:
                pass


def _batches_to_pass_over(latest, size, is_root):
    """The batches each of `size` ranks passes over in the epoch resumed from `latest`."""
    if latest is None or not latest.batches_of_all_ranks:
        return 0
    batches, left_over = divmod(latest.batches_of_all_ranks, size)
    if left_over and is_root:
        warnings.warn(
            f"Rank0Checkpoint: {latest.path} was saved after {latest.batches_of_all_ranks} batches of epoch "
            f"{latest.epoch + 1} on all ranks together, which {size} rank(s) cannot share evenly; each passes "
            f"over {batches}. Shard the data with kerasdist.data.shard and restart on a number of ranks that "
            "divides the planned one (kerasdist-run --min-np does) to resume exactly",
            stacklevel=3,
        )
    return batches


def _saved_per_rank_state(path, variables):
    """(rows, None) when the checkpoint at `path` holds every rank's part of `variables` for this
    job (rows on the root, as `training_state.gather_per_rank_state` gave them; None in one
    process, where the loaded variables are that rank's own); otherwise (None, why not), where
    why not is "" when the checkpoint had no per-rank state to lose. Runs on the root."""
    if not variables:
        return None, None
    size = runtime.state().size
    with zipfile.ZipFile(path) as archive:
        metadata = json.loads(archive.read(METADATA_ENTRY))
        saved_ranks = metadata.get("ranks")  # None: saved before kerasdist kept more than the root's part
        saved_layout = metadata.get("per_rank_variables")
        if saved_layout == []:
            return None, ""
        if saved_ranks is None:
            if size == 1:
                return None, None
            return (
                None,
                "was saved by an older kerasdist, which kept only the root's part of the per-rank optimizer state",
            )
        if saved_ranks != size:
            return None, f"was saved by {saved_ranks} rank(s) and this job runs {size}"
        if saved_layout != training_state.variables_layout(variables):
            return None, "holds per-rank optimizer variables of other kinds or shapes than this optimizer's"
        if size == 1:
            return None, None
        if PER_RANK_STATE_ENTRY not in archive.namelist():
            return None, (
                "holds only the root's part of the per-rank optimizer state (it was saved by a "
                "Rank0Checkpoint without resume=True, which gathers nothing)"
            )
        rows = np.load(io.BytesIO(archive.read(PER_RANK_STATE_ENTRY)), allow_pickle=False)
    problem = training_state.per_rank_rows_problem(rows, variables, size)
    if problem:
        raise ValueError(
            f"{path}: {PER_RANK_STATE_ENTRY} {problem}, not every rank's per-rank optimizer state as "
            "Rank0Checkpoint writes it; resume from another checkpoint"
        )
    return rows, None


def _check_filename(filename):
    if not isinstance(filename, str) or not filename.endswith(".keras"):
        raise ValueError(f"filename={filename!r} must end in '.keras' (Rank0Checkpoint saves whole models)")
    if os.path.basename(filename) != filename or filename.startswith(PARTIAL_PREFIX):
        raise ValueError(
            f"filename={filename!r} must be a plain file name inside `directory`, not a path, and "
            f"not start with {PARTIAL_PREFIX!r}"
        )


def _format_filename(filename, epoch, logs):
    try:
        return filename.format(epoch=epoch + 1, **logs)
    except (KeyError, IndexError, ValueError) as error:
        raise ValueError(
            f"Rank0Checkpoint: cannot format filename={filename!r} with epoch and the logs {sorted(logs)}: {error!r}"
        ) from error


def _read_latest(directory):
    """(SavedCheckpoint of the newest intact checkpoint or None, names of the kept checkpoints).

    A latest checkpoint that is damaged (say a disk filled up while it was written, or it was
    truncated by a copy) gives way, with a warning, to the newest intact one the record keeps.
    """
    record_path = os.path.join(directory, STATE_FILENAME)
    record = _read_record(record_path)
    if record is None:
        return None, []
    latest = record["latest"]
    damaged = []
    for name in [latest] + [kept for kept in reversed(record["kept"]) if kept != latest]:
        path = os.path.join(directory, name)
        try:
            with zipfile.ZipFile(path) as archive:
                corrupt_entry = archive.testzip()  # reads every entry against its CRC
                if corrupt_entry is not None:
                    raise zipfile.BadZipFile(f"{corrupt_entry} fails its CRC check")
                metadata = json.loads(archive.read(METADATA_ENTRY))
            checkpoint = SavedCheckpoint(
                path, metadata["epoch"], metadata["monitor"], metadata["best"], metadata.get("batches_of_all_ranks", 0)
            )
        except FileNotFoundError:
            if name != latest:
                continue  # an older one deleted by hand: nothing to fall back to there
            raise FileNotFoundError(
                f"{record_path} names {path} as the latest checkpoint, but it is missing; "
                "put it back, or delete the record to start afresh"
            ) from None
        except (KeyError, TypeError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as error:
            damaged.append(f"{path} ({type(error).__name__}: {error})")
            continue
        if damaged:
            warnings.warn(
                f"Rank0Checkpoint: {' and '.join(damaged)} cannot be read as a checkpoint written by "
                f"Rank0Checkpoint; using the newest intact one, {path} (epoch {checkpoint.epoch})",
                stacklevel=3,
            )
        return checkpoint, record["kept"][: record["kept"].index(name) + 1] if name in record["kept"] else [name]
    raise OSError(
        f"no checkpoint recorded in {record_path} can be read: {'; '.join(damaged)}. Each must be a "
        "checkpoint written by Rank0Checkpoint; delete the record to start afresh"
    )


def _read_record(path):
    """The checkpoint record {"latest": name, "kept": [names]}, or None when there is none."""
    try:
        with open(path) as file:
            record = json.load(file)
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        record, reason = None, f"{type(error).__name__}: {error}"
    else:
        reason = "it lacks 'latest' or 'kept'"
    valid = (
        isinstance(record, dict)
        and isinstance(record.get("latest"), str)
        and isinstance(record.get("kept"), list)
        and all(isinstance(name, str) for name in record["kept"])
    )
    if not valid:
        raise ValueError(
            f"{path} is not a checkpoint record written by Rank0Checkpoint ({reason}); restore it, "
            "or delete it to start afresh"
        )
    return record


def _fsync_file(path):
    """Flushes a file, or a directory's entries, to the disk."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _write_atomically(path, text):
    with _partial_file_for(path) as partial:
        with open(partial, "w") as file:
            file.write(text)


@contextlib.contextmanager
def _partial_file_for(path):
    """A new file beside ``path`` to write it in, renamed over ``path`` (flushed to disk first)
    when the block ends without an error, and removed otherwise.

    It is created exclusively under a name nobody can guess, so a file or link that someone
    else put in the directory is never written through; it ends in ``path``'s suffix (Keras's
    save() wants ``.keras``), and gets the user's umask, as a file made with open() would.
    """
    directory, name = os.path.split(path)
    stem, suffix = os.path.splitext(name)
    handle, partial = tempfile.mkstemp(prefix=f"{PARTIAL_PREFIX}{stem}-", suffix=suffix, dir=directory)
    os.close(handle)
    try:
        yield partial
        os.chmod(partial, 0o666 & ~_umask())
        _fsync_file(partial)
        os.replace(partial, path)
        _fsync_file(directory)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


@contextlib.contextmanager
def _sigterm_held_back():
    """Acts on a SIGTERM that arrives in the block only once the block has ended.

    A scheduler ends a job (Slurm's scancel, a preemption or requeue) with SIGTERM to every
    process, and SIGKILL after a grace period (Slurm's KillWait, 30 s by default). Under Python's
    default action a SIGTERM in the middle of a save killed the root at once: the epoch's
    checkpoint was lost and its half-written temporary file left behind. Now the save ends first,
    then the SIGTERM has its usual effect (the process ends with status 143, or the program's own
    handler runs). Python runs signal handlers in the main thread only, and cannot put back a
    handler installed outside Python: there nothing changes.
    """
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return
    received = []
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if received:
            signal.raise_signal(signal.SIGTERM)


def _umask():
    """The process's umask, read without setting it: os.umask() can only set it, and setting and
    restoring it would race other threads that create files meanwhile."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
