"""How `input_fn` and `model_fn` are called, and how many batches the ranks take together."""

import inspect
import logging
import math

import tensorflow as tf

from kerasdist import ops, runtime
from kerasdist.estimator.config import ROOT_RANK

_logger = logging.getLogger(__package__)  # "kerasdist.estimator", as RunConfig documents

# What input_fn receives: the class tf.distribute passes to dataset functions.
# num_input_pipelines is the number of ranks, input_pipeline_id this rank.
InputContext = tf.distribute.InputContext


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
            raise ValueError(
                f"{what} has an argument {parameter.name!r} that the Estimator cannot fill; it passes "
                f"{', '.join(known)} by name"
            )
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
            raise TypeError(
                f"kerasdist.estimator: this rank's input is empty, and a model cannot be built from an "
                f"empty {type(spec).__name__}; give every rank at least one batch"
            )
        return tf.zeros([0 if size is None else size for size in spec.shape], spec.dtype)

    return tf.nest.map_structure(zeros, element_spec)


def _batches_every_rank_has(dataset):
    """The number of batches every rank can take (`math.inf`: all inputs are infinite), or
    None when some rank cannot count its input. A collective."""
    counts = ops.allgather_object(int(dataset.cardinality()))
    if tf.data.UNKNOWN_CARDINALITY in counts:
        return None
    finite = [count for count in counts if count != tf.data.INFINITE_CARDINALITY]
    if len(set(finite)) > 1 and runtime.state().rank == ROOT_RANK:
        _logger.warning(
            "The ranks' inputs hold different numbers of batches (%s); every rank trains on %d of them, "
            "so that all run the same steps",
            counts,
            min(finite),
        )
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
