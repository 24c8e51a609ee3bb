"""Estimator-style training for `model_fn` / `input_fn` code, data-parallel across ranks.

`tf.estimator` left TensorFlow in 2.16, but a lot of training code is still written as
`model_fn(features, labels, mode, params)` plus `input_fn`, run by `train_and_evaluate`. This
module keeps that shape on Keras 3 and TensorFlow 2, with kerasdist underneath:

- every rank reads its own shard of the input (`input_fn` gets an `InputContext`, or its
  dataset is sharded for it);
- gradients are averaged across ranks by `kerasdist.DistributedOptimizer` before each update;
- rank 0's initial or restored state is broadcast to every rank before training;
- only rank 0 touches `model_dir`: checkpoints (`tf.train.CheckpointManager`, with the global
  step), TensorBoard summaries and exports; saving runs no collective;
- `evaluate` sums the metrics' state over ranks, so its numbers are those of one process on
  the whole evaluation set, also when the shards have different sizes.

See `Estimator` for the `model_fn` contract and `EstimatorSpec` for how the spec differs from
TF1's.
"""

import collections
import contextlib
import dataclasses
import inspect
import itertools
import logging
import math
import os
import tempfile
import time
import warnings
from typing import Callable, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from kerasdist import data, ops, runtime
from kerasdist.coordination import on_root_for_every_rank
from kerasdist.optimizer import DistributedOptimizer

__all__ = ["EstimatorSpec", "Estimator", "EvalSpec", "InputContext", "ModeKeys", "RunConfig", "TrainSpec",
           "train_and_evaluate"]

_logger = logging.getLogger(__name__)

ROOT_RANK = 0  # the rank that owns model_dir
CHECKPOINT_NAME = "model.ckpt"  # checkpoints are model.ckpt-<global step>, as with tf.estimator
DEFAULT_SAVE_CHECKPOINTS_SECS = 600
# tf.summary.scalar needs the tensorboard package, which TensorFlow 2.21 no longer installs;
# tf.summary.write with this metadata writes the same record TensorBoard's scalars read.
_SCALAR_SUMMARY = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
    data_class=summary_pb2.DATA_CLASS_SCALAR)
# Result names evaluate() reports itself; eval_metrics may not use them.
_RESERVED_METRIC_NAMES = ("loss", "global_step")

# What input_fn receives: the class tf.distribute passes to dataset functions.
# num_input_pipelines is the number of ranks, input_pipeline_id this rank.
InputContext = tf.distribute.InputContext


class ModeKeys:
    """The mode `model_fn` is called in: the same strings as `tf.estimator.ModeKeys`, so code
    that compares `mode` with them keeps working."""

    TRAIN = "train"
    EVAL = "eval"
    PREDICT = "infer"


_MODES = (ModeKeys.TRAIN, ModeKeys.EVAL, ModeKeys.PREDICT)


class EstimatorSpec(collections.namedtuple(
        "EstimatorSpec", ["mode", "predictions", "loss", "optimizer", "eval_metrics", "model"])):
    """What `model_fn` returns: the model, and what to do with it in this mode.

    Differences from TF1's `tf.estimator.EstimatorSpec`:

    - No `train_op`. Return the Keras optimizer instead (`optimizer=`); the Estimator computes
      the gradients of `loss` with respect to `model.trainable_variables`, averages them across
      ranks (it wraps the optimizer in `kerasdist.DistributedOptimizer`, unless it already is
      one), applies them and increments the global step. Do not call `minimize` yourself.
    - No sessions, `Scaffold`, hooks (`training_hooks`, `evaluation_hooks`, ...), or
      `tf.compat.v1` collections: the Estimator traces `model_fn` with `tf.function` and saves
      with `tf.train.Checkpoint`.
    - `model` is new and required in every mode: the Keras 3 model (`keras.Model`, or any
      `keras.Layer`) whose layers `model_fn` used. Its variables are what is trained,
      checkpointed, broadcast and exported. Build the network with Keras 3 layers; `tf.layers`,
      `tf.compat.v1.layers` and `tf.compat.v1.get_variable` are gone.
    - `eval_metric_ops` (pairs of value and update op) becomes `eval_metrics`: a dict of
      `keras.metrics.Metric` objects that `model_fn` has updated with this batch
      (`metric.update_state(labels, logits)`). The Estimator combines their state across ranks.
    - `export_outputs` and `prediction_hooks` are gone: `Estimator.export_model` saves `model`.

    As in TF1, `loss` must be a scalar, and `model_fn` may return the same spec fields in every
    mode: fields a mode does not use are ignored.

    Args:
        mode: A `ModeKeys` value: the mode `model_fn` was called with.
        predictions: A tensor or a dict of tensors, one row per example. Required in PREDICT.
        loss: A scalar float tensor: the whole objective (add `model.losses` yourself if the
            model has regularizers). Required in TRAIN and EVAL.
        optimizer: A `keras.optimizers.Optimizer`. Required in TRAIN.
        eval_metrics: A dict from result name to `keras.metrics.Metric`, updated in `model_fn`.
            Used in EVAL; the names `"loss"` and `"global_step"` are taken.
        model: The `keras.Model` (or `keras.Layer`) that holds every trainable variable
            `model_fn` created. Required in every mode.

    Raises:
        ValueError: For an unknown mode, or a field the mode needs that is missing, or a loss
            that is not a scalar.
        TypeError: For a field of the wrong kind.

    Example:

    ```python
    import keras
    import tensorflow as tf
    from kerasdist.estimator import EstimatorSpec, ModeKeys

    def model_fn(features, labels, mode, params):
        model = keras.Sequential([keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
        logits = model(features, training=mode == ModeKeys.TRAIN)
        if mode == ModeKeys.PREDICT:
            return EstimatorSpec(mode, predictions={"class": tf.argmax(logits, 1)}, model=model)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        accuracy = keras.metrics.SparseCategoricalAccuracy()
        accuracy.update_state(labels, logits)
        return EstimatorSpec(mode, loss=loss, optimizer=keras.optimizers.Adam(params["learning_rate"]),
                             eval_metrics={"accuracy": accuracy}, model=model)
    ```
    """

    __slots__ = ()

    def __new__(cls, mode, predictions=None, loss=None, optimizer=None, eval_metrics=None, model=None):
        if mode not in _MODES:
            raise ValueError(f"EstimatorSpec: mode={mode!r} is not a ModeKeys value; expected ModeKeys.TRAIN "
                             f"({ModeKeys.TRAIN!r}), ModeKeys.EVAL ({ModeKeys.EVAL!r}) or ModeKeys.PREDICT "
                             f"({ModeKeys.PREDICT!r})")
        _check_model(model)
        loss = _checked_loss(loss, mode)
        optimizer = _checked_optimizer(optimizer, mode)
        predictions = _checked_predictions(predictions, mode)
        eval_metrics = _checked_eval_metrics(eval_metrics)
        return super().__new__(cls, mode, predictions, loss, optimizer, eval_metrics, model)


