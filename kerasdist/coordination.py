"""Collectives that keep the ranks in agreement, shared by the callbacks and the Estimator.

- `on_root_for_every_rank`: one rank acts (reads a file, loads a checkpoint), every rank learns
  the outcome, and an error there is raised on every rank instead of leaving the others waiting.
- `metric_states_summed_over_ranks`: metrics hold the sum of their state over ranks, the state
  one process that had seen every rank's batches would hold.
- `any_rank`: whether a flag is set on any rank.
- `notice_received`: whether any rank was given notice to leave, for a loop of one's own.

Equal step counts are agreed in `kerasdist.data.check_equal_steps`; what every rank must share
of a model is listed in `kerasdist.training_state`.
"""

import builtins
import contextlib
import socket
import sys

import tensorflow as tf

from kerasdist import knobs, ops, runtime
from kerasdist.notice import notice_state


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


def any_rank(flag, name):
    """Whether `flag` is true on any rank: the same answer on every rank, through the collective
    `name` (every rank calls it at the same point)."""
    # Sum, not Max: a rank that has joined (uneven steps) can still take part in a Sum.
    return bool(ops.allreduce(tf.constant(1.0 if flag else 0.0), op=ops.Sum, name=name).numpy() > 0)


def notice_received():
    """Whether any rank was given notice to leave: the same answer on every rank, for a training
    loop of your own (`fit` with `kerasdist.callbacks()` checks for you).

    A collective, as `allreduce` is: every rank calls it at the same point of its loop, e.g. after
    each update. Once it returns True (and on every later call), save a checkpoint on rank 0 and
    end every rank with status 75 (`raise SystemExit(75)`): `kerasdist-run --restarts N` starts
    the job again without counting a failure and, under `--min-np`, without the host given notice,
    which a rank given notice names on stderr the first time this returns True.

    Returns:
        bool: True when the notice signal (`KERASDIST_NOTICE_SIGNAL`, SIGUSR1 unless set) reached
        any rank since `kerasdist.init()`.

    Example:

    ```python
    import kerasdist
    kerasdist.init()
    print(kerasdist.notice_received())  # False
    for step in range(3):
        ...  # one update of your training step
        if kerasdist.notice_received():  # every rank, after each update
            if kerasdist.rank() == 0:
                model.save(f"checkpoints/step{step}.keras")
            raise SystemExit(75)
    ```
    """
    world = runtime.state()
    noticed_here = notice_state.received
    anywhere = noticed_here if world.size == 1 else any_rank(noticed_here, "kerasdist.notice_received")
    if noticed_here and not notice_state.announced:
        notice_state.announced = True
        print(knobs.NOTICE_LINE.format(rank=world.rank, host=socket.gethostname()), file=sys.stderr, flush=True)
    return anywhere
