"""Stop training, with the first difference named, when the ranks stop holding the same model."""

import keras

from kerasdist import _compat, ops, replicas, runtime, training_state
from kerasdist.callbacks.join import Join
from kerasdist.callbacks.model_averaging import ModelAveraging


class ReplicaCheck(keras.callbacks.Callback):
    """Checks that every rank holds the same model, and ends training with an error if not.

    Data parallelism is correct only while every rank holds the same weights, optimizer state,
    step count and learning rate. Whatever breaks that (a callback that acts on one rank's own
    metrics, a resume on some ranks only, a weight set on one rank, a model built differently)
    would otherwise leave each rank training a model of its own, with no error. This callback
    compares them exactly (`kerasdist.check_replicas`: one small allreduce, and one pass over the
    variables on each rank) when the first epoch starts (a resume on some ranks only shows as
    different epochs there), at every epoch end and when training ends, and, with
    `every_n_steps`, every so many steps too. On a difference it raises
    `kerasdist.ReplicaDivergenceError` on every rank, naming the first differing values and what
    each rank holds. Before training it refuses, on every rank, callbacks that would change the
    model from each rank's own metrics (`ReduceLROnPlateau`, `EarlyStopping(restore_best_weights=
    True)`) when the metrics are not averaged across ranks (no `MetricAverage`).

    `kerasdist.callbacks()` adds it, last, as `KERASDIST_REPLICA_CHECK` says (`epoch` by default).
    With `ModelAveraging` the ranks' models differ between averages by design: then only epoch
    ends are checked, and optimizer slots too only when they are averaged. With `Join` (uneven
    steps), steps are not checked either.

    Args:
        every_n_steps: also check every this many steps (batches); None (default): epochs only.
        per_rank: variables or `fnmatch` patterns of variable paths meant to differ between ranks
            (see `kerasdist.check_replicas`).
        on_divergence: "raise" (default) or "warn".

    Example:

    ```python
    import keras, kerasdist, numpy as np
    kerasdist.init()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    history = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=2, verbose=0,
                        callbacks=kerasdist.callbacks() + [kerasdist.callbacks.ReplicaCheck(every_n_steps=2)])
    ```
    """

    def __init__(self, every_n_steps=None, per_rank=(), on_divergence="raise"):
        super().__init__()
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)):
            raise ValueError(f"every_n_steps={every_n_steps!r}: expected a whole number of steps >= 1, or None")
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps!r}: expected a whole number of steps >= 1, or None")
        if on_divergence not in replicas.ON_DIVERGENCE:
            raise ValueError(f"on_divergence={on_divergence!r}: expected one of {', '.join(replicas.ON_DIVERGENCE)}")
        self.every_n_steps = every_n_steps
        self.per_rank = tuple(per_rank)
        self.on_divergence = on_divergence
        self._callbacks = None
        self._epoch = None
        self._steps = 0

    def set_model(self, model):
        super().set_model(model)
        self._callbacks = _compat.callbacks_setting_the_model() or []

    def on_train_begin(self, logs=None):
        self._epoch, self._steps = None, 0
        if runtime.state().size > 1:
            self._refuse_decisions_from_per_rank_metrics()

    def on_epoch_begin(self, epoch, logs=None):
        if self._epoch is None:
            self._check(epoch, f"when epoch {epoch + 1} started")
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1
        if self._checks_steps() and self._steps % self.every_n_steps == 0:
            self._check(self._epoch, f"after step {self._steps} of this fit")

    def on_epoch_end(self, epoch, logs=None):
        self._check(epoch, f"at the end of epoch {epoch + 1}")

    def on_train_end(self, logs=None):
        if self._epoch is not None:
            self._check(self._epoch, "when training ended")

    def _checks_steps(self):
        return self.every_n_steps is not None and not any(
            isinstance(callback, (Join, ModelAveraging)) for callback in self._callbacks
        )

    def _check(self, epoch, when):
        per_rank = self.per_rank
        averaging = [callback for callback in self._callbacks if isinstance(callback, ModelAveraging)]
        if any(not callback.average_optimizer_state for callback in averaging):
            # Each rank keeps its own optimizer slots; step counts and rates still agree.
            per_rank += tuple(
                variable
                for optimizer in training_state.optimizers_of(self.model)
                if optimizer.built
                for variable in optimizer.variables
                if variable is not optimizer.iterations
            )
        replicas.check_replicas(self.model, epoch=epoch, per_rank=per_rank, on_divergence=self.on_divergence, when=when)

    def _refuse_decisions_from_per_rank_metrics(self):
        """The same ValueError on every rank when a callback would change the model from metrics
        that are each rank's own: every rank would decide differently."""
        problem = None
        if not getattr(self.model, "_kerasdist_global_metrics", False):
            for callback in self._callbacks:
                change = _what_it_changes_from_metrics(callback)
                if change:
                    problem = _PER_RANK_DECISION.format(type(callback).__name__, change, callback.monitor)
                    break
        every_rank = ops.allgather_object(problem, name="kerasdist.replica_check.callbacks")
        named = [(rank, text) for rank, text in enumerate(every_rank) if text]
        if named:
            rank, text = named[0]
            raise ValueError(f"kerasdist: on rank {rank}, {text}")


_PER_RANK_DECISION = (
    "{} {} from '{}', but the metrics are each rank's own (no kerasdist.callbacks.MetricAverage: "
    "kerasdist.callbacks(average_metrics=False)), so each rank would decide differently and train its own "
    "model. Keep average_metrics=True (the default), or add kerasdist.callbacks.MetricAverage() to the callbacks."
)


def _what_it_changes_from_metrics(callback):
    if isinstance(callback, keras.callbacks.ReduceLROnPlateau):
        return "changes the learning rate"
    if isinstance(callback, keras.callbacks.EarlyStopping) and callback.restore_best_weights:
        return "restores the best epoch's weights (restore_best_weights=True)"
    return None
