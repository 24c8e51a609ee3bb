"""Each mode's model: `model_fn` run once eagerly to create the variables, then traced with
`tf.function` reusing them, into one training, evaluation or prediction step."""

import contextlib

import keras
import tensorflow as tf

from kerasdist.distributed_optimizer import DistributedOptimizer
from kerasdist.estimator.inputs import _empty_batch, _features_and_labels
from kerasdist.estimator.spec import ModeKeys
from kerasdist.training_state import model_state_variables


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
                raise ValueError(
                    f"model_fn created more variables when traced than on its eager run "
                    f"({len(self.variables)}): it must create the same Keras objects, in the same "
                    "order, every time it runs in one mode"
                )
            variable = self.variables[self._position]
            dtype = kwargs.get("dtype")
            if dtype is not None and tf.as_dtype(dtype).base_dtype != variable.dtype.base_dtype:
                raise ValueError(
                    f"model_fn created its variables in a different order when traced: variable "
                    f"#{self._position} ({kwargs.get('name')!r}) is {tf.as_dtype(dtype).name}, but on "
                    f"the eager run it was {variable.name!r} ({variable.dtype.name}); create the same "
                    "Keras objects in the same order every time"
                )
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
        self.state_variables = model_state_variables(self.spec.model)  # what _restore broadcasts
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
        step = {ModeKeys.TRAIN: self._train_step, ModeKeys.EVAL: self._eval_step, ModeKeys.PREDICT: self._predict_step}[
            mode
        ]
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


def _check_trainables_are_in_model(created, model):
    owned = {id(_backing(v)) for v in model.trainable_variables}
    strays = [v.name for v in created if v.trainable and id(v) not in owned]
    if strays:
        raise ValueError(
            f"model_fn created trainable variables that are not in EstimatorSpec.model: {strays}. Put "
            "every layer model_fn trains into the model it returns, so that it is trained, "
            "checkpointed and exported"
        )


def _check_same_objects(traced, built):
    """The traced run must have got each variable its eager twin had (same shapes)."""
    if len(traced.model.variables) != len(built.model.variables):
        raise ValueError(
            f"model_fn built a model with {len(traced.model.variables)} variables when traced but "
            f"{len(built.model.variables)} on its eager run; it must build the same model every time"
        )
    for variable in traced.model.variables + [v for m in traced.eval_metrics.values() for v in m.variables]:
        if tuple(variable.shape) != tuple(_backing(variable).shape):
            raise ValueError(
                f"model_fn created its variables in a different order when traced: {variable.path} "
                f"has shape {tuple(variable.shape)} but received a variable of shape "
                f"{tuple(_backing(variable).shape)}; create the same Keras objects in the same order "
                "every time"
            )


def _backing(variable):
    """The tf.Variable behind a Keras variable."""
    return variable.value if isinstance(variable, keras.Variable) else variable