def _check_model(model):
    if model is None:
        raise ValueError("EstimatorSpec: model is missing. Return the keras.Model whose layers model_fn used "
                         "(model=...): the Estimator trains, checkpoints and exports its variables")
    if not isinstance(model, keras.Layer):
        raise TypeError(f"EstimatorSpec: model must be a keras.Model (or keras.Layer); got {type(model).__name__}")


def _checked_loss(loss, mode):
    if loss is None:
        if mode == ModeKeys.PREDICT:
            return None
        purpose = "minimize" if mode == ModeKeys.TRAIN else "evaluate"
        raise ValueError(f"EstimatorSpec: loss is missing in {mode} mode; return the scalar loss to {purpose} "
                         "(loss=...)")
    try:
        loss = tf.convert_to_tensor(loss)
    except (TypeError, ValueError) as error:
        raise TypeError(f"EstimatorSpec: loss must be a scalar tensor; got {type(loss).__name__}") from error
    if not loss.dtype.is_floating:
        raise TypeError(f"EstimatorSpec: loss must be a float tensor; got {loss.dtype.name}")
    if loss.shape.rank is None:
        return tf.reshape(loss, [])  # fails at run time unless it holds one value
    if loss.shape.rank != 0:
        raise ValueError(f"EstimatorSpec: loss must be a scalar; got shape {loss.shape}. Reduce it to one number, "
                         "e.g. tf.reduce_mean(per_example_loss)")
    return loss


def _checked_optimizer(optimizer, mode):
    if optimizer is None:
        if mode == ModeKeys.TRAIN:
            raise ValueError("EstimatorSpec: optimizer is missing in train mode; return a Keras optimizer "
                             "(optimizer=keras.optimizers.Adam(...)); the Estimator applies it, averaging the "
                             "gradients across ranks")
        return None
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"EstimatorSpec: optimizer must be a keras.optimizers.Optimizer; got "
                        f"{type(optimizer).__name__} (for a name, use keras.optimizers.get({optimizer!r}))")
    return optimizer


def _checked_predictions(predictions, mode):
    if predictions is None:
        if mode == ModeKeys.PREDICT:
            raise ValueError("EstimatorSpec: predictions is missing in infer (PREDICT) mode; return a tensor or a "
                             "dict of tensors (predictions=...)")
        return None
    if isinstance(predictions, dict):
        if not all(isinstance(key, str) for key in predictions):
            raise TypeError(f"EstimatorSpec: the keys of predictions must be strings; got {list(predictions)}")
        return {key: _as_prediction(value, key) for key, value in predictions.items()}
    return _as_prediction(predictions, None)


def _as_prediction(value, key):
    try:
        return tf.convert_to_tensor(value)
    except (TypeError, ValueError) as error:
        where = "predictions" if key is None else f"predictions[{key!r}]"
        raise TypeError(f"EstimatorSpec: {where} must be a tensor; got {type(value).__name__}") from error


def _checked_eval_metrics(eval_metrics):
    if eval_metrics is None:
        return {}
    if not isinstance(eval_metrics, dict):
        raise TypeError(f"EstimatorSpec: eval_metrics must be a dict of keras.metrics.Metric; got "
                        f"{type(eval_metrics).__name__}")
    for name, metric in eval_metrics.items():
        if not isinstance(name, str) or name in _RESERVED_METRIC_NAMES:
            raise ValueError(f"EstimatorSpec: eval_metrics key {name!r} must be a string other than "
                             f"{' and '.join(map(repr, _RESERVED_METRIC_NAMES))}, which evaluate() reports itself")
        if not isinstance(metric, keras.metrics.Metric):
            raise TypeError(f"EstimatorSpec: eval_metrics[{name!r}] must be a keras.metrics.Metric updated in "
                            f"model_fn; got {type(metric).__name__}. TF1 (value, update_op) pairs are not supported")
    return dict(eval_metrics)


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
            `model_dir`, or else a new temporary directory.
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

    model_dir: Optional[str] = None
    save_summary_steps: Optional[int] = 100
    save_checkpoints_steps: Optional[int] = None
    save_checkpoints_secs: Optional[float] = None
    keep_checkpoint_max: Optional[int] = 5
    log_step_count_steps: Optional[int] = 100

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
        """A copy with `changes` applied (like TF1's `RunConfig.replace`)."""
        return dataclasses.replace(self, **changes)

    @property
    def checkpoint_interval_secs(self):
        """Seconds between time-based saves, or `None` when saves are counted in steps."""
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
    """

    input_fn: Callable
    max_steps: Optional[int] = None
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
    """

    input_fn: Callable
    steps: Optional[int] = None
    name: Optional[str] = None
    every_n_steps: Optional[int] = None

    def __post_init__(self):
        if not callable(self.input_fn):
            raise TypeError(f"EvalSpec: input_fn must be callable; got {type(self.input_fn).__name__}")
        _check_count("steps", self.steps)
        _check_count("every_n_steps", self.every_n_steps)


