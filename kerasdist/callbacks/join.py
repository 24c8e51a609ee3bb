"""`fit` with a different number of steps per epoch on each rank."""

import keras

from kerasdist import ops, runtime, training_state


class Join(keras.callbacks.Callback):
    """Lets ranks run different numbers of steps per epoch in `fit` (shards of unequal size).

    Without it, `fit` refuses unequal step counts on every rank before training, because the
    gradient allreduces would pair up wrongly. With it, a rank that has run its last batch of
    the epoch calls `kerasdist.join()`: until every rank has joined, it takes part in the other
    ranks' gradient allreduces with zeros, and `Average` divides by the ranks that still have
    data, so each extra step's gradient is the mean over the batches really seen. Once every rank
    has joined, the model and optimizer state of the rank that joined last (it ran every step) is
    broadcast, so every rank starts the next epoch, and any evaluation, from the same weights.
    Metrics stay exact: `MetricAverage` sums the metrics' states over all ranks' batches.

    Every rank's `params["steps"]` becomes the longest rank's count before any callback's
    `on_train_begin`, so schedules that count steps per epoch (`LearningRateWarmup`,
    `LearningRateMultiplier`) set the same rate on every rank at each step, and the equal-steps
    check of `BroadcastGlobalState` passes.

    Place it after `BroadcastGlobalState` (`kerasdist.callbacks(uneven_steps=True)` does): a model
    built in the first step is broadcast at that step's end, before a rank with one step joins.

    Limits: each rank's step count must be known (a dataset of unknown cardinality is refused:
    `dataset.apply(tf.data.experimental.assert_cardinality(n))` gives it one) and at least 1.
    While a rank is joined, only Sum and Average allreduces can run: a callback that makes another
    collective per batch (`AdaptiveBatchGrowth`'s decision broadcast) fails with
    `FailedPreconditionError` naming the joined ranks, and a reduction that gathers
    (`one_bit_gradients=True`, `kerasdist.reductions.OneBit`) is refused when `fit` starts.
    With `backward_passes_per_step > 1`, the accumulation window restarts from the broadcast
    state at each epoch.

    Example:

    ```python
    import keras, kerasdist, numpy as np
    kerasdist.init()
    rows = 4 + 2 * kerasdist.rank()  # rank 0: 2 batches of 2; rank 1: 3
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    history = model.fit(np.ones((rows, 3)), np.ones((rows, 1)), batch_size=2, verbose=0,
                        callbacks=kerasdist.callbacks(uneven_steps=True))
    ```
    """

    def __init__(self):
        super().__init__()
        self._own_steps = None
        self._counts = None

    def set_params(self, params):
        # Keras hands every callback the same dict before any on_train_begin: rewriting the step
        # count here reaches every callback, wherever this one sits in the list.
        super().set_params(params)
        self._own_steps = params.get("steps")
        self._counts = ops.allgather_object(self._own_steps) if runtime.state().size > 1 else [self._own_steps]
        if None not in self._counts:
            params["steps"] = max(self._counts)

    def on_train_begin(self, logs=None):
        reduction = getattr(getattr(self.model, "optimizer", None), "reduction", None)
        if getattr(reduction, "gathers", False):
            named = "one_bit_gradients=True" if self.model.optimizer.one_bit_gradients else f"reduction={reduction!r}"
            raise ValueError(
                f"kerasdist.callbacks.Join (uneven_steps=True) does not work with {named}: a joined rank "
                "takes part only in Sum and Average allreduces, and that reduction moves gradients in "
                "allgathers. Give every rank the same steps per epoch, or reduce with an allreduce."
            )
        unknown = [rank for rank, count in enumerate(self._counts) if not count]
        if unknown and runtime.state().size > 1:
            raise ValueError(
                f"kerasdist.callbacks.Join needs every rank's number of steps per epoch, but fit "
                f"does not know it (or it is 0) on rank(s) {', '.join(map(str, unknown))}: counts "
                f"{self._counts}. Give the dataset a known length with "
                "dataset.apply(tf.data.experimental.assert_cardinality(n)), or pass steps_per_epoch= "
                "to fit (then every rank runs that many steps and Join is not needed)."
            )

    def on_train_batch_end(self, batch, logs=None):
        if runtime.state().size == 1 or batch + 1 < self._own_steps:
            return
        last = ops.join()
        training_state.broadcast_training_state(self.model, root_rank=last)
