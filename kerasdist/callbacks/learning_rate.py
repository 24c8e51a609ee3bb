"""Learning-rate warmup and schedules for large global batches (Goyal et al. 2017)."""

import math
import numbers

import keras

from kerasdist import runtime
from kerasdist.learning_rate import batch_scale, check_scaling, current_learning_rate, set_learning_rate


class _LearningRateCallback(keras.callbacks.Callback):
    """Sets the learning rate from `initial_lr`, the rate the script asked for on one worker."""

    def __init__(self, initial_lr, scaling, steps_per_epoch, momentum_correction, verbose):
        super().__init__()
        check_scaling(scaling)
        self.initial_lr = initial_lr
        self.scaling = scaling
        self.steps_per_epoch = steps_per_epoch
        self.momentum_correction = momentum_correction
        self.verbose = verbose
        self._epoch = 0

    def set_model(self, model):
        super().set_model(model)
        # Read before a checkpoint restore can overwrite the rate, and only once: a second fit
        # of the same model must not start from the scaled rate.
        if self.initial_lr is None and getattr(model, "optimizer", None) is not None:
            self.initial_lr = current_learning_rate(model.optimizer)

    def on_train_begin(self, logs=None):
        if self.initial_lr is None:
            self.initial_lr = current_learning_rate(self.model.optimizer)
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self.params.get("steps")
        if not self.steps_per_epoch and self._needs_steps_per_epoch():
            raise ValueError(
                f"{type(self).__name__} needs the number of steps per epoch: pass "
                "steps_per_epoch= to it (the dataset's length is unknown)"
            )

    def _needs_steps_per_epoch(self):
        return True

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = current_learning_rate(self.model.optimizer)

    def scaled_lr(self):
        """The single-worker rate times the batch scale (`scaling`)."""
        return self.initial_lr * batch_scale(self.model.optimizer, self.scaling)

    def _set_lr(self, new_lr):
        set_learning_rate(self.model.optimizer, new_lr, self.momentum_correction)
        if self.verbose and runtime.state().rank == 0:
            print(f"{type(self).__name__}: epoch {self._epoch}: learning rate {new_lr:.6g}")


class LearningRateWarmup(_LearningRateCallback):
    """Ramps the learning rate, per batch, from the single-worker rate to the scaled rate.

    Large global batches want a proportionally larger rate (the linear scaling rule), but
    starting there diverges; Goyal et al. ramp up over the first epochs. With `initial_lr` η,
    batch scale k (planned ranks × `backward_passes_per_step`, or its square root for
    `scaling="sqrt"`), `W = warmup_epochs` and `S` steps per epoch, the step at batch `b` of
    epoch `e < W` runs at

        η · (1 + (k − 1) · (e·S + b) / (W·S))

    so the first step uses η and the first step after warmup uses η·k, which stays in place
    afterwards (a later schedule or callback takes over from there). With momentum correction
    (default) the velocity of SGD-like optimizers is rescaled whenever the rate changes.

    Args:
        warmup_epochs: length of the ramp, in epochs (may be fractional). Defaults to 5.
        scaling: "linear" (default), "sqrt" or "none".
        initial_lr: the single-worker rate; defaults to the optimizer's rate when the callback
            is first attached to the model, i.e. what the script configured.
        steps_per_epoch: defaults to what `fit` knows.
        momentum_correction: whether to rescale the velocity. Defaults to True.
        verbose: print the rate at the end of warmup (rank 0).

    Example:

    ```python
    import keras, kerasdist, numpy as np
    kerasdist.init()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    warmup = kerasdist.callbacks.LearningRateWarmup(warmup_epochs=1)
    history = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=2, epochs=2,
                        callbacks=[warmup], verbose=0)
    print(round(history.history["learning_rate"][-1], 6) == round(0.01 * kerasdist.planned_size(), 6))  # True
    ```
    """

    def __init__(
        self,
        warmup_epochs=5,
        scaling="linear",
        initial_lr=None,
        steps_per_epoch=None,
        momentum_correction=True,
        verbose=0,
    ):
        super().__init__(initial_lr, scaling, steps_per_epoch, momentum_correction, verbose)
        if isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, numbers.Real):
            raise TypeError(
                f"warmup_epochs={warmup_epochs!r} must be a number of epochs (fractions allowed), "
                f"not a {type(warmup_epochs).__name__}"
            )
        if not (math.isfinite(warmup_epochs) and warmup_epochs > 0):
            raise ValueError(f"warmup_epochs={warmup_epochs!r} must be a finite number of epochs > 0")
        self.warmup_epochs = warmup_epochs

    def rate_at(self, epoch, batch):
        """The rate for the step at `batch` of `epoch` (the formula in the class docstring).

        Example:

        Halfway through the ramp, the rate is halfway between η and η·k.

        ```python
        import keras, kerasdist
        kerasdist.init()
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
        warmup = kerasdist.callbacks.LearningRateWarmup(warmup_epochs=2, initial_lr=0.01, steps_per_epoch=10)
        warmup.set_model(model)
        k = kerasdist.planned_size()
        print(round(warmup.rate_at(0, 0), 6))  # 0.01
        print(round(warmup.rate_at(1, 0), 6) == round(0.01 * (1 + k) / 2, 6))  # True
        print(round(warmup.rate_at(2, 0), 6) == round(0.01 * k, 6))  # True
        ```
        """
        progress = min(1.0, (epoch * self.steps_per_epoch + batch) / (self.warmup_epochs * self.steps_per_epoch))
        return self.initial_lr * (1.0 + (batch_scale(self.model.optimizer, self.scaling) - 1.0) * progress)

    def on_train_batch_begin(self, batch, logs=None):
        # Up to and including the first step whose progress reaches 1, so the scaled rate is set
        # even when warmup_epochs × steps per epoch is not a whole number of steps.
        if self._epoch * self.steps_per_epoch + batch <= math.ceil(self.warmup_epochs * self.steps_per_epoch):
            self._set_lr(self.rate_at(self._epoch, batch))


