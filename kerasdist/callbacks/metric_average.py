"""Exact global metrics: combine the metrics' sums and counts across ranks."""

import contextlib

import keras
import tensorflow as tf

from kerasdist import _compat, runtime, training_state
from kerasdist.coordination import metric_states_summed_over_ranks


def global_metrics_result(model, local_result, ran_steps=True):
    """`model.get_metrics_result()` as if one process had seen every rank's batches: computed
    with the metrics' state summed over ranks (see `metric_states_summed_over_ranks`), after
    which this rank's own state is put back. Works for every metric whose state variables add
    up across batches, which includes all of Keras's built-ins. A rank that ran no step
    (`ran_steps=False`: its shard was empty) adds nothing and reports the same result. Inside
    `local_metrics(model)` it is this rank's own result, with no collective (none after no step,
    as in Keras).
    """
    if getattr(model, "_kerasdist_local_metrics", False):
        return local_result() if ran_steps else {}
    if not ran_steps:
        # Keras reset the metrics before the loop, but its one call of the step that found no
        # batch still ran the updates that do not read the batch: each count grew by the
        # static batch size.
        for metric in model.metrics:
            metric.reset_state()
    try:
        with metric_states_summed_over_ranks(model.metrics):
            return local_result()
    except tf.errors.OpError as error:
        # The engine names it when ranks ran unequal numbers of steps; evaluating on some ranks
        # only is the other way to get here.
        unequal_steps = "different numbers of steps" in error.message
        advice = (
            ""
            if unequal_steps
            else "Once MetricAverage is attached (kerasdist.callbacks() attaches it in fit), every "
            "model.evaluate() of this model, and every end of a fit epoch, is a collective that "
            "every rank must call. To evaluate on one rank only (say under `if rank == 0:`), "
            "wrap the call: `with kerasdist.callbacks.local_metrics(model): model.evaluate(...)`. "
        )
        raise RuntimeError(
            f"kerasdist: combining the metrics of model '{model.name}' across ranks failed. {advice}"
            f"The engine said: {error.message}"
        ) from error


@contextlib.contextmanager
def local_metrics(model):
    """Inside, `model`'s metric results are this rank's own: no collective, so `model.evaluate`
    (or `fit`) may run on some ranks only, for instance rank 0 alone on a held-out set.

    Example:

    ```python
    import keras, kerasdist, numpy as np
    kerasdist.init()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", loss="mse")
    model.fit(np.ones((4, 3)), np.ones((4, 1)), verbose=0, callbacks=kerasdist.callbacks())
    if kerasdist.rank() == 0:
        with kerasdist.callbacks.local_metrics(model):
            print(model.evaluate(np.ones((2, 3)), np.ones((2, 1)), verbose=0) >= 0)  # True
    ```
    """
    previous = getattr(model, "_kerasdist_local_metrics", False)
    model._kerasdist_local_metrics = True
    try:
        yield model
    finally:
        model._kerasdist_local_metrics = previous


class MetricAverage(keras.callbacks.Callback):
    """Makes the metrics Keras reports at the end of an epoch and of `evaluate` global and exact.

    Each rank sees only its shard, so its loss and accuracy describe only that shard. With this
    callback the epoch logs (train and `val_` entries, hence `History`, `CSVLogger`,
    `TensorBoard`, checkpoints and early stopping) and the values `model.evaluate` returns are
    computed from the metrics' sums and counts over all ranks: equal on every rank and equal to
    what one process on the whole data would report, also when shards have unequal sizes or
    some are empty (a rank that ran no batch reports the same values under the same keys).
    Averaging per-rank averages would not be.

    How: once attached, the model's eager `get_metrics_result()` (what Keras calls at epoch end
    and at the end of `evaluate`) sums every metric state variable across ranks in one grouped
    allreduce. Per-batch values (the running numbers in the progress bar) stay this rank's own:
    reducing them every step would cost a collective per batch. The model stays attached after
    `fit`, so a later `model.evaluate()` is global too; every rank must then call it, unless it
    runs inside `local_metrics(model)` (an evaluation on rank 0 alone).

    Example:

    ```python
    import keras, kerasdist, numpy as np
    kerasdist.init()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", loss="mse", metrics=["mae"])
    history = model.fit(np.ones((4, 3)), np.ones((4, 1)), verbose=0,
                        callbacks=[kerasdist.callbacks.MetricAverage()])
    ```
    """

    def set_model(self, model):
        super().set_model(model)
        training_state.turn_off_xla(model)
        if runtime.state().size == 1 or getattr(model, "_kerasdist_global_metrics", False):
            return
        _compat.replace_metrics_result(
            model, lambda local_result, ran_steps: global_metrics_result(model, local_result, ran_steps)
        )
        model._kerasdist_global_metrics = True
