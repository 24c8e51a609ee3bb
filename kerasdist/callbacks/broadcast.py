"""Start every rank from the same model and optimizer state."""

import keras

from kerasdist import data, runtime, training_state


class BroadcastGlobalState(keras.callbacks.Callback):
    """Gives every rank `root_rank`'s model and optimizer variables before the first update.

    Ranks initialise their weights independently; without this, each would train its own
    model. At `on_train_begin` the optimizer's variables are created (Keras would otherwise
    defer them to the first step) and all of them, with the model's, are broadcast. A model
    that is not built before `fit` (a subclassed model without input shapes) cannot be
    broadcast then: it is broadcast after the first step instead, so the first update starts
    from per-rank weights and every later one from rank 0's.

    It also checks that every rank will run the same number of steps per epoch (when Keras
    knows the number) and raises the same `ValueError` on every rank if not. Dropout seed
    states stay per rank (see `training_state_variables`). A model compiled with
    `jit_compile=True` is switched to `False` with a warning: kerasdist's ops do not run under XLA.

    Args:
        root_rank: the rank whose state everyone takes. Defaults to 0.

    Example:

    ```python
    import keras, kerasdist, numpy as np
    kerasdist.init()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    history = model.fit(np.ones((4, 3)), np.ones((4, 1)), verbose=0,
                        callbacks=[kerasdist.callbacks.BroadcastGlobalState()])
    ```
    """

    def __init__(self, root_rank=0):
        super().__init__()
        self.root_rank = root_rank
        self._pending = False

    def set_model(self, model):
        super().set_model(model)
        training_state.turn_off_xla(model)

    def on_train_begin(self, logs=None):
        if runtime.state().size > 1:
            # Unequal epochs would pair one rank's last gradient allreduce with another's next
            # epoch: fail now, on every rank, instead. Unknown lengths (None) cannot be checked.
            data.check_equal_steps(self.params.get("steps"), what="steps per epoch in fit")
        self._pending = not training_state.build_optimizer(self.model) or not self.model.built
        if not self._pending:
            training_state.broadcast_training_state(self.model, self.root_rank)

    def on_train_batch_end(self, batch, logs=None):
        if self._pending:
            self._pending = False
            training_state.broadcast_training_state(self.model, self.root_rank)