class Estimator:
    """Trains, evaluates and predicts with a `model_fn`, data-parallel across ranks.

    Every rank runs the same script: constructs the Estimator and calls the same methods in the
    same order (`train`, `evaluate`, `predict`, `latest_checkpoint` and `export_model` are
    collectives). A single process (`python script.py`) is a world of one and needs no launcher.

    **The `model_fn` contract.** `model_fn(features, labels, mode, params, config)` (declare the
    arguments you need, by these names; `features` is required) creates Keras 3 layers, a
    model, metrics and an optimizer and returns an `EstimatorSpec` - as TF1 code did with
    `tf.layers`. TF1 built a graph once per call of `train`/`evaluate`/`predict`; here, each
    mode's `model_fn` runs:

    1. once eagerly, on the first batch (or an empty batch shaped like the input, on a rank that
       has none), to create every variable; then their initial values are put back, so this run
       trains nothing, moves no batch-norm statistics and counts no metrics; and
    2. once more when the step is traced with `tf.function` (with AutoGraph). The Keras objects
       this run creates receive the variables of their eager twins, in creation order (like
       `tf.compat.v1.make_template` did), so the traced step updates the variables that are
       checkpointed.

    Both runs happen before the first collective, so a faulty `model_fn` or spec raises its
    error on every rank. `model_fn` must create the same Keras objects, in the same order, each
    time it runs in a given mode; a mismatch raises a `ValueError`. What it creates may differ
    between modes (metrics in EVAL only, the optimizer in TRAIN only), but `model` must have
    the same structure in every mode, since checkpoints carry it from one to the next. A model
    built outside `model_fn` and returned by it works too. `tf.summary` calls inside
    `model_fn` write nothing.

    State moves between modes, and between runs, only through checkpoints, as in TF1: `train`
    starts from the newest checkpoint in `model_dir` if there is one (the global step goes on
    from there) and saves one when it ends; `evaluate`, `predict` and `export_model` load the
    newest checkpoint. Rank 0 reads it and broadcasts its values to every rank, so only rank 0
    needs to see `model_dir`. Each mode's traced step is built once per Estimator and reused by
    later calls whose input has the same structure.

    Args:
        model_fn: Builds the model and returns an `EstimatorSpec` (see above).
        model_dir: Where rank 0 writes checkpoints and summaries; on other ranks it is unused.
            `None`: the config's, or a new temporary directory.
        config: A `RunConfig`.
        params: A dict handed to `model_fn` and `input_fn` as `params`.

    Example:

    ```python
    import tempfile

    import keras
    import numpy as np
    import tensorflow as tf
    from kerasdist import estimator

    def model_fn(features, labels, mode, params):
        model = keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
        logits = model(features, training=mode == estimator.ModeKeys.TRAIN)
        if mode == estimator.ModeKeys.PREDICT:
            return estimator.EstimatorSpec(mode, predictions={"class": tf.argmax(logits, 1)}, model=model)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        accuracy = keras.metrics.SparseCategoricalAccuracy()
        accuracy.update_state(labels, logits)
        return estimator.EstimatorSpec(mode, loss=loss, optimizer=keras.optimizers.SGD(0.1),
                                       eval_metrics={"accuracy": accuracy}, model=model)

    x = np.random.default_rng(0).normal(size=(256, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int64") + (x[:, 1] > 0)

    def input_fn(params):  # sharded across ranks automatically
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(params["batch_size"])

    classifier = estimator.Estimator(model_fn, model_dir=tempfile.mkdtemp(), params={"batch_size": 32})
    classifier.train(lambda params: input_fn(params).repeat(), steps=100)
    print(classifier.evaluate(input_fn))  # {'loss': ..., 'accuracy': ..., 'global_step': 100}
    first = next(classifier.predict(input_fn))  # {'class': ...}
    ```
    """

    def __init__(self, model_fn, model_dir=None, config=None, params=None):
        self._model_fn_arguments = _accepted_arguments(model_fn, ("features", "labels", "mode", "params", "config"),
                                                       "model_fn")
        if "features" not in self._model_fn_arguments:
            raise ValueError("model_fn must take an argument named `features` (and, as needed, labels, mode, "
                             "params, config)")
        config = RunConfig() if config is None else config
        if not isinstance(config, RunConfig):
            raise TypeError(f"config must be a kerasdist.estimator.RunConfig; got {type(config).__name__}")
        if model_dir is not None:
            model_dir = os.fspath(model_dir)
            if config.model_dir is not None and config.model_dir != model_dir:
                raise ValueError(f"model_dir={model_dir!r} differs from config.model_dir={config.model_dir!r}; "
                                 "give one, or the same in both")
        else:
            model_dir = config.model_dir
        world = runtime.state()
        self._rank, self._size = world.rank, world.size
        self._is_root = world.rank == ROOT_RANK
        if model_dir is None and self._is_root:
            model_dir = tempfile.mkdtemp(prefix="kerasdist_estimator_")
            _logger.warning("Using a temporary folder as model directory: %s", model_dir)
        self._config = config.replace(model_dir=model_dir)
        self._model_fn = model_fn
        self._params = dict(params or {})
        self._graphs = {}  # mode -> _ModeGraph, reused while the input's structure stays the same
        self._features_spec = None  # of the latest input, for export_model
        self._summary_writers = {}

    @property
    def model_fn(self):
        return self._model_fn

    @property
    def model_dir(self):
        return self._config.model_dir

    @property
    def config(self):
        return self._config

    @property
    def params(self):
        return dict(self._params)

    def train(self, input_fn, steps=None, max_steps=None, callbacks=None):
        """Trains from the newest checkpoint (if any), then saves one. A collective.

        `input_fn` returns a `tf.data.Dataset` of batches, each `(features, labels)` (or
        `features` alone, for a `model_fn` without labels). If it declares an `input_context`
        argument, it gets an `InputContext` (`num_input_pipelines` = number of ranks,
        `input_pipeline_id` = this rank) and must shard the data itself; otherwise the dataset
        it returns is sharded for it with `kerasdist.data.shard` (rank r takes batches r,
        r + size, ...: seed any shuffle before that point, or the shards overlap). It may also
        declare `params`, `mode` and `config`.

        Every rank runs the same number of steps: training ends when the first rank's input
        does (ranks holding more batches skip the rest), or at the step limit.

        Args:
            input_fn: Returns the training dataset (see above).
            steps: Train this many more steps. At most one of `steps` and `max_steps`.
            max_steps: Train until the global step reaches this; if it already has, return at
                once. With neither, train until the input ends (an infinite input needs one).
            callbacks: Keras callbacks; they get `set_model(model)`, `on_train_begin`,
                `on_train_batch_end(global_step, {"loss": this rank's loss})` and
                `on_train_end`. Stopping training from a callback is not supported.

        Returns:
            The Estimator, for chaining.

        Raises:
            ValueError: For bad step limits, an infinite input without one, or a bad
                `EstimatorSpec` (every rank raises it, before any collective).
        """
        if steps is not None and max_steps is not None:
            raise ValueError("train: give steps or max_steps, not both")
        _check_count("steps", steps)
        _check_count("max_steps", max_steps)
        self._train(input_fn, steps, max_steps, list(callbacks or ()))
        return self

    def evaluate(self, input_fn, steps=None, name=None, checkpoint_path=None):
        """Evaluates the newest checkpoint; the result is that of one process on all the data.

        A collective. Each rank evaluates its own shard of the input (see `train` for how
        `input_fn` is called and sharded; the shards may have different sizes), then the state
        of every metric is summed over ranks, so the numbers are exact for the whole set.

        Args:
            input_fn: Returns the evaluation dataset of `(features, labels)` batches.
            steps: Batches each rank evaluates; `None` evaluates until its input ends.
            name: Summaries go to `model_dir/eval_<name>` (`model_dir/eval` without a name).
            checkpoint_path: Evaluate this checkpoint instead of the newest. Without any
                checkpoint, the initial weights (rank 0's) are evaluated, with a warning.

        Returns:
            A dict: each `eval_metrics` result, `"loss"` (the mean of the spec's loss over
            examples: each batch's loss weighted by its size; TF1 averaged over batches) and
            `"global_step"` of the checkpoint. Equal on every rank.
        """
        _check_count("steps", steps)
        dataset, first, elements = self._input(input_fn, ModeKeys.EVAL)
        graph = self._graph_for(ModeKeys.EVAL, dataset.element_spec, first)
        self._restore(graph, checkpoint_path, what="evaluating")
        metrics = [graph.loss_mean, *graph.spec.eval_metrics.values()]
        for metric in metrics:
            metric.reset_state()
        for element in itertools.islice(elements, steps):
            graph.step_function(element)
        _sum_over_ranks(metrics)
        results = {"loss": _to_python(graph.loss_mean.result())}
        results.update({key: _to_python(metric.result()) for key, metric in graph.spec.eval_metrics.items()})
        results["global_step"] = int(graph.global_step.numpy())
        if self._is_root:
            self._log_evaluation(results, name)
        return results

    def predict(self, input_fn, checkpoint_path=None, yield_single_examples=True):
        """Predictions of the newest checkpoint, as a generator.

        Calling `predict` is a collective (rank 0 loads the checkpoint and broadcasts it);
        iterating the generator is not, so ranks may consume it differently. The input is not
        sharded: every rank predicts all of what its `input_fn` returns. Shard it yourself
        (declare `input_context`) to split the work.

        Args:
            input_fn: Returns a dataset of `features` batches (or `(features, labels)`; the
                labels are ignored).
            checkpoint_path: Predict with this checkpoint instead of the newest.
            yield_single_examples: Yield one example at a time (a dict of NumPy values when
                the predictions are a dict); `False` yields whole batches.

        Returns:
            A generator of predictions.
        """
        dataset, first, elements = self._input(input_fn, ModeKeys.PREDICT)
        graph = self._graph_for(ModeKeys.PREDICT, dataset.element_spec, first)
        self._restore(graph, checkpoint_path, what="predicting")
        return _predictions(graph, elements, yield_single_examples)

    def latest_checkpoint(self):
        """The newest checkpoint in `model_dir` (as rank 0 sees it), or `None`. A collective."""
        return on_root_for_every_rank(lambda: tf.train.latest_checkpoint(self.model_dir), ROOT_RANK)

    def export_model(self, path, checkpoint_path=None):
        """Rank 0 saves the model of the newest checkpoint, built in PREDICT mode. A collective.

        A `path` ending in `.keras` gets a Keras file (`keras.saving.load_model`); any other
        path a TensorFlow SavedModel for serving (`keras.Model.export`, endpoint `serve`). The
        features' structure is that of the latest input this Estimator saw, so call `train`,
        `evaluate` or `predict` first.

        Args:
            path: Where rank 0 writes.
            checkpoint_path: Export this checkpoint instead of the newest.

        Returns:
            `path`.

        Raises:
            ValueError: On every rank, when there is no checkpoint or no input was seen yet.
        """
        path = os.fspath(path)
        on_root_for_every_rank(lambda: self._export_on_root(path, checkpoint_path), ROOT_RANK)
        return path

    # Training

    def _train(self, input_fn, steps, max_steps, callbacks, evaluate_every=None, evaluate=None):
        """The training loop; returns the global step it ended at. `evaluate()` runs every
        `evaluate_every` steps, after rank 0 saved a checkpoint there."""
        dataset, first, elements = self._input(input_fn, ModeKeys.TRAIN)
        graph = self._graph_for(ModeKeys.TRAIN, dataset.element_spec, first)
        # Collectives start here; every rank gets here after the same checks.
        restored = self._restore(graph, None, what="training")
        start = int(graph.global_step.numpy())
        limits = [limit for limit in (None if steps is None else start + steps, max_steps) if limit is not None]
        stop = min(limits) if limits else None
        if stop is not None and start >= stop:
            if self._is_root:
                _logger.info("Skipping training: the global step is already %d (max_steps=%d)", start, stop)
            return start
        available = _batches_every_rank_has(dataset)
        if stop is None and available == math.inf:
            raise ValueError("train: input_fn's dataset never ends; give steps or max_steps")
        count = None if available is None else min(available, math.inf if stop is None else stop - start)

        saver = _Rank0Saver(graph, self._config, saved_step=start if restored else None) if self._is_root else None
        for callback in callbacks:
            callback.set_model(graph.spec.model)
            callback.on_train_begin()
        step, clock = start, _StepClock(start)
        for element in _together(elements, count, check_each_step=available is None):
            loss = graph.step_function(element)
            step += 1
            self._report_training(loss, step, clock)
            evaluate_now = evaluate is not None and evaluate_every is not None and step % evaluate_every == 0
            if saver is not None:
                saver.save_if_due(step, force=evaluate_now)
            for callback in callbacks:
                callback.on_train_batch_end(step, {"loss": float(loss)})
            if evaluate_now:
                evaluate()
        if saver is not None:
            saver.save_if_due(step, force=True)
        for callback in callbacks:
            callback.on_train_end()
        return step

    def _report_training(self, loss, step, clock):
        """Loss summaries and log lines: the loss averaged over ranks (a collective, at steps
        every rank knows)."""
        config = self._config
        summary_due = config.save_summary_steps is not None and step % config.save_summary_steps == 0
        log_due = config.log_step_count_steps is not None and step % config.log_step_count_steps == 0
        if not (summary_due or log_due):
            return
        mean_loss = float(ops.allreduce(loss, op=ops.Average) if self._size > 1 else loss)
        if not self._is_root:
            return
        scalars = {"loss": mean_loss} if summary_due else {}
        if log_due:
            steps_per_sec = clock.steps_per_second(step)
            scalars["global_step/sec"] = steps_per_sec
            _logger.info("loss = %.6g, step = %d (%.3g steps/sec)", mean_loss, step, steps_per_sec)
        self._write_scalars(self.model_dir, step, scalars)

    # Building, restoring, input

    def _input(self, input_fn, mode):
        """(dataset, its first element or None, an iterator over all its elements)."""
        accepted = _accepted_arguments(input_fn, ("params", "mode", "config", "input_context"), "input_fn")
        available = {"params": self._params, "mode": mode, "config": self._config,
                     "input_context": InputContext(num_input_pipelines=self._size, input_pipeline_id=self._rank,
                                                   num_replicas_in_sync=self._size)}
        dataset = input_fn(**{name: available[name] for name in accepted})
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(f"input_fn must return a tf.data.Dataset of batches; got {type(dataset).__name__}")
        if mode != ModeKeys.PREDICT and "input_context" not in accepted:
            dataset = data.shard(dataset)
        self._features_spec = _features_and_labels(dataset.element_spec)[0]
        iterator = iter(dataset)
        first = next(iterator, None)
        return dataset, first, iterator if first is None else itertools.chain([first], iterator)

    def _graph_for(self, mode, element_spec, first_element):
        graph = self._graphs.get(mode)
        if graph is None or graph.element_spec != element_spec:
            graph = _ModeGraph(self._call_model_fn, mode, element_spec, first_element)
            self._graphs[mode] = graph
        return graph

    def _call_model_fn(self, features, labels, mode):
        if labels is not None and "labels" not in self._model_fn_arguments:
            raise ValueError("model_fn takes no `labels` argument, but input_fn's elements are (features, labels)")
        available = {"features": features, "labels": labels, "mode": mode, "params": self._params,
                     "config": self._config}
        spec = self._model_fn(**{name: available[name] for name in self._model_fn_arguments})
        if not isinstance(spec, EstimatorSpec):
            raise TypeError(f"model_fn must return a kerasdist.estimator.EstimatorSpec; got {type(spec).__name__}")
        if spec.mode != mode:
            raise ValueError(f"model_fn was called in mode {mode!r} but returned an EstimatorSpec for mode "
                             f"{spec.mode!r}; pass the mode it got to EstimatorSpec")
        return spec

    def _restore(self, graph, checkpoint_path, what):
        """Rank 0 loads a checkpoint into `graph`, then every rank takes rank 0's state (also
        when there is no checkpoint: the replicas start equal). A collective."""
        path = on_root_for_every_rank(lambda: self._load_on_root(graph, checkpoint_path), ROOT_RANK)
        if self._size > 1:
            ops.broadcast_variables(graph.state_variables, root_rank=ROOT_RANK)
        if self._is_root:
            if path is not None:
                _logger.info("Restored from %s (global step %d) for %s", path, int(graph.global_step.numpy()), what)
            elif what != "training":
                warnings.warn(f"kerasdist.estimator: no checkpoint in {self.model_dir!r}; {what} with the "
                              "initial weights", stacklevel=3)
        return path

    def _load_on_root(self, graph, checkpoint_path):
        path = checkpoint_path or (tf.train.latest_checkpoint(self.model_dir) if self.model_dir else None)
        if path is None:
            return None
        status = graph.checkpoint.restore(path)
        if graph.mode != ModeKeys.TRAIN:
            status.expect_partial()  # the optimizer's state is not needed
        status.assert_existing_objects_matched()
        return path

    def _export_on_root(self, path, checkpoint_path):
        if self._features_spec is None:
            raise ValueError("export_model needs the structure of the features: call train, evaluate or predict "
                             "with this Estimator first")
        graph = self._graph_for(ModeKeys.PREDICT, self._features_spec, None)
        loaded = self._load_on_root(graph, checkpoint_path)
        if loaded is None:
            raise ValueError(f"export_model: no checkpoint in {self.model_dir!r}; train first or pass checkpoint_path")
        if path.endswith(".keras"):
            graph.spec.model.save(path)
        else:
            graph.spec.model.export(path, verbose=False)
        _logger.info("Exported %s (global step %d) to %s", loaded, int(graph.global_step.numpy()), path)

    # Summaries (rank 0)

    def _log_evaluation(self, results, name):
        _logger.info("Evaluation at global step %d: %s", results["global_step"],
                     ", ".join(f"{key} = {value}" for key, value in results.items() if key != "global_step"))
        scalars = {key: value for key, value in results.items() if key != "global_step" and np.ndim(value) == 0}
        directory = os.path.join(self.model_dir, "eval" if name is None else f"eval_{name}")
        self._write_scalars(directory, results["global_step"], scalars)

    def _write_scalars(self, directory, step, scalars):
        if not scalars:
            return
        writer = self._summary_writers.get(directory)
        if writer is None:
            writer = self._summary_writers[directory] = tf.summary.create_file_writer(directory)
        with writer.as_default(step=step):
            for name, value in scalars.items():
                tf.summary.write(name, tf.constant(value, tf.float32), metadata=_SCALAR_SUMMARY)
        writer.flush()


