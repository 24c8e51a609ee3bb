"""Horovod 0.28's Keras callbacks, with Horovod's arguments and meaning, on kerasdist.

The learning-rate callbacks differ from kerasdist's own in what their rate means:
`LearningRateWarmupCallback(initial_lr)` takes the rate warmup ENDS at (the script has already
multiplied it by `hvd.size()`), starts at `initial_lr / size` and reaches `initial_lr` after
`warmup_epochs`; `LearningRateScheduleCallback(initial_lr, multiplier)` sets
`initial_lr * multiplier(epoch)`, and a constant multiplier m means `m ** (epoch - start_epoch)`.
"""

import math

import keras
import numpy as np

from kerasdist import ops, runtime
from kerasdist.callbacks.broadcast import BroadcastGlobalState
from kerasdist.learning_rate import current_learning_rate, set_learning_rate


class BroadcastGlobalVariablesCallback(BroadcastGlobalState):
    """Every rank starts from `root_rank`'s model and optimizer variables.

    Horovod broadcasts after the first batch; kerasdist broadcasts before it, so the first
    update already starts from the root's weights. The weights after it are the same.
    `local_variables` (variables each rank keeps) are not offered.

    Example:

    ```python
    import keras
    import numpy as np
    import kerasdist
    import kerasdist.horovod.tensorflow.keras as hvd

    hvd.init()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])  # weights differ per rank
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = np.ones((8, 3)), np.full((8, 1), float(hvd.rank()))  # each rank its own targets
    model.fit(x, y, batch_size=4, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)], verbose=0)
    kernel = model.layers[0].kernel.numpy()
    print(all((other == kernel).all() for other in kerasdist.allgather_object(kernel)))  # True
    ```
    """

    def __init__(self, root_rank, device="", local_variables=None):
        if local_variables:
            raise NotImplementedError(
                "kerasdist does not offer BroadcastGlobalVariablesCallback(local_variables=): every "
                "model and optimizer variable is broadcast (dropout seed states stay per rank)"
            )
        super().__init__(root_rank)


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces each epoch-end metric in `logs` by its average over ranks, as Horovod does.

    This averages per-rank averages: exact when shards are the same size. `evaluate()` is not
    touched, so a rank may evaluate alone. kerasdist's `MetricAverage` computes exact global
    metrics instead (and makes `evaluate()` a collective).

    Example:

    ```python
    import keras
    import numpy as np
    import kerasdist
    import kerasdist.horovod.tensorflow.keras as hvd

    hvd.init()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])  # weights differ per rank
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = np.ones((8, 3)), np.full((8, 1), float(hvd.rank()))  # each rank its own targets
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
    history = model.fit(x, y, batch_size=4, callbacks=callbacks, verbose=0)
    # Each rank's loss differs (its own targets); the one reported is their average, alike on every rank.
    print(len(set(kerasdist.allgather_object(history.history["loss"][-1]))))  # 1
    ```
    """

    def __init__(self, device=""):
        super().__init__()

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or runtime.size() == 1:
            return
        names = sorted(logs)  # every rank reduces the same metrics in the same order
        means = ops.grouped_allreduce(
            [np.asarray(logs[name], np.float64) for name in names], op=ops.Average, name=f"MetricAverage.{epoch}"
        )
        for name, mean in zip(names, means):
            logs[name] = float(mean)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the rate to `initial_lr * multiplier(epoch)` for epochs in `[start_epoch, end_epoch)`.

    Args:
        initial_lr: the rate the multiplier applies to (required, as in Horovod).
        multiplier: a function of the epoch, or a constant m meaning `m ** (epoch - start_epoch)`.
        start_epoch, end_epoch: the epochs it applies to (`end_epoch=None`: no end).
        staircase: True (default): set at each epoch's first batch, with the integer epoch;
            False: before every batch, with the fractional epoch `epoch + batch / steps_per_epoch`.
        momentum_correction: rescale SGD's velocity by new rate / old rate when the rate changes.
        steps_per_epoch: defaults to what `fit` knows.

    Example:

    ```python
    import keras
    import numpy as np
    import kerasdist
    import kerasdist.horovod.tensorflow.keras as hvd

    hvd.init()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])  # weights differ per rank
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = np.ones((8, 3)), np.full((8, 1), float(hvd.rank()))  # each rank its own targets
    schedule = hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.5, start_epoch=1)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), schedule]
    model.fit(x, y, batch_size=4, epochs=3, callbacks=callbacks, verbose=0)
    print(round(float(model.optimizer.learning_rate), 6))  # 0.05
    ```
    """

    def __init__(
        self,
        initial_lr,
        multiplier,
        start_epoch=0,
        end_epoch=None,
        staircase=True,
        momentum_correction=True,
        steps_per_epoch=None,
    ):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self._epoch = 0

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError(
                    f"Could not autodetect the number of steps per epoch. Please specify the "
                    f"steps_per_epoch parameter to the {type(self).__name__}()."
                )

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self._epoch < self.start_epoch or (self.end_epoch is not None and self._epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._set(self._epoch)
        else:
            self._set(self._epoch + batch / self.steps_per_epoch)

    def _set(self, epoch):
        set_learning_rate(self.model.optimizer, self.initial_lr * self.multiplier(epoch), self.momentum_correction)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = current_learning_rate(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the rate, per batch, from `initial_lr / size` to `initial_lr` over `warmup_epochs`.

    `initial_lr` is the rate after warmup, already scaled by the script (`0.01 * hvd.size()`).
    At batch b of epoch e < warmup_epochs the rate is

        initial_lr / size * (1 + (e + (b + 1) / steps_per_epoch) * (size - 1) / warmup_epochs)

    so the last batch of warmup runs at exactly `initial_lr`; afterwards the rate is left alone.

    Example:

    ```python
    import keras
    import numpy as np
    import kerasdist
    import kerasdist.horovod.tensorflow.keras as hvd

    hvd.init()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])  # weights differ per rank
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = np.ones((8, 3)), np.full((8, 1), float(hvd.rank()))  # each rank its own targets
    warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.01 * hvd.size(), warmup_epochs=2)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), warmup]
    model.fit(x, y, batch_size=4, epochs=2, callbacks=callbacks, verbose=0)
    print(round(float(model.optimizer.learning_rate), 6) == round(0.01 * hvd.size(), 6))  # True
    ```
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            ranks = runtime.size()
            return (1 + (epoch + 1 / self.steps_per_epoch) * (ranks - 1) / warmup_epochs) / ranks

        super().__init__(
            initial_lr,
            multiplier,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if self.verbose and epoch == math.ceil(self.warmup_epochs) - 1 and runtime.rank() == 0:
            rate = current_learning_rate(self.model.optimizer)
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {rate:g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Saves the model whenever `monitor` improves, on rank 0 only.

    Horovod's was given its file by its Spark estimator; here pass `filepath=` (a `.keras` or,
    with `save_weights_only`, a `.weights.h5` path).

    Example:

    ```python
    import keras
    import numpy as np
    import kerasdist
    import kerasdist.horovod.tensorflow.keras as hvd

    hvd.init()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])  # weights differ per rank
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = np.ones((8, 3)), np.full((8, 1), float(hvd.rank()))  # each rank its own targets
    import os

    checkpoint = hvd.callbacks.BestModelCheckpoint(filepath="best.keras", monitor="loss")
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), checkpoint]
    model.fit(x, y, batch_size=4, epochs=2, callbacks=callbacks, verbose=0)
    kerasdist.barrier()
    print(os.path.exists("best.keras"))  # True
    ```
    """

    def __init__(
        self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto", save_freq="epoch", *, filepath=None
    ):
        if filepath is None:
            raise ValueError("BestModelCheckpoint needs filepath=: where to save the best model")
        super().__init__(
            filepath,
            monitor=monitor,
            verbose=verbose,
            save_best_only=True,
            save_weights_only=save_weights_only,
            mode=mode,
            save_freq=save_freq,
        )

    def on_train_batch_end(self, batch, logs=None):
        if runtime.rank() == 0:
            super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if runtime.rank() == 0:
            super().on_epoch_end(epoch, logs)
