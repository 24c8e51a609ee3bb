"""Every rank stops `fit` where any rank stops it, or where any rank was given notice to leave."""

import socket
import sys

import keras
import tensorflow as tf

from kerasdist import _compat, coordination, knobs, notice, ops, runtime
from kerasdist.notice import notice_state

# Keras reads `stop_training` after each batch's callbacks. A flag set in a batch hook needs an
# agreement at every batch; one set in these hooks is agreed once, at the start of each epoch.
_BATCH_HOOKS = ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end")
_HOOKS_BEFORE_AN_EPOCH = ("on_train_begin", "on_epoch_begin")
# Callbacks known not to stop training at a batch: Keras's loggers and savers, and those that stop
# or adjust only at an epoch end (exact types: a subclass may do more). kerasdist's own never stop.
_NEVER_STOP_AT_A_BATCH = (
    keras.callbacks.History,
    keras.callbacks.ProgbarLogger,
    keras.callbacks.TensorBoard,
    keras.callbacks.CSVLogger,
    keras.callbacks.ModelCheckpoint,
    keras.callbacks.BackupAndRestore,
    keras.callbacks.EarlyStopping,
    keras.callbacks.ReduceLROnPlateau,
    keras.callbacks.LearningRateScheduler,
)


def _may_stop_in(callback, hooks):
    if type(callback) in _NEVER_STOP_AT_A_BATCH or type(callback).__module__.startswith("kerasdist."):
        return False
    return any(_overrides(callback, hook) for hook in hooks)


def _overrides(callback, hook):
    """Whether `callback` has its own `hook`: from its class, or set on the instance, as
    `keras.callbacks.LambdaCallback` sets the functions it is given."""
    method = getattr(callback, hook)
    return getattr(method, "__func__", method) is not getattr(keras.callbacks.Callback, hook)