def train_and_evaluate(estimator, train_spec, eval_spec):
    """Trains, evaluating every `eval_spec.every_n_steps` steps and at the end. A collective.

    Like TF1's local `train_and_evaluate`: one training run over `train_spec.input_fn`, with an
    evaluation on `eval_spec.input_fn` after each checkpoint at the evaluation steps, and a final
    one (unless the last step was just evaluated). Here every rank trains and every rank
    evaluates its shard; there are no separate chief, worker or evaluator tasks, and no
    `TF_CONFIG`.

    Args:
        estimator: An `Estimator`.
        train_spec: A `TrainSpec`.
        eval_spec: An `EvalSpec`.

    Returns:
        The result dict of the last evaluation (TF1 returned it with export results, which do
        not exist here).

    Example:

    ```python
    from kerasdist import estimator

    # model_fn, train_input_fn and eval_input_fn as for Estimator.
    classifier = estimator.Estimator(model_fn, config=estimator.RunConfig(save_checkpoints_steps=100))
    metrics = estimator.train_and_evaluate(classifier,
                                           estimator.TrainSpec(train_input_fn, max_steps=500),
                                           estimator.EvalSpec(eval_input_fn))
    ```
    """
    if not isinstance(estimator, Estimator):
        raise TypeError(f"estimator must be a kerasdist.estimator.Estimator; got {type(estimator).__name__}")
    if not isinstance(train_spec, TrainSpec):
        raise TypeError(f"train_spec must be a TrainSpec; got {type(train_spec).__name__}")
    if not isinstance(eval_spec, EvalSpec):
        raise TypeError(f"eval_spec must be an EvalSpec; got {type(eval_spec).__name__}")
    evaluations = []

    def evaluate():
        evaluations.append(estimator.evaluate(eval_spec.input_fn, steps=eval_spec.steps, name=eval_spec.name))

    every = eval_spec.every_n_steps or estimator.config.save_checkpoints_steps
    final_step = estimator._train(train_spec.input_fn, None, train_spec.max_steps, list(train_spec.callbacks),
                                  evaluate_every=every, evaluate=evaluate)
    if not evaluations or evaluations[-1]["global_step"] != final_step:
        evaluate()
    return evaluations[-1]