class LearningRateMultiplier(_LearningRateCallback):
    """Sets the rate to `initial_lr` × batch scale × `multiplier(epoch)` within an epoch range.

    Also importable under its earlier name, `LearningRateSchedule`, which it no longer goes by
    because `keras.optimizers.schedules.LearningRateSchedule` is a different thing: a rate that is
    a function of the step, given to the optimizer instead of a callback.

    The batch scale is as in `LearningRateWarmup` (planned ranks × `backward_passes_per_step`, by
    `scaling`), so a schedule written for one worker continues where the warmup ends. Outside
    `[start_epoch, end_epoch)` the rate is left alone.

    Args:
        multiplier: a number, or a function of the epoch returning one. With
            `staircase=True` (default) it is called with the integer epoch at each epoch start;
            otherwise with the fractional epoch `e + b/S` before every batch.
        start_epoch: first epoch the schedule applies to. Defaults to 0.
        end_epoch: first epoch it no longer applies to; None for no end.
        staircase, initial_lr, scaling, steps_per_epoch, momentum_correction, verbose: as above.

    Example:

    The classic ImageNet schedule after 5 epochs of warmup.

    ```python
    import kerasdist
    callbacks = [
        kerasdist.callbacks.LearningRateWarmup(warmup_epochs=5),
        kerasdist.callbacks.LearningRateMultiplier(1.0, start_epoch=5, end_epoch=30),
        kerasdist.callbacks.LearningRateMultiplier(0.1, start_epoch=30, end_epoch=60),
        kerasdist.callbacks.LearningRateMultiplier(0.01, start_epoch=60),
    ]
    ```
    """

    def __init__(
        self,
        multiplier,
        start_epoch=0,
        end_epoch=None,
        staircase=True,
        initial_lr=None,
        scaling="linear",
        steps_per_epoch=None,
        momentum_correction=True,
        verbose=0,
    ):
        super().__init__(initial_lr, scaling, steps_per_epoch, momentum_correction, verbose)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase

    def _applies(self, epoch):
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _needs_steps_per_epoch(self):
        return not self.staircase

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        if self.staircase and self._applies(epoch):
            self._set_lr(self.scaled_lr() * self.multiplier(epoch))

    def on_train_batch_begin(self, batch, logs=None):
        if not self.staircase and self._applies(self._epoch):
            self._set_lr(self.scaled_lr() * self.multiplier(self._epoch + batch / self.steps_per_epoch))


LearningRateSchedule = LearningRateMultiplier  # the earlier name, kept for scripts that use it