class StopAgreement(keras.callbacks.Callback):
    """Makes `model.stop_training` the same on every rank at each point Keras reads it.

    Keras checks `model.stop_training` after `on_train_batch_end` and after `on_epoch_end`.
    A callback that sets it on one rank only (`TerminateOnNaN` when one rank's batch has a NaN,
    `EarlyStopping` on per-rank logs, a callback of your own) would end that rank's loop while
    the others run the next step and wait in its gradient allreduce for good. At those points
    this callback sums every rank's flag in one scalar allreduce and sets `stop_training` on
    every rank if any rank set it, so all ranks end `fit` at the same batch of the same epoch.

    The per-batch allreduce runs only when a callback of the `fit` (on any rank) could stop at a
    batch: one that overrides a batch hook and is not one of Keras's loggers and savers,
    `EarlyStopping` (it stops at epoch ends), `ReduceLROnPlateau`, `LearningRateScheduler`, or
    kerasdist's own. A stop set in `on_train_begin` or `on_epoch_begin` (a timer or logger often
    overrides those) is agreed once at the start of each epoch instead, before its first batch.
    Epoch ends are always agreed on.

    It must come after every callback that may stop training: `kerasdist.callbacks()` puts it
    last, after the callbacks given as `extra`; callbacks listed before `kerasdist.callbacks()`
    run before it too.

    **Leaving on notice.** From `init()` on, the signal `KERASDIST_NOTICE_SIGNAL` names (SIGUSR1
    unless set; `scancel --signal=USR1`, a spot instance's preemption agent, or `kerasdist-run`
    passing on the one it got) gives the rank that receives it notice to leave. The gradients'
    own allreduce carries it to every rank (one number more in its last bucket), or the
    per-batch allreduce above when it runs; when the model's optimizer is not a
    `DistributedOptimizer` with the default reduction, that one runs at every batch. So every
    rank sees the notice at the same batch end and stops there, at the first one that ends an
    update (not inside a `backward_passes_per_step` window). `Rank0Checkpoint` then saves that
    step, each noticed rank prints `kerasdist: notice received on rank R, host H` on stderr, and
    `fit` ends the process with status 75 (`SystemExit`), which `kerasdist-run` restarts without
    counting it as a failure (under `--min-np`, without host H). A notice that comes outside `fit` is said on
    stderr at once and taken at the next `fit`'s first update; a loop of one's own asks
    `kerasdist.notice_received()`.

    Example:

    ```python
    import keras, kerasdist, numpy as np
    kerasdist.init()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    history = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=2, verbose=0,
                        callbacks=kerasdist.callbacks(extra=[keras.callbacks.TerminateOnNaN()]))
    ```
    """

    def __init__(self):
        super().__init__()
        self._every_batch = True
        self._at_epoch_begin = True
        self._notice_taken = False  # every rank agreed to stop on a notice
        self._notice_flags = None  # the optimizer's, when notices ride in its gradients' allreduce
        self._epoch = 0

    def set_model(self, model):
        super().set_model(model)
        callbacks = _compat.callbacks_setting_the_model()  # None: not known, so every batch is agreed on
        self._every_batch = callbacks is None or any(_may_stop_in(callback, _BATCH_HOOKS) for callback in callbacks)
        self._at_epoch_begin = not self._every_batch and any(
            _may_stop_in(callback, _HOOKS_BEFORE_AN_EPOCH) for callback in callbacks
        )

    def on_train_begin(self, logs=None):
        self._notice_taken = False
        notice_state.taken_at, notice_state.saved = None, False
        self._notice_flags = None
        if notice.install(runtime.state().knobs.notice_signal, runtime.state().rank):
            notice_state.in_fit = True
            self._notice_flags = getattr(self.model.optimizer, "_notice_flags", None)
            if self._notice_flags is None:
                self._every_batch = True  # a notice is taken at a batch end: ask every batch
            else:
                self._notice_flags.here.assign(1.0 if notice_state.received else 0.0)
                self._notice_flags.agreed.assign(0.0)
        if runtime.state().size > 1:
            # Ranks may hold different callbacks (loggers on rank 0): all agree per batch if any must.
            self._every_batch = coordination.any_rank(self._every_batch, "kerasdist.stop_agreement_per_batch")
            self._at_epoch_begin = not self._every_batch and coordination.any_rank(
                self._at_epoch_begin, "kerasdist.stop_agreement_at_epoch_begin"
            )

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self._at_epoch_begin:
            self._agree()

    def on_train_batch_end(self, batch, logs=None):
        if self._every_batch:
            stop, noticed = self._stop_or_notice_on_any_rank()
            if stop:
                self.model.stop_training = True
        elif runtime.state().size == 1:
            # No rank to agree with; reading the flags' variable would cost an eager op per batch.
            noticed = notice_state.received
        elif self._notice_flags is not None:
            noticed = float(self._notice_flags.agreed.numpy()) > 0
            if notice_state.received:
                self._notice_flags.here.assign(1.0)  # the next update tells every rank
        else:
            return
        if noticed and not self._notice_taken and _at_an_update_boundary(self.model):
            self.model.stop_training = True
            self._notice_taken = True
            notice_state.taken_at = (self._epoch, batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        self._agree()

    def on_train_end(self, logs=None):
        notice_state.in_fit = False
        if not self._notice_taken:
            return
        world = runtime.state()
        noticed_here, notice_state.received = notice_state.received, False
        if noticed_here:
            print(knobs.NOTICE_LINE.format(rank=world.rank, host=socket.gethostname()), file=sys.stderr, flush=True)
        epoch, batches = notice_state.taken_at
        saved = "; Rank0Checkpoint saved this step" if notice_state.saved else "; no Rank0Checkpoint saved it"
        if world.rank == 0 or noticed_here:
            print(
                f"kerasdist: rank {world.rank}: every rank stopped on notice after batch {batches} of epoch "
                f"{epoch + 1}{saved}; exiting with status {knobs.NOTICE_EXIT_STATUS}",
                file=sys.stderr,
                flush=True,
            )
        raise SystemExit(knobs.NOTICE_EXIT_STATUS)

    def _stop_or_notice_on_any_rank(self):
        flags = [1.0 if self.model.stop_training else 0.0, 1.0 if notice_state.received else 0.0]
        if runtime.state().size > 1:
            # Sum, not Max: a rank that has joined (uneven steps) can still take part in a Sum.
            flags = ops.allreduce(tf.constant(flags), op=ops.Sum, name="kerasdist.stop_or_notice").numpy()
        return flags[0] > 0, flags[1] > 0

    def _agree(self):
        if runtime.state().size > 1 and coordination.any_rank(self.model.stop_training, "kerasdist.stop_training"):
            self.model.stop_training = True


def _at_an_update_boundary(model):
    """True when no accumulation window is open: every rank's (they advance together) last
    micro-batch ended an update, so stopping here loses no partial sum."""
    micro_step = getattr(model.optimizer, "_micro_step", None)  # DistributedOptimizer's window position
    return micro_step is None or int(micro_step.numpy()) == 0