class _VariablesByCreationOrder:
    """The variables `model_fn` created on its eager run, handed out again, in the same order,
    to the Keras objects its traced run creates.

    `tf.function` may not create variables after its first trace, and many Keras objects
    (optimizers) cannot create theirs inside one at all; reusing by position is what
    `tf.compat.v1.make_template` did for TF1 layers.
    """

    def __init__(self):
        self.variables = []
        self._initial_values = []
        self._position = 0

    @contextlib.contextmanager
    def recording(self):
        def record(next_creator, **kwargs):
            variable = next_creator(**kwargs)
            self.variables.append(variable)
            self._initial_values.append(variable.read_value())
            return variable

        with tf.variable_creator_scope(record):
            yield

    def restore_initial_values(self):
        """Undoes what the eager run changed: batch-norm statistics, metric counts, seeds."""
        for variable, value in zip(self.variables, self._initial_values):
            variable.assign(value)
        self._initial_values = []

    @contextlib.contextmanager
    def reusing(self):
        self._position = 0

        def reuse(next_creator, **kwargs):
            del next_creator  # nothing new is created
            if self._position == len(self.variables):
                raise ValueError(f"model_fn created more variables when traced than on its eager run "
                                 f"({len(self.variables)}): it must create the same Keras objects, in the same "
                                 "order, every time it runs in one mode")
            variable = self.variables[self._position]
            dtype = kwargs.get("dtype")
            if dtype is not None and tf.as_dtype(dtype).base_dtype != variable.dtype.base_dtype:
                raise ValueError(f"model_fn created its variables in a different order when traced: variable "
                                 f"#{self._position} ({kwargs.get('name')!r}) is {tf.as_dtype(dtype).name}, but on "
                                 f"the eager run it was {variable.name!r} ({variable.dtype.name}); create the same "
                                 "Keras objects in the same order every time")
            self._position += 1
            return variable

        with tf.variable_creator_scope(reuse):
            yield


