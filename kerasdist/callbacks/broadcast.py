"""Start every rank from the same model and optimizer state."""

import itertools

import keras
import tensorflow as tf

from kerasdist import _compat, data, ops, replicas, runtime, training_state
from kerasdist.training_state import model_state_variables


class BroadcastGlobalState(keras.callbacks.Callback):
    """Gives every rank `root_rank`'s model and optimizer variables before the first step.

    Ranks initialise their weights independently; without this, each would train its own
    model. At `on_train_begin` every variable that exists is broadcast. Keras creates the rest
    inside the first step: an optimizer's state at its first `apply`, and the weights of a model
    without input shapes (a subclassed model, layers a custom `train_step` builds on first use,
    a GAN's second optimizer). Then the train function is traced ahead of that step, what the
    trace created and differs between ranks is broadcast (an optimizer's zeroed slots start
    alike and stay put), and only then does the step run, so its forward pass already
    uses `root_rank`'s weights (with `run_eagerly=True`, each variable the step creates takes
    `root_rank`'s initial value as it is created). The variables are those of the model and of
    each of its optimizers: `model.optimizer` and any optimizer the model holds as an attribute.
    Dropout seed states stay per rank (see `training_state_variables`).

    It also checks that every rank will run the same number of steps per epoch (when Keras
    knows the number) and raises the same `ValueError` on every rank if not. A model compiled
    with `jit_compile=True` is switched to `False` with a warning: kerasdist's ops do not run
    under XLA.

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

    def set_model(self, model):
        super().set_model(model)
        training_state.turn_off_xla(model)

    def on_train_begin(self, logs=None):
        if runtime.state().size == 1:
            return
        # Unequal epochs would pair one rank's last gradient allreduce with another's next
        # epoch: fail now, on every rank, instead. Unknown lengths (None) cannot be checked.
        data.check_equal_steps(self.params.get("steps"), what="steps per epoch in fit")
        self._broadcast()  # what exists now, so that every callback sees rank 0's state from here on
        if not self._state_is_complete():
            self._broadcast_before_the_first_step(existing=training_state.training_state_variables(self.model))

    def _state_is_complete(self):
        """Whether every variable the first step will use exists already. Keras builds an
        optimizer at its first `apply` (building it here from today's variables would leave out
        those a partly built model creates in that step, and Keras would then refuse them), and
        a model that is not built creates its weights in that step."""
        return self.model.built and all(optimizer.built for optimizer in training_state.optimizers_of(self.model))

    def _broadcast_before_the_first_step(self, existing):
        train_function = self.model.train_function
        broadcast = {id(v) for v in existing}

        def first_step(iterator):
            self.model.train_function = train_function
            if _compat.trace_train_function(train_function, iterator):
                check_same_variable_shapes(self.model, self.root_rank)
                # Only what appeared since on_train_begin, and none of each rank's own optimizer
                # state: callbacks after this one may have restored state in between
                # (Rank0Checkpoint's resume gives each rank its own partial sums back).
                own = {
                    id(v)
                    for optimizer in training_state.optimizers_of(self.model)
                    for v in training_state.optimizer_per_rank_variables(optimizer)
                }
                created = [
                    v
                    for v in training_state.training_state_variables(self.model)
                    if id(v) not in broadcast and id(v) not in own
                ]
                # Most of it (an optimizer's zeroed slots) starts alike everywhere: only what
                # differs moves, not a model's size of zeros over the network.
                different = replicas.differing_variables(created, "kerasdist.first_step_state")
                ops.broadcast_variables(different, root_rank=self.root_rank)
                return train_function(iterator)
            # run_eagerly: the variables the step creates as it runs take root_rank's initial
            # value as they are created.
            with tf.variable_creator_scope(_initial_values_from(self.root_rank)):
                return train_function(iterator)

        self.model.train_function = first_step

    def _broadcast(self):
        check_same_variable_shapes(self.model, self.root_rank)
        training_state.broadcast_training_state(self.model, self.root_rank)


def _initial_values_from(root_rank):
    """A variable creator that gives each new variable `root_rank`'s initial value, so that a
    step run eagerly computes with the same weights on every rank from its first operation.
    Seed states stay each rank's own (see `training_state.model_state_variables`)."""
    created = itertools.count()

    def creator(next_creator, **arguments):
        initial_value = arguments.get("initial_value")
        if not str(arguments.get("name") or "").endswith("seed_generator_state") and initial_value is not None:
            value = initial_value() if callable(initial_value) else initial_value
            arguments["initial_value"] = ops.broadcast(
                tf.convert_to_tensor(value), root_rank=root_rank, name=f"kerasdist.initial_value#{next(created)}"
            )
        return next_creator(**arguments)

    return creator


def check_same_variable_shapes(model, root_rank):
    """Raises the same `ValueError` on every rank when the ranks' models or optimizers differ in
    their variables' number, shape or dtype, naming the first difference. A collective.

    The broadcast itself would fail too, but on packed buffers ("rank 0 sent shape [23]; rank 1
    sent shape [28]") that name neither the models nor a variable.
    """
    own = [("the model", model_state_variables(model))] + [
        (f"optimizer '{optimizer.name}'", list(optimizer.variables) if optimizer.built else [])
        for optimizer in training_state.optimizers_of(model)
    ]
    own = [(owner, [(v.path, tuple(v.shape), str(v.dtype)) for v in variables]) for owner, variables in own]
    every_rank = ops.allgather_object(own)
    root = every_rank[root_rank]
    for rank, theirs in enumerate(every_rank):
        for (owner, expected), (_, held) in zip(root, theirs):
            if [entry[1:] for entry in held] == [entry[1:] for entry in expected]:
                continue
            if not expected or not held:
                with_state, without = (root_rank, rank) if expected else (rank, root_rank)
                raise ValueError(
                    f"kerasdist: {owner} holds state on rank {with_state} and none yet on rank {without}, so "
                    f"the ranks would not start alike: something built or restored it on some ranks only (a "
                    "BackupAndRestore or load_weights given to one rank, or an apply() before fit on one rank). "
                    "Give every rank the same callbacks and code, or resume with "
                    "kerasdist.callbacks(checkpoint_dir=..., resume=True), which resumes every rank from "
                    f"rank {root_rank}'s checkpoint."
                )
            if len(held) != len(expected):
                difference = f"rank {root_rank} has {len(expected)} variables, rank {rank} has {len(held)}"
            else:
                at = next(i for i, (a, b) in enumerate(zip(expected, held)) if a[1:] != b[1:])
                difference = (
                    f"variable {at}: rank {root_rank} has {expected[at][0]!r} of shape {expected[at][1]} "
                    f"({expected[at][2]}), rank {rank} has {held[at][0]!r} of shape {held[at][1]} ({held[at][2]})"
                )
            raise ValueError(
                f"kerasdist: the ranks' models or optimizer states differ, so rank {root_rank}'s cannot be "
                f"broadcast to every rank: in {owner}, {difference}. Build the same model (the same layers "
                "and sizes) and compile it with the same optimizer on every rank."
            )
