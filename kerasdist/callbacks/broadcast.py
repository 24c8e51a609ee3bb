"""Start every rank from the same model and optimizer state."""

import keras

from kerasdist import data, ops, runtime, training_state


class BroadcastGlobalState(keras.callbacks.Callback):
    """Gives every rank `root_rank`'s model and optimizer variables before the first update.

    Ranks initialise their weights independently; without this, each would train its own
    model. At `on_train_begin` the optimizer's variables are created (Keras would otherwise
    defer them to the first step) and all of them, with the model's, are broadcast. A model
    that is not built before `fit` (a subclassed model without input shapes) cannot be
    broadcast then: it is broadcast after the first step instead. A `DistributedOptimizer`
    gives every rank rank 0's trainable weights before that first update by itself (its
    first-update check), so the first update starts from rank 0's weights too.

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
        # DistributedOptimizer makes the ranks' weights agree at the first update by itself; it
        # need not say so when this callback's broadcast was bound to come after it.
        self.model.optimizer._broadcast_follows_first_step = self._pending
        if not self._pending:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if self._pending:
            self._pending = False
            self._broadcast()

    def _broadcast(self):
        if runtime.state().size > 1:
            check_same_variable_shapes(training_state.training_state_variables(self.model), self.root_rank)
        training_state.broadcast_training_state(self.model, self.root_rank)


def check_same_variable_shapes(variables, root_rank):
    """Raises the same `ValueError` on every rank when the ranks' `variables` differ in number,
    shape or dtype (different models or optimizers), naming the first difference. A collective.

    The broadcast itself would fail too, but on packed buffers ("rank 0 sent shape [23]; rank 1
    sent shape [28]") that name neither the models nor a variable.
    """
    own = [(variable.path, tuple(variable.shape), str(variable.dtype)) for variable in variables]
    every_rank = ops.allgather_object(own)
    root = every_rank[root_rank]
    for rank, theirs in enumerate(every_rank):
        if [entry[1:] for entry in theirs] == [entry[1:] for entry in root]:
            continue
        if len(theirs) != len(root):
            difference = f"rank {root_rank} has {len(root)} variables, rank {rank} has {len(theirs)}"
        else:
            at = next(i for i, (a, b) in enumerate(zip(root, theirs)) if a[1:] != b[1:])
            difference = (
                f"variable {at}: rank {root_rank} has {root[at][0]!r} of shape {root[at][1]} ({root[at][2]}), "
                f"rank {rank} has {theirs[at][0]!r} of shape {theirs[at][1]} ({theirs[at][2]})"
            )
        raise ValueError(
            f"kerasdist: the ranks' models or optimizer states differ, so rank {root_rank}'s cannot be "
            f"broadcast to every rank: {difference}. Build the same model (the same layers and sizes) "
            "and compile it with the same optimizer on every rank."
        )