class _ModeGraph:
    """One mode's built model: the eager spec, its variables, checkpoint and traced step."""

    def __init__(self, call_model_fn, mode, element_spec, first_element):
        self.mode = mode
        self.element_spec = element_spec
        self._call_model_fn = call_model_fn
        self._variables = _VariablesByCreationOrder()
        element = first_element if first_element is not None else _empty_batch(element_spec)
        with self._variables.recording():
            self.spec = call_model_fn(*_features_and_labels(element), mode)
        _check_trainables_are_in_model(self._variables.variables, self.spec.model)
        self._variables.restore_initial_values()

        self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        self.state_variables = [v for v in self.spec.model.variables if not v.path.endswith("seed_generator_state")]
        saved = {"model": self.spec.model, "global_step": self.global_step}
        self.optimizer = self.loss_mean = None
        if mode == ModeKeys.TRAIN:
            optimizer = self.spec.optimizer
            if not isinstance(optimizer, DistributedOptimizer):
                optimizer = DistributedOptimizer(optimizer)
            self.optimizer = optimizer
            self.optimizer.build(self.spec.model.trainable_variables)
            self.state_variables += list(self.optimizer.variables)
            saved["optimizer"] = self.optimizer
        elif mode == ModeKeys.EVAL:
            self.loss_mean = keras.metrics.Mean(name="loss")
        self.state_variables.append(self.global_step)
        self.checkpoint = tf.train.Checkpoint(**saved)
        step = {ModeKeys.TRAIN: self._train_step, ModeKeys.EVAL: self._eval_step,
                ModeKeys.PREDICT: self._predict_step}[mode]
        self.step_function = tf.function(step, input_signature=[element_spec])
        # Trace now, so that a model_fn that builds differently when traced fails here, on
        # every rank (also on one without data) and before any collective.
        self.step_function.get_concrete_function()

    def _traced_spec(self, element):
        features, labels = _features_and_labels(element)
        with self._variables.reusing():
            spec = self._call_model_fn(features, labels, self.mode)
        _check_same_objects(spec, self.spec)
        return spec

    def _train_step(self, element):
        with tf.GradientTape() as tape:
            spec = self._traced_spec(element)
            scaled_loss = self.optimizer.scale_loss(spec.loss)  # loss scaling, as Keras's train_step does
        self._apply_gradients(tape.gradient(scaled_loss, spec.model.trainable_variables), spec)
        return spec.loss

    @tf.autograph.experimental.do_not_convert
    def _apply_gradients(self, gradients, spec):
        # The eager optimizer serves the traced model too: Keras keys optimizer slots by the
        # underlying tf.Variable, which both models share.
        self.optimizer.apply(gradients, spec.model.trainable_variables)
        self.global_step.assign_add(1)

    def _eval_step(self, element):
        spec = self._traced_spec(element)
        self._add_loss(spec.loss, element)

    @tf.autograph.experimental.do_not_convert
    def _add_loss(self, loss, element):
        # Weighted by batch size, so the mean is over examples however the ranks batch them.
        features, labels = _features_and_labels(element)
        first = tf.nest.flatten(features if labels is None else labels)[0]
        self.loss_mean.update_state(loss, sample_weight=tf.cast(tf.shape(first)[0], loss.dtype))

    def _predict_step(self, element):
        return self._traced_spec(element).predictions


