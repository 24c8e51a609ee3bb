"""Collectives that keep the ranks in agreement, shared by the callbacks and the Estimator.

- `on_root_for_every_rank`: one rank acts (reads a file, loads a checkpoint), every rank learns
  the outcome, and an error there is raised on every rank instead of leaving the others waiting.
- `metric_states_summed_over_ranks`: metrics hold the sum of their state over ranks, the state
  one process that had seen every rank's batches would hold.

Equal step counts are agreed in `kerasdist.data.check_equal_steps`; what every rank must share
of a model is listed in `kerasdist.training_state`.
"""

import builtins
import contextlib

import tensorflow as tf

from kerasdist import ops, runtime


def on_root_for_every_rank(function, root_rank, name=None):
    """Runs `function` on `root_rank` only; every rank returns its result, or raises its error.
    `name` names the collective that shares the outcome (as for `kerasdist.broadcast_object`)."""
    result, failure = None, None
    if runtime.state().rank == root_rank:
        try:
            result = function()
        except Exception as error:  # noqa: BLE001 - handed to every rank, then raised
            failure = error
    shared = ops.broadcast_object(
        (result, None if failure is None else (type(failure).__name__, str(failure))), root_rank, name=name
    )
    if failure is not None:
        raise failure
    result, failure_text = shared
    if failure_text is not None:
        raise _same_kind_of_error(*failure_text, root_rank)
    return result


def _same_kind_of_error(kind_name, message, root_rank):
    """The root's error for another rank: the same built-in type where possible, else RuntimeError."""
    message = f"{message} (raised on rank {root_rank})"
    kind = getattr(builtins, kind_name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(message)
        except TypeError:  # a type that takes other arguments (UnicodeDecodeError)
            pass
    return RuntimeError(f"{kind_name}: {message}")


@contextlib.contextmanager
def metric_states_summed_over_ranks(metrics):
    """Inside, every metric holds the sum of its state over ranks; afterwards its own again.

    Keras metrics keep additive state (a Mean keeps total and count; Precision keeps true and
    false positives; AUC keeps per-threshold counts), so the sum of each state variable over
    ranks is the state one process would have had after every rank's batches: `result()`
    inside is exact for the whole data, also when the ranks saw different numbers of examples.
    Averaging per-rank results would not be. A collective (one grouped allreduce); eager only.
    """
    variables = [v for metric in metrics for v in metric.variables]
    if runtime.state().size == 1 or not variables:
        yield
        return
    own_values = [tf.identity(v.value) for v in variables]
    summed = ops.grouped_allreduce(own_values, op=ops.Sum, name=None)
    try:
        for variable, total in zip(variables, summed):
            variable.assign(total)
        yield
    finally:
        for variable, own in zip(variables, own_values):
            variable.assign(own)
