"""How the Estimator runs and writes: `RunConfig`, and the two halves of `train_and_evaluate`."""

import dataclasses
import os
from collections.abc import Callable, Sequence

import keras

ROOT_RANK = 0  # the rank that owns model_dir
DEFAULT_SAVE_CHECKPOINTS_SECS = 600


def _check_count(name, value):
    """None, or an int >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}={value!r} must be None or an integer >= 1")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where and how often the Estimator writes; rank 0 does all of it.

    Args:
        model_dir: Directory for checkpoints, summaries and (by default) exports. Only rank 0
            reads or writes it; the other ranks never touch it. `None`: the `Estimator`'s
            `model_dir`, or else a new temporary directory, deleted when the program exits.
        save_summary_steps: Write the training loss (averaged over ranks) to TensorBoard every
            this many steps. `None` writes none.
        save_checkpoints_steps: Save a checkpoint every this many steps.
        save_checkpoints_secs: Save a checkpoint when this many seconds have passed since the
            last save (rank 0's clock; saving runs no collective, so the other ranks do not
            wait). Give at most one of the two; with neither, every 600 seconds, as in TF1.
            `train` always saves when it ends.
        keep_checkpoint_max: Keep this many newest checkpoints; `None` keeps all.
        log_step_count_steps: Log the loss and steps per second on rank 0 (Python logging,
            logger `kerasdist.estimator`, level INFO) every this many steps. `None` logs none.

    Example:

    ```python
    from kerasdist.estimator import RunConfig

    config = RunConfig(model_dir="/tmp/digits", save_checkpoints_steps=200, keep_checkpoint_max=3)
    config = config.replace(log_step_count_steps=50)
    ```
    """

    model_dir: str | None = None
    save_summary_steps: int | None = 100
    save_checkpoints_steps: int | None = None
    save_checkpoints_secs: float | None = None
    keep_checkpoint_max: int | None = 5
    log_step_count_steps: int | None = 100

    def __post_init__(self):
        if self.model_dir is not None:
            object.__setattr__(self, "model_dir", os.fspath(self.model_dir))
        for name in ("save_summary_steps", "save_checkpoints_steps", "keep_checkpoint_max", "log_step_count_steps"):
            _check_count(name, getattr(self, name))
        if self.save_checkpoints_steps is not None and self.save_checkpoints_secs is not None:
            raise ValueError("RunConfig: give save_checkpoints_steps or save_checkpoints_secs, not both")
        if self.save_checkpoints_secs is not None and not self.save_checkpoints_secs > 0:
            raise ValueError(f"save_checkpoints_secs={self.save_checkpoints_secs!r} must be > 0")

    def replace(self, **changes):
        """A copy with `changes` applied (like TF1's `RunConfig.replace`), checked as a new one is.

        Example:

        ```python
        from kerasdist.estimator import RunConfig
        config = RunConfig(save_checkpoints_steps=100)
        print(config.replace(save_checkpoints_steps=500).save_checkpoints_steps)  # 500
        print(config.save_checkpoints_steps)  # 100
        try:
            config.replace(save_checkpoints_secs=60)
        except ValueError as error:
            print(error)  # RunConfig: give save_checkpoints_steps or save_checkpoints_secs, not both
        ```
        """
        return dataclasses.replace(self, **changes)

    @property
    def checkpoint_interval_secs(self):
        """Seconds between time-based saves, or `None` when saves are counted in steps.

        Example:

        ```python
        from kerasdist.estimator import RunConfig
        print(RunConfig().checkpoint_interval_secs)  # 600
        print(RunConfig(save_checkpoints_secs=60).checkpoint_interval_secs)  # 60
        print(RunConfig(save_checkpoints_steps=100).checkpoint_interval_secs)  # None
        ```
        """
        if self.save_checkpoints_steps is not None:
            return None
        return self.save_checkpoints_secs or DEFAULT_SAVE_CHECKPOINTS_SECS


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """The training half of `train_and_evaluate`.

    Args:
        input_fn: Returns the training `tf.data.Dataset` (see `Estimator.train`).
        max_steps: Train until the global step reaches this; `None` trains until the input ends.
        callbacks: Keras callbacks for `Estimator.train` (they replace TF1's `hooks`).

    Example:

    ```python
    import keras, tensorflow as tf
    from kerasdist import estimator

    def train_input_fn():
        return tf.data.Dataset.from_tensor_slices(([[1.0]] * 64, [[2.0]] * 64)).repeat().batch(8)

    spec = estimator.TrainSpec(train_input_fn, max_steps=1000, callbacks=[keras.callbacks.TerminateOnNaN()])
    print(spec.max_steps)  # 1000
    ```
    """

    input_fn: Callable
    max_steps: int | None = None
    callbacks: Sequence[keras.callbacks.Callback] = ()

    def __post_init__(self):
        if not callable(self.input_fn):
            raise TypeError(f"TrainSpec: input_fn must be callable; got {type(self.input_fn).__name__}")
        _check_count("max_steps", self.max_steps)


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """The evaluation half of `train_and_evaluate`.

    Args:
        input_fn: Returns the evaluation `tf.data.Dataset` (see `Estimator.evaluate`).
        steps: Batches each rank evaluates; `None` (the default) evaluates until the input ends.
        name: Evaluations with different names write to different directories (`eval_<name>`).
        every_n_steps: Evaluate after every this many training steps, and once more at the end.
            Defaults to the config's `save_checkpoints_steps`; without either, only at the end.
            (TF1's `throttle_secs` is gone: a decision by the clock could differ between ranks.)

    Example:

    ```python
    import tensorflow as tf
    from kerasdist import estimator

    def eval_input_fn():
        return tf.data.Dataset.from_tensor_slices(([[1.0]] * 64, [[2.0]] * 64)).batch(8)

    spec = estimator.EvalSpec(eval_input_fn, name="holdout", every_n_steps=200)  # writes to eval_holdout
    try:
        estimator.EvalSpec(eval_input_fn(), name="holdout")
    except TypeError as error:
        print(error)  # EvalSpec: input_fn must be callable; got ...
    ```
    """

    input_fn: Callable
    steps: int | None = None
    name: str | None = None
    every_n_steps: int | None = None

    def __post_init__(self):
        if not callable(self.input_fn):
            raise TypeError(f"EvalSpec: input_fn must be callable; got {type(self.input_fn).__name__}")
        _check_count("steps", self.steps)
        _check_count("every_n_steps", self.every_n_steps)
