"""Every rank stops `fit` where any rank stops it."""

import keras
import tensorflow as tf

from kerasdist import _compat, ops, runtime

# Hooks that run before Keras's per-batch check of `stop_training`: a callback that overrides one
# of them may stop training at a batch, not only at an epoch end.
_HOOKS_BEFORE_A_BATCH_CHECK = (
    "on_train_begin",
    "on_epoch_begin",
    "on_batch_begin",
    "on_batch_end",
    "on_train_batch_begin",
    "on_train_batch_end",
)
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


def _may_stop_at_a_batch(callback):
    if type(callback) in _NEVER_STOP_AT_A_BATCH or type(callback).__module__.startswith("kerasdist."):
        return False
    return any(
        getattr(type(callback), hook) is not getattr(keras.callbacks.Callback, hook)
        for hook in _HOOKS_BEFORE_A_BATCH_CHECK
    )


class StopAgreement(keras.callbacks.Callback):
    """Makes `model.stop_training` the same on every rank at each point Keras reads it.

    Keras checks `model.stop_training` after `on_train_batch_end` and after `on_epoch_end`.
    A callback that sets it on one rank only (`TerminateOnNaN` when one rank's batch has a NaN,
    `EarlyStopping` on per-rank logs, a callback of your own) would end that rank's loop while
    the others run the next step and wait in its gradient allreduce for good. At those points
    this callback sums every rank's flag in one scalar allreduce and sets `stop_training` on
    every rank if any rank set it, so all ranks end `fit` at the same batch of the same epoch.

    The per-batch allreduce runs only when a callback of the `fit` (on any rank) could stop at a
    batch: one that overrides a batch hook, `on_epoch_begin` or `on_train_begin` and is not one
    of Keras's loggers and savers, `EarlyStopping` (it stops at epoch ends), `ReduceLROnPlateau`,
    `LearningRateScheduler`, or kerasdist's own. Otherwise only epoch ends are agreed on.

    It must come after every callback that may stop training: `kerasdist.callbacks()` puts it
    last, after the callbacks given as `extra`; callbacks listed before `kerasdist.callbacks()`
    run before it too.

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

    def set_model(self, model):
        super().set_model(model)
        callbacks = _compat.callbacks_setting_the_model()  # None: not known, so every batch is agreed on
        self._every_batch = callbacks is None or any(_may_stop_at_a_batch(callback) for callback in callbacks)

    def on_train_begin(self, logs=None):
        if runtime.state().size > 1:
            # Ranks may hold different callbacks (loggers on rank 0): all agree per batch if any must.
            self._every_batch = self._any_rank(self._every_batch, "kerasdist.stop_agreement_per_batch")

    def on_train_batch_end(self, batch, logs=None):
        if self._every_batch:
            self._agree()

    def on_epoch_end(self, epoch, logs=None):
        self._agree()

    def _agree(self):
        if runtime.state().size > 1 and self._any_rank(self.model.stop_training, "kerasdist.stop_training"):
            self.model.stop_training = True

    @staticmethod
    def _any_rank(flag, name):
        # Sum, not Max: a rank that has joined (uneven steps) can still take part in a Sum.
        return ops.allreduce(tf.constant(1.0 if flag else 0.0), op=ops.Sum, name=name).numpy() > 0