class _Rank0Saver:
    """Saves the training state on rank 0 by step count or by rank 0's clock; no collective."""

    def __init__(self, graph, config, saved_step):
        self._manager = tf.train.CheckpointManager(graph.checkpoint, config.model_dir,
                                                   max_to_keep=config.keep_checkpoint_max,
                                                   checkpoint_name=CHECKPOINT_NAME)
        self._every_steps = config.save_checkpoints_steps
        self._every_secs = config.checkpoint_interval_secs
        self._last_step = saved_step
        self._last_time = time.monotonic()

    def save_if_due(self, step, force=False):
        if step == self._last_step:
            return
        due = (force or (self._every_steps is not None and step % self._every_steps == 0)
               or (self._every_secs is not None and time.monotonic() - self._last_time >= self._every_secs))
        if not due:
            return
        path = self._manager.save(checkpoint_number=step)
        self._last_step, self._last_time = step, time.monotonic()
        _logger.info("Saved checkpoint for step %d: %s", step, path)


class _StepClock:
    def __init__(self, step):
        self._step, self._time = step, time.monotonic()

    def steps_per_second(self, step):
        now = time.monotonic()
        rate = (step - self._step) / max(now - self._time, 1e-9)
        self._step, self._time = step, now
        return rate


def _accepted_arguments(function, known, what):
    """The names in `known` that `function` declares; an error for any other required argument."""
    if not callable(function):
        raise TypeError(f"{what} must be callable; got {type(function).__name__}")
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError) as error:
        raise TypeError(f"cannot read the arguments of {what} {function!r}") from error
    accepted = []
    for parameter in parameters:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.name in known:
            accepted.append(parameter.name)
        elif parameter.default is parameter.empty:
            raise ValueError(f"{what} has an argument {parameter.name!r} that the Estimator cannot fill; it passes "
                             f"{', '.join(known)} by name")
    return accepted


