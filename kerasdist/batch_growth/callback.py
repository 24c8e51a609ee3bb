"""The callback that grows the effective batch while training, from a `GrowthSignal`."""

import math
import warnings

import keras

from kerasdist import ops, runtime
from kerasdist.batch_growth.signals import named_signal
from kerasdist.learning_rate import (
    batch_multiple,
    check_scaling,
    current_learning_rate,
    scaling_factor,
    set_learning_rate,
)


class AdaptiveBatchGrowth(keras.callbacks.Callback):
    """Raises the effective batch when the loss landscape says a larger one pays off.

    The effective batch is `batch_size` (per rank) × ranks × k, where k is the wrapped
    `DistributedOptimizer`'s `backward_passes_per_step`. Growing multiplies k by
    `growth_factor`: each rank accumulates more micro-batches per update, so optimizer steps
    per epoch drop by that factor while the data pipeline stays as it is. The learning rate is
    rescaled by the factor ("linear"), its square root ("sqrt") or not at all ("none").

    Signals, checked every `check_every_epochs` epochs at epoch end:

    - "curvature" (Yao et al. 2018, ABS; `CurvatureSignal`): the top Hessian eigenvalue λ of
      the loss on `curvature_data`, by power iteration (`HessianPowerIteration`, each rank on
      its own sample, products averaged). The first value is the reference λ_ref; when
      λ ≤ λ_ref / 2 the batch grows and λ_ref ← λ.
    - "noise_scale" (McCandlish et al. 2018; `NoiseScaleSignal`): B_noise from the optimizer's
      `gradient_statistics()`, a `kerasdist.GradientNoiseScale` fed by every update (attached
      automatically if it has none). The batch grows while the grown batch stays at or below
      B_noise, the critical batch size.

    After `max_epochs_without_growth` checks without growth it grows anyway; it never exceeds
    `max_batch_size`. Every rank computes the signal from allreduced values; the decision is
    then taken from rank 0 so that ranks agree even if a reduction rounded differently.
    Each check writes `batch_size` (effective, used in the epoch that ended), `learning_rate`
    and `hessian_top_eigenvalue` or `noise_scale` into the epoch logs (so `CSVLogger` and
    `TensorBoard` record them) and appends a record to `history`.

    k changes through `DistributedOptimizer.set_backward_passes_per_step`: raising it from 1
    creates the optimizer's accumulators and rebuilds the model's train function (one
    retrace). Build the optimizer with `backward_passes_per_step >= 2`, or accept that one
    retrace.

    Args:
        signal: "noise_scale" (default) or "curvature".
        batch_size: the per-rank batch size of `fit` (required: Keras does not tell callbacks).
        growth_factor: integer ≥ 2 by which the batch grows. Defaults to 2.
        max_batch_size: cap on the effective batch; None for no cap.
        lr_scaling: "linear" (default), "sqrt" or "none".
        check_every_epochs: epochs between checks. Defaults to 1.
        max_epochs_without_growth: grow anyway after this many checks without growth; None to
            rely on the signal alone.
        curvature_data: `(x, y)` sample of this rank's data for the curvature signal.
        loss_fn: loss for the curvature signal; defaults to the compiled loss.
        hessian_iterations, hessian_tolerance: power-iteration budget.
        verbose: print each decision on rank 0.

    Example:

    ```python
    import keras, kerasdist, numpy as np
    kerasdist.init()
    x = np.random.default_rng(kerasdist.rank()).normal(size=(256, 8)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.01), backward_passes_per_step=2),
                  loss="mse")
    # Always grow after a check without growth, so the example shows one growth step.
    growth = kerasdist.callbacks.AdaptiveBatchGrowth(batch_size=16, max_epochs_without_growth=0,
                                                     max_batch_size=64 * kerasdist.size())
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=kerasdist.callbacks(extra=[growth]))
    print([record["grew"] for record in growth.history])  # [True, False]
    # 16 per rank x ranks x k, where k grew from 2 to 4
    print(growth.history[-1]["batch_size"] == 64 * kerasdist.size())  # True
    print(model.optimizer.backward_passes_per_step)  # 4
    ```
    """

    def __init__(
        self,
        signal="noise_scale",
        batch_size=None,
        growth_factor=2,
        max_batch_size=None,
        lr_scaling="linear",
        check_every_epochs=1,
        max_epochs_without_growth=None,
        curvature_data=None,
        loss_fn=None,
        hessian_iterations=10,
        hessian_tolerance=1e-2,
        verbose=0,
    ):
        super().__init__()
        self._growth_signal = named_signal(signal, curvature_data, loss_fn, hessian_iterations, hessian_tolerance)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: give the per-rank batch size of fit (an int >= 1)")
        if not isinstance(growth_factor, int) or growth_factor < 2:
            raise ValueError(f"growth_factor={growth_factor!r} must be an integer >= 2")
        check_scaling(lr_scaling, "lr_scaling")
        if check_every_epochs < 1:
            raise ValueError(f"check_every_epochs={check_every_epochs!r} must be >= 1")
        self.signal = signal
        self.batch_size = batch_size
        self.growth_factor = growth_factor
        self.max_batch_size = max_batch_size
        self.lr_scaling = lr_scaling
        self.check_every_epochs = check_every_epochs
        self.max_epochs_without_growth = max_epochs_without_growth
        self.verbose = verbose
        self.history = []
        self._checks_without_growth = 0

    def _optimizer(self):
        optimizer = getattr(self.model, "optimizer", None)
        if not hasattr(optimizer, "set_backward_passes_per_step"):
            raise ValueError(
                "AdaptiveBatchGrowth grows backward_passes_per_step of a kerasdist.DistributedOptimizer; "
                f"the model's optimizer is {type(optimizer).__name__}"
            )
        return optimizer

    def set_model(self, model):
        super().set_model(model)
        self._optimizer()  # refuse a model it cannot grow before training starts
        self._growth_signal.set_model(model, self.batch_size)

    def on_train_begin(self, logs=None):
        one_batch_size = runtime.size() * self._optimizer().backward_passes_per_step == 1
        if self.signal != "noise_scale" or not one_batch_size:
            return
        # B_noise compares each micro-batch's gradient with the averaged one: one rank without
        # accumulation has a single batch size, so the estimate stays nan until the batch grows.
        why = (
            "signal='noise_scale' needs two batch sizes (ranks x backward_passes_per_step >= 2), and one "
            "process with backward_passes_per_step=1 has one, so B_noise is nan"
        )
        if self.max_epochs_without_growth is None:
            raise ValueError(
                f"AdaptiveBatchGrowth: {why} and the batch would never grow. Start the optimizer with "
                "backward_passes_per_step=2, run on 2 or more ranks, set max_epochs_without_growth, or "
                "use signal='curvature'"
            )
        warnings.warn(
            f"AdaptiveBatchGrowth: {why} until max_epochs_without_growth={self.max_epochs_without_growth} "
            "grows the batch",
            stacklevel=2,
        )

    def effective_batch_size(self):
        """Per-rank batch × ranks × accumulated micro-batches: the examples one update averages.

        The ranks are the planned ones (`kerasdist.planned_size()`), so the effective batch stays
        the same when a job restarts on fewer ranks that accumulate for the missing ones.

        Example:

        ```python
        import keras, numpy as np, kerasdist

        kerasdist.init()
        x = np.random.default_rng(kerasdist.rank()).normal(size=(64, 4)).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.01), backward_passes_per_step=2),
                      loss="mse")
        # Grow at every check, to show a growth.
        growth = kerasdist.callbacks.AdaptiveBatchGrowth(batch_size=16, max_epochs_without_growth=0)
        growth.set_model(model)  # fit does this too
        print(growth.effective_batch_size() // kerasdist.planned_size())  # 32
        model.fit(x, y, batch_size=16, verbose=0, callbacks=kerasdist.callbacks(extra=[growth]))
        print(growth.effective_batch_size() // kerasdist.planned_size())  # 64
        ```
        """
        return self.batch_size * batch_multiple(self._optimizer().backward_passes_per_step)

    def on_epoch_end(self, epoch, logs=None):
        if (epoch + 1) % self.check_every_epochs:
            return
        optimizer = self._optimizer()
        batch = self.effective_batch_size()
        grown_batch = batch * self.growth_factor
        value = self._growth_signal.measure()
        wants = math.isfinite(value) and self._growth_signal.wants_more_batch(value, grown_batch)
        overdue = (
            self.max_epochs_without_growth is not None
            and self._checks_without_growth + 1 >= self.max_epochs_without_growth
        )
        capped = self.max_batch_size is not None and grown_batch > self.max_batch_size
        grow = ops.broadcast_object((wants or overdue) and not capped, root_rank=0)
        learning_rate = current_learning_rate(optimizer)
        log_key = self._growth_signal.log_key
        self.history.append(
            {"epoch": epoch, "batch_size": batch, "learning_rate": learning_rate, log_key: value, "grew": grow}
        )
        if logs is not None:
            logs.update({"batch_size": batch, "learning_rate": learning_rate, log_key: value})
        if grow:
            optimizer.set_backward_passes_per_step(
                optimizer.backward_passes_per_step * self.growth_factor, model=self.model
            )
            set_learning_rate(optimizer, learning_rate * scaling_factor(self.growth_factor, self.lr_scaling))
            self._growth_signal.batch_grew(value)
            self._checks_without_growth = 0
        else:
            self._checks_without_growth += 1
        if self.verbose and runtime.state().rank == 0:
            outcome = f"grew to {self.effective_batch_size()}" if grow else "kept"
            print(f"AdaptiveBatchGrowth: epoch {epoch + 1}: {log_key}={value:.4g}, batch {batch} {outcome}")
