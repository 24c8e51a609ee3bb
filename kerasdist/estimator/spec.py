"""What `model_fn` returns: `ModeKeys` and `EstimatorSpec`, whose fields are checked as it is made."""

import collections

import keras
import tensorflow as tf

# Result names evaluate() reports itself; eval_metrics may not use them.
_RESERVED_METRIC_NAMES = ("loss", "global_step")


class ModeKeys:
    """The mode `model_fn` is called in: the same strings as `tf.estimator.ModeKeys`, so code
    that compares `mode` with them keeps working.

    Example:

    ```python
    from kerasdist.estimator import ModeKeys

    print(ModeKeys.TRAIN, ModeKeys.EVAL, ModeKeys.PREDICT)  # train eval infer
    ```
    """

    TRAIN = "train"
    EVAL = "eval"
    PREDICT = "infer"


_MODES = (ModeKeys.TRAIN, ModeKeys.EVAL, ModeKeys.PREDICT)


class EstimatorSpec(
    collections.namedtuple("EstimatorSpec", ["mode", "predictions", "loss", "optimizer", "eval_metrics", "model"])
):
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
            raise ValueError(
                f"EstimatorSpec: mode={mode!r} is not a ModeKeys value; expected ModeKeys.TRAIN "
                f"({ModeKeys.TRAIN!r}), ModeKeys.EVAL ({ModeKeys.EVAL!r}) or ModeKeys.PREDICT "
                f"({ModeKeys.PREDICT!r})"
            )
        _check_model(model)
        loss = _checked_loss(loss, mode)
        optimizer = _checked_optimizer(optimizer, mode)
        predictions = _checked_predictions(predictions, mode)
        eval_metrics = _checked_eval_metrics(eval_metrics)
        return super().__new__(cls, mode, predictions, loss, optimizer, eval_metrics, model)


def _check_model(model):
    if model is None:
        raise ValueError(
            "EstimatorSpec: model is missing. Return the keras.Model whose layers model_fn used "
            "(model=...): the Estimator trains, checkpoints and exports its variables"
        )
    if not isinstance(model, keras.Layer):
        raise TypeError(f"EstimatorSpec: model must be a keras.Model (or keras.Layer); got {type(model).__name__}")


def _checked_loss(loss, mode):
    if loss is None:
        if mode == ModeKeys.PREDICT:
            return None
        purpose = "minimize" if mode == ModeKeys.TRAIN else "evaluate"
        raise ValueError(
            f"EstimatorSpec: loss is missing in {mode} mode; return the scalar loss to {purpose} (loss=...)"
        )
    try:
        loss = tf.convert_to_tensor(loss)
    except (TypeError, ValueError) as error:
        raise TypeError(f"EstimatorSpec: loss must be a scalar tensor; got {type(loss).__name__}") from error
    if not loss.dtype.is_floating:
        raise TypeError(f"EstimatorSpec: loss must be a float tensor; got {loss.dtype.name}")
    if loss.shape.rank is None:
        return tf.reshape(loss, [])  # fails at run time unless it holds one value
    if loss.shape.rank != 0:
        raise ValueError(
            f"EstimatorSpec: loss must be a scalar; got shape {loss.shape}. Reduce it to one number, "
            "e.g. tf.reduce_mean(per_example_loss)"
        )
    return loss


def _checked_optimizer(optimizer, mode):
    if optimizer is None:
        if mode == ModeKeys.TRAIN:
            raise ValueError(
                "EstimatorSpec: optimizer is missing in train mode; return a Keras optimizer "
                "(optimizer=keras.optimizers.Adam(...)); the Estimator applies it, averaging the "
                "gradients across ranks"
            )
        return None
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"EstimatorSpec: optimizer must be a keras.optimizers.Optimizer; got "
            f"{type(optimizer).__name__} (for a name, use keras.optimizers.get({optimizer!r}))"
        )
    return optimizer


def _checked_predictions(predictions, mode):
    if predictions is None:
        if mode == ModeKeys.PREDICT:
            raise ValueError(
                "EstimatorSpec: predictions is missing in infer (PREDICT) mode; return a tensor or a "
                "dict of tensors (predictions=...)"
            )
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
        raise TypeError(
            f"EstimatorSpec: eval_metrics must be a dict of keras.metrics.Metric; got {type(eval_metrics).__name__}"
        )
    for name, metric in eval_metrics.items():
        if not isinstance(name, str) or name in _RESERVED_METRIC_NAMES:
            raise ValueError(
                f"EstimatorSpec: eval_metrics key {name!r} must be a string other than "
                f"{' and '.join(map(repr, _RESERVED_METRIC_NAMES))}, which evaluate() reports itself"
            )
        if not isinstance(metric, keras.metrics.Metric):
            raise TypeError(
                f"EstimatorSpec: eval_metrics[{name!r}] must be a keras.metrics.Metric updated in "
                f"model_fn; got {type(metric).__name__}. TF1 (value, update_op) pairs are not supported"
            )
    return dict(eval_metrics)
