"""Every rank stops `fit` where any rank stops it."""

import keras
import tensorflow as tf

from kerasdist import ops, runtime


class StopAgreement(keras.callbacks.Callback):
    """Makes `model.stop_training` the same on every rank at each point Keras reads it.

    Keras checks `model.stop_training` after `on_train_batch_end` and after `on_epoch_end`.
    A callback that sets it on one rank only (`TerminateOnNaN` when one rank's batch has a NaN,
    `EarlyStopping` on per-rank logs, a callback of your own) would end that rank's loop while
    the others run the next step and wait in its gradient allreduce for good. At both points
    this callback sums every rank's flag in one scalar allreduce and sets `stop_training` on
    every rank if any rank set it, so all ranks end `fit` at the same batch of the same epoch.

    It must come after every callback that may stop training: `kerasdist.callbacks()` puts it
    last, after the callbacks given as `extra`; callbacks listed before `kerasdist.callbacks()`
    run before it too. The sum is an allreduce per batch (a rank that joined with `Join` takes
    part with zeros).

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

    def on_train_batch_end(self, batch, logs=None):
        self._agree()

    def on_epoch_end(self, epoch, logs=None):
        self._agree()

    def _agree(self):
        if runtime.state().size == 1:
            return
        # Sum, not Max: a rank that has joined (uneven steps) can still take part in a Sum.
        local = tf.constant(1.0 if self.model.stop_training else 0.0)
        if ops.allreduce(local, op=ops.Sum, name="kerasdist.stop_training").numpy() > 0:
            self.model.stop_training = True