def _features_and_labels(element):
    """An input element is `(features, labels)` or `features` alone, as in TF1."""
    if isinstance(element, tuple) and len(element) == 2:
        return element
    return element, None


def _empty_batch(element_spec):
    """Zeros shaped like one batch with no rows, to build a model on a rank that has no data."""

    def zeros(spec):
        if not isinstance(spec, tf.TensorSpec):
            raise TypeError(f"kerasdist.estimator: this rank's input is empty, and a model cannot be built from an "
                            f"empty {type(spec).__name__}; give every rank at least one batch")
        return tf.zeros([0 if size is None else size for size in spec.shape], spec.dtype)

    return tf.nest.map_structure(zeros, element_spec)


def _check_trainables_are_in_model(created, model):
    owned = {id(_backing(v)) for v in model.trainable_variables}
    strays = [v.name for v in created if v.trainable and id(v) not in owned]
    if strays:
        raise ValueError(f"model_fn created trainable variables that are not in EstimatorSpec.model: {strays}. Put "
                         "every layer model_fn trains into the model it returns, so that it is trained, "
                         "checkpointed and exported")


def _check_same_objects(traced, built):
    """The traced run must have got each variable its eager twin had (same shapes)."""
    if len(traced.model.variables) != len(built.model.variables):
        raise ValueError(f"model_fn built a model with {len(traced.model.variables)} variables when traced but "
                         f"{len(built.model.variables)} on its eager run; it must build the same model every time")
    for variable in traced.model.variables + [v for m in traced.eval_metrics.values() for v in m.variables]:
        if tuple(variable.shape) != tuple(_backing(variable).shape):
            raise ValueError(f"model_fn created its variables in a different order when traced: {variable.path} "
                             f"has shape {tuple(variable.shape)} but received a variable of shape "
                             f"{tuple(_backing(variable).shape)}; create the same Keras objects in the same order "
                             "every time")


def _backing(variable):
    """The tf.Variable behind a Keras variable."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def _batches_every_rank_has(dataset):
    """The number of batches every rank can take (`math.inf`: all inputs are infinite), or
    None when some rank cannot count its input. A collective."""
    counts = ops.allgather_object(int(dataset.cardinality()))
    if tf.data.UNKNOWN_CARDINALITY in counts:
        return None
    finite = [count for count in counts if count != tf.data.INFINITE_CARDINALITY]
    if len(set(finite)) > 1 and runtime.state().rank == ROOT_RANK:
        _logger.warning("The ranks' inputs hold different numbers of batches (%s); every rank trains on %d of them, "
                        "so that all run the same steps", counts, min(finite))
    return min(finite) if finite else math.inf


def _together(elements, count, check_each_step):
    """Yields elements while every rank has one, `count` at most (None: no limit).

    Every training step allreduces gradients, so all ranks must stop at the same step. With
    counts agreed beforehand no check is needed; otherwise the ranks agree before each step.
    """
    taken = 0
    while count is None or taken < count:
        element = next(elements, None)
        if check_each_step:
            have = ops.allreduce(tf.constant(0 if element is None else 1, tf.int32), op=ops.Min)
            if int(have) == 0:
                return
        elif element is None:
            return
        yield element
        taken += 1


def _sum_over_ranks(metrics):
    """Gives every metric the sum of its state over ranks: the state one process that had seen
    every rank's batches would hold (see kerasdist.callbacks.MetricAverage)."""
    variables = [v for metric in metrics for v in metric.variables]
    if runtime.state().size == 1 or not variables:
        return
    for variable, total in zip(variables, ops.grouped_allreduce([v.value for v in variables], op=ops.Sum)):
        variable.assign(total)


def _to_python(value):
    value = np.asarray(value)
    return value.item() if value.ndim == 0 else value


def _predictions(graph, elements, yield_single_examples):
    for element in elements:
        batch = tf.nest.map_structure(lambda tensor: tensor.numpy(), graph.step_function(element))
        if not yield_single_examples:
            yield batch
            continue
        rows = {np.shape(value)[0] if np.ndim(value) else None for value in tf.nest.flatten(batch)}
        if len(rows) != 1 or None in rows:
            raise ValueError(f"predict: to yield single examples every prediction needs the same first (batch) "
                             f"dimension; got {sorted(rows, key=str)}. Pass yield_single_examples=False")
        for row in range(rows.pop()):
            yield tf.nest.map_structure(lambda value, row=row: value[row], batch)
