"""Periodic model averaging (local SGD): ranks train alone and average their weights now and then."""

import keras

from kerasdist import ops, runtime, training_state
from kerasdist.distributed_optimizer import DistributedOptimizer

# The window restarts at every epoch and the ranks average at each epoch's last step anyway, so
# only windows up to an epoch's steps mean anything; no epoch has a million steps per rank. A
# larger value is a mistake (samples for steps, a sentinel for "never"), refused by name.
MAX_WINDOW_STEPS = 10**6


class ModelAveraging(keras.callbacks.Callback):
    """Every rank trains on its own data alone for ``every`` steps, then the ranks average their
    weights (and, by default, their optimizer's state): local SGD. Communication falls from one
    gradient allreduce per step to one allreduce of the weights per ``every`` steps, which is what
    pays on a slow link. The price is that the ranks' models drift apart between averages.

    Compile the model with the plain optimizer, not `DistributedOptimizer`: that would average the
    gradients of every step as well, and is refused. The ranks also average at the last step of
    every epoch, whatever the window, so the validation at the epoch's end, `MetricAverage` and
    `Rank0Checkpoint` see one model on every rank, and a run resumed from a checkpoint starts at
    a window's beginning, as the uninterrupted run did.

    With ``every=1`` and plain SGD this is synchronous SGD up to rounding: the average of
    ``w - lr * g_r`` over the ranks is ``w - lr * mean(g_r)``. With larger windows, rates that
    synchronous training at the same global batch uses may need lowering.

    Args:
      every: steps (callback batches) between averages: an int from 1 to 10**6 (a window longer
        than an epoch averages once an epoch, at its end), or a function of the epoch
        (counting from 0) that returns one, read at each epoch's start, so the window can grow
        as training settles (e.g. ``lambda epoch: 4 * 2 ** (epoch // 10)``).
      average_optimizer_state: also average the optimizer's floating-point variables (momenta,
        Adam's moments). The step counter is the same on every rank and is kept. False keeps
        each rank's own optimizer state.

    Example:

    ```python
    import keras, kerasdist, numpy as np
    kerasdist.init()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), loss="mse")  # the plain optimizer
    history = model.fit(np.ones((16, 3)), np.ones((16, 1)), batch_size=2, verbose=0,
                        callbacks=kerasdist.callbacks(average_models_every=4))
    ```
    """

    def __init__(self, every=4, average_optimizer_state=True):
        super().__init__()
        if not callable(every):
            _check_window(every, "every")
        self.every = every
        self.average_optimizer_state = average_optimizer_state
        self._window = None
        self._since_average = 0
        self.averages = 0  # how many times the ranks have averaged, for logs and tests

    def on_train_begin(self, logs=None):
        optimizer = getattr(self.model, "optimizer", None)
        while optimizer is not None:
            if isinstance(optimizer, DistributedOptimizer):
                raise ValueError(
                    "kerasdist.callbacks.ModelAveraging averages the weights every few steps, but the model's "
                    "optimizer is a DistributedOptimizer, which also averages the gradients of every step. "
                    "Compile the model with the plain optimizer (e.g. keras.optimizers.SGD(...)) instead."
                )
            optimizer = getattr(optimizer, "inner_optimizer", None)  # through LARC, LossScaleOptimizer

    def on_epoch_begin(self, epoch, logs=None):
        self._window = _check_window(self.every(epoch), f"every({epoch})") if callable(self.every) else self.every
        self._since_average = 0

    def on_train_batch_end(self, batch, logs=None):
        self._since_average += 1
        last_of_epoch = self.params.get("steps") is not None and batch + 1 >= self.params["steps"]
        if self._since_average >= self._window or last_of_epoch:
            self._average()

    def _average(self):
        self._since_average = 0
        if runtime.state().size == 1:
            return
        variables = [
            v for v in training_state.model_state_variables(self.model) if keras.backend.is_float_dtype(v.dtype)
        ]
        optimizer = getattr(self.model, "optimizer", None)
        if self.average_optimizer_state and optimizer is not None and optimizer.built:
            variables += [v for v in optimizer.variables if keras.backend.is_float_dtype(v.dtype)]
        averaged = ops.grouped_allreduce([v.value for v in variables], op=ops.Average, name="kerasdist.model_averaging")
        for variable, value in zip(variables, averaged):
            variable.assign(value)
        self.averages += 1


def _check_window(value, what):
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WINDOW_STEPS:
        raise ValueError(
            f"kerasdist.callbacks.ModelAveraging: {what} must be an int >= 1 (steps) and at most "
            f"{MAX_WINDOW_STEPS} (the ranks average at every epoch's end anyway), got {value!r}"
        )
    return value
