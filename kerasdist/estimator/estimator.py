"""`Estimator` and `train_and_evaluate`: the training loop, evaluation, prediction and export."""

import atexit
import itertools
import logging
import math
import os
import shutil
import tempfile
import time
import warnings

import numpy as np
import tensorflow as tf

from kerasdist import data, ops, replicas, runtime
from kerasdist.coordination import metric_states_summed_over_ranks, on_root_for_every_rank
from kerasdist.estimator.config import ROOT_RANK, EvalSpec, RunConfig, TrainSpec, _check_count
from kerasdist.estimator.graph import _ModeGraph
from kerasdist.estimator.inputs import (
    InputContext,
    _accepted_arguments,
    _batches_every_rank_has,
    _features_and_labels,
    _together,
)
from kerasdist.estimator.rank0 import _Rank0Saver, _ScalarWriters, _without_tensorflow_info
from kerasdist.estimator.spec import EstimatorSpec, ModeKeys

_logger = logging.getLogger(__package__)  # "kerasdist.estimator", as RunConfig documents


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
            `None`: the config's, or a new temporary directory, deleted when the program exits.
        config: A `RunConfig`.
        params: A dict handed to `model_fn` and `input_fn` as `params`.

    Example:

    ```python
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

    classifier = estimator.Estimator(model_fn, params={"batch_size": 32})  # a temporary model_dir
    classifier.train(lambda params: input_fn(params).repeat(), steps=100)
    print(classifier.evaluate(input_fn))  # {'loss': ..., 'accuracy': ..., 'global_step': 100}
    first = next(classifier.predict(input_fn))  # {'class': ...}
    ```
    """

    def __init__(self, model_fn, model_dir=None, config=None, params=None):
        self._model_fn_arguments = _accepted_arguments(
            model_fn, ("features", "labels", "mode", "params", "config"), "model_fn"
        )
        if "features" not in self._model_fn_arguments:
            raise ValueError(
                "model_fn must take an argument named `features` (and, as needed, labels, mode, params, config)"
            )
        config = RunConfig() if config is None else config
        if not isinstance(config, RunConfig):
            raise TypeError(f"config must be a kerasdist.estimator.RunConfig; got {type(config).__name__}")
        if model_dir is not None:
            model_dir = os.fspath(model_dir)
            if config.model_dir is not None and config.model_dir != model_dir:
                raise ValueError(
                    f"model_dir={model_dir!r} differs from config.model_dir={config.model_dir!r}; "
                    "give one, or the same in both"
                )
        else:
            model_dir = config.model_dir
        world = runtime.state()
        self._rank, self._size = world.rank, world.size
        self._is_root = world.rank == ROOT_RANK
        if model_dir is None and self._is_root:
            model_dir = tempfile.mkdtemp(prefix="kerasdist_estimator_")
            # No one else knows this directory, so it is not left behind.
            atexit.register(shutil.rmtree, model_dir, ignore_errors=True)
            _logger.info("Using a temporary model directory, deleted at exit: %s", model_dir)
        self._config = config.replace(model_dir=model_dir)
        self._model_fn = model_fn
        self._params = dict(params or {})
        self._graphs = {}  # mode -> _ModeGraph, reused while the input's structure stays the same
        self._features_spec = None  # of the latest input, for export_model
        self._scalar_writers = _ScalarWriters()

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

        Example:

        ```python
        import keras, numpy as np, tensorflow as tf
        from kerasdist import estimator

        def model_fn(features, labels, mode):
            model = keras.Sequential([keras.layers.Dense(1)])
            predictions = model(features)
            if mode == estimator.ModeKeys.PREDICT:
                return estimator.EstimatorSpec(mode, predictions={"y": predictions}, model=model)
            loss = tf.reduce_mean(tf.square(predictions - labels))
            return estimator.EstimatorSpec(mode, loss=loss, optimizer=keras.optimizers.SGD(0.1), model=model)

        x, y = np.ones((64, 2), "float32"), np.full((64, 1), 3.0, "float32")

        def input_fn():
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)

        regressor = estimator.Estimator(model_fn)  # a temporary model_dir
        regressor.train(lambda: input_fn().repeat(), steps=30)
        regressor.train(lambda: input_fn().repeat(), max_steps=30)  # already there: returns at once
        print(regressor.evaluate(input_fn)["global_step"])  # 30
        ```
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

        Example:

        ```python
        import keras, numpy as np, tensorflow as tf
        from kerasdist import estimator

        def model_fn(features, labels, mode):
            model = keras.Sequential([keras.layers.Dense(1)])
            predictions = model(features)
            if mode == estimator.ModeKeys.PREDICT:
                return estimator.EstimatorSpec(mode, predictions={"y": predictions}, model=model)
            loss = tf.reduce_mean(tf.square(predictions - labels))
            return estimator.EstimatorSpec(mode, loss=loss, optimizer=keras.optimizers.SGD(0.1), model=model)

        x, y = np.ones((64, 2), "float32"), np.full((64, 1), 3.0, "float32")

        def input_fn():
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)

        regressor = estimator.Estimator(model_fn)  # a temporary model_dir
        regressor.train(lambda: input_fn().repeat(), steps=50)
        metrics = regressor.evaluate(input_fn)
        print(sorted(metrics))  # ['global_step', 'loss']
        print(metrics["loss"] < 0.01)  # True
        ```
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
        with metric_states_summed_over_ranks(metrics):
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

        Example:

        ```python
        import keras, numpy as np, tensorflow as tf
        from kerasdist import estimator

        def model_fn(features, labels, mode):
            model = keras.Sequential([keras.layers.Dense(1)])
            predictions = model(features)
            if mode == estimator.ModeKeys.PREDICT:
                return estimator.EstimatorSpec(mode, predictions={"y": predictions}, model=model)
            loss = tf.reduce_mean(tf.square(predictions - labels))
            return estimator.EstimatorSpec(mode, loss=loss, optimizer=keras.optimizers.SGD(0.1), model=model)

        x, y = np.ones((64, 2), "float32"), np.full((64, 1), 3.0, "float32")

        def input_fn():
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)

        regressor = estimator.Estimator(model_fn)  # a temporary model_dir
        regressor.train(lambda: input_fn().repeat(), steps=50)
        first = next(regressor.predict(lambda: tf.data.Dataset.from_tensor_slices(x).batch(8)))
        print(round(float(first["y"][0]), 1))  # 3.0
        ```
        """
        dataset, first, elements = self._input(input_fn, ModeKeys.PREDICT)
        graph = self._graph_for(ModeKeys.PREDICT, dataset.element_spec, first)
        self._restore(graph, checkpoint_path, what="predicting")
        return _predictions(graph, elements, yield_single_examples)

    def latest_checkpoint(self):
        """The newest checkpoint in `model_dir` (as rank 0 sees it), or `None`. A collective.

        Example:

        ```python
        import keras, numpy as np, tensorflow as tf
        from kerasdist import estimator

        def model_fn(features, labels, mode):
            model = keras.Sequential([keras.layers.Dense(1)])
            predictions = model(features)
            if mode == estimator.ModeKeys.PREDICT:
                return estimator.EstimatorSpec(mode, predictions={"y": predictions}, model=model)
            loss = tf.reduce_mean(tf.square(predictions - labels))
            return estimator.EstimatorSpec(mode, loss=loss, optimizer=keras.optimizers.SGD(0.1), model=model)

        x, y = np.ones((64, 2), "float32"), np.full((64, 1), 3.0, "float32")

        def input_fn():
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)

        regressor = estimator.Estimator(model_fn)  # a temporary model_dir
        print(regressor.latest_checkpoint())  # None
        regressor.train(lambda: input_fn().repeat(), steps=10)
        print(regressor.latest_checkpoint().endswith("-10"))  # True
        ```
        """
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

        Example:

        ```python
        import os, tempfile
        import keras, numpy as np, tensorflow as tf
        from kerasdist import estimator

        def model_fn(features, labels, mode):
            model = keras.Sequential([keras.layers.Dense(1)])
            predictions = model(features)
            if mode == estimator.ModeKeys.PREDICT:
                return estimator.EstimatorSpec(mode, predictions={"y": predictions}, model=model)
            loss = tf.reduce_mean(tf.square(predictions - labels))
            return estimator.EstimatorSpec(mode, loss=loss, optimizer=keras.optimizers.SGD(0.1), model=model)

        x, y = np.ones((64, 2), "float32"), np.full((64, 1), 3.0, "float32")

        def input_fn():
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)

        regressor = estimator.Estimator(model_fn)  # a temporary model_dir
        regressor.train(lambda: input_fn().repeat(), steps=10)
        path = regressor.export_model(os.path.join(tempfile.mkdtemp(), "regressor.keras"))
        print(path.endswith("regressor.keras"))  # True
        ```
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
        if runtime.state().knobs.replica_check != "off":
            # After the save: a run that diverged keeps rank 0's work, and is not resumed silently.
            replicas.check_replicas(graph.spec.model, graph.optimizer, when=f"at the end of train() (step {step})")
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
        self._scalar_writers.write(self.model_dir, step, scalars)

    # Building, restoring, input

    def _input(self, input_fn, mode):
        """(dataset, its first element or None, an iterator over all its elements)."""
        accepted = _accepted_arguments(input_fn, ("params", "mode", "config", "input_context"), "input_fn")
        available = {
            "params": self._params,
            "mode": mode,
            "config": self._config,
            "input_context": InputContext(
                num_input_pipelines=self._size, input_pipeline_id=self._rank, num_replicas_in_sync=self._size
            ),
        }
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
        available = {
            "features": features,
            "labels": labels,
            "mode": mode,
            "params": self._params,
            "config": self._config,
        }
        spec = self._model_fn(**{name: available[name] for name in self._model_fn_arguments})
        if not isinstance(spec, EstimatorSpec):
            raise TypeError(f"model_fn must return a kerasdist.estimator.EstimatorSpec; got {type(spec).__name__}")
        if spec.mode != mode:
            raise ValueError(
                f"model_fn was called in mode {mode!r} but returned an EstimatorSpec for mode "
                f"{spec.mode!r}; pass the mode it got to EstimatorSpec"
            )
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
                warnings.warn(
                    f"kerasdist.estimator: no checkpoint in {self.model_dir!r}; {what} with the initial weights",
                    stacklevel=3,
                )
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
            raise ValueError(
                "export_model needs the structure of the features: call train, evaluate or predict "
                "with this Estimator first"
            )
        graph = self._graph_for(ModeKeys.PREDICT, self._features_spec, None)
        loaded = self._load_on_root(graph, checkpoint_path)
        if loaded is None:
            raise ValueError(f"export_model: no checkpoint in {self.model_dir!r}; train first or pass checkpoint_path")
        with _without_tensorflow_info():
            if path.endswith(".keras"):
                graph.spec.model.save(path)
            else:
                graph.spec.model.export(path, verbose=False)
        _logger.info("Exported %s (global step %d) to %s", loaded, int(graph.global_step.numpy()), path)

    # Summaries (rank 0)

    def _log_evaluation(self, results, name):
        _logger.info(
            "Evaluation at global step %d: %s",
            results["global_step"],
            ", ".join(f"{key} = {value}" for key, value in results.items() if key != "global_step"),
        )
        scalars = {key: value for key, value in results.items() if key != "global_step" and np.ndim(value) == 0}
        directory = os.path.join(self.model_dir, "eval" if name is None else f"eval_{name}")
        self._scalar_writers.write(directory, results["global_step"], scalars)


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
    import keras
    import numpy as np
    import tensorflow as tf
    from kerasdist import estimator

    x = np.random.default_rng(0).normal(size=(256, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")

    def model_fn(features, labels, mode):
        model = keras.Sequential([keras.layers.Dense(2)])
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, model(features), from_logits=True))
        return estimator.EstimatorSpec(mode, loss=loss, optimizer=keras.optimizers.SGD(0.1), model=model)

    def train_input_fn():
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32)

    def eval_input_fn():
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(32)

    classifier = estimator.Estimator(model_fn, config=estimator.RunConfig(save_checkpoints_steps=100))
    metrics = estimator.train_and_evaluate(classifier,
                                           estimator.TrainSpec(train_input_fn, max_steps=200),
                                           estimator.EvalSpec(eval_input_fn))  # evaluates at steps 100 and 200
    print(metrics["global_step"])  # 200
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
    final_step = estimator._train(
        train_spec.input_fn,
        None,
        train_spec.max_steps,
        list(train_spec.callbacks),
        evaluate_every=every,
        evaluate=evaluate,
    )
    if not evaluations or evaluations[-1]["global_step"] != final_step:
        evaluate()
    return evaluations[-1]


class _StepClock:
    def __init__(self, step):
        self._step, self._time = step, time.monotonic()

    def steps_per_second(self, step):
        now = time.monotonic()
        rate = (step - self._step) / max(now - self._time, 1e-9)
        self._step, self._time = step, now
        return rate


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
            raise ValueError(
                f"predict: to yield single examples every prediction needs the same first (batch) "
                f"dimension; got {sorted(rows, key=str)}. Pass yield_single_examples=False"
            )
        for row in range(rows.pop()):
            yield tf.nest.map_structure(lambda value, row=row: value[row], batch)
