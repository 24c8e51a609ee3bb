"""Keras callbacks for distributed training.

`kerasdist.default_callbacks(...)` returns the list a script passes to `model.fit`; the classes
are importable from here. The package is callable as that function too, the spelling most
scripts use:

    model.fit(..., callbacks=kerasdist.default_callbacks(warmup_epochs=5))
    model.fit(..., callbacks=kerasdist.callbacks(warmup_epochs=5))  # the same list
    from kerasdist.callbacks import LearningRateWarmup
"""

import sys
import types

import keras

from kerasdist import runtime
from kerasdist.batch_growth import AdaptiveBatchGrowth
from kerasdist.callbacks.broadcast import BroadcastGlobalState
from kerasdist.callbacks.checkpoint import Rank0Checkpoint
from kerasdist.callbacks.join import Join
from kerasdist.callbacks.learning_rate import LearningRateMultiplier, LearningRateSchedule, LearningRateWarmup
from kerasdist.callbacks.metric_average import MetricAverage, local_metrics
from kerasdist.callbacks.model_averaging import ModelAveraging
from kerasdist.callbacks.progress import Rank0ProgbarLogger
from kerasdist.callbacks.replica_check import ReplicaCheck
from kerasdist.callbacks.stop_agreement import StopAgreement
from kerasdist.callbacks.trust_ratio_logger import TrustRatioLogger

__all__ = [
    "AdaptiveBatchGrowth",
    "BroadcastGlobalState",
    "Join",
    "LearningRateMultiplier",
    "LearningRateSchedule",
    "LearningRateWarmup",
    "MetricAverage",
    "ModelAveraging",
    "Rank0Checkpoint",
    "Rank0ProgbarLogger",
    "ReplicaCheck",
    "StopAgreement",
    "TrustRatioLogger",
    "default_callbacks",
    "local_metrics",
]


def default_callbacks(
    root_rank=0,
    average_metrics=True,
    warmup_epochs=0,
    scaling="linear",
    checkpoint_dir=None,
    resume=False,
    monitor="val_loss",
    save_best_only=False,
    tensorboard_dir=None,
    csv_path=None,
    batch_growth=None,
    uneven_steps=False,
    average_models_every=None,
    check_replicas=None,
    extra=(),
):
    """The callbacks a distributed `model.fit` needs, in the order they must run.

    Always: `BroadcastGlobalState` (everyone starts from `root_rank`'s state), `MetricAverage`
    (exact global logs), a progress bar shown by `root_rank` only, `StopAgreement` (when any
    rank stops training, every rank stops at the same batch) and, last, `ReplicaCheck` (every
    rank still holds the same model at each epoch end; an error naming the difference if not).
    On request: warmup, rank-0 checkpoints (with resume), and TensorBoard / CSV logs that only
    `root_rank` writes. Callbacks that read the logs come after `MetricAverage`, so they see
    global values.

    Args:
        root_rank: the rank that is broadcast from and that prints and writes. Defaults to 0.
        average_metrics: include `MetricAverage`. Defaults to True.
        warmup_epochs: > 0 adds `LearningRateWarmup(warmup_epochs, scaling)`.
        scaling: learning-rate scaling rule for the warmup: "linear", "sqrt" or "none".
        checkpoint_dir: adds `Rank0Checkpoint(checkpoint_dir, resume=..., monitor=...,
            save_best_only=...)`. With `resume=True` every rank must call this function (resume
            looks up the latest checkpoint collectively).
        tensorboard_dir: `keras.callbacks.TensorBoard(tensorboard_dir)` on `root_rank`.
        csv_path: `keras.callbacks.CSVLogger(csv_path)` on `root_rank`.
        batch_growth: an `AdaptiveBatchGrowth`, or a dict of its arguments, e.g.
            `dict(signal="noise_scale", batch_size=32, max_batch_size=1024)`.
        uneven_steps: adds `Join` after `BroadcastGlobalState`, so ranks may run different
            numbers of steps per epoch (shards of unequal size). Defaults to False: unequal
            steps are then an error on every rank before training.
        average_models_every: adds `ModelAveraging(average_models_every)` (local SGD: each
            rank trains alone and the ranks average their weights every so many steps; compile
            with the plain optimizer then, not `DistributedOptimizer`).
        check_replicas: when `ReplicaCheck` compares the ranks' models: "epoch" (at the start,
            every epoch end and the end), a number of steps N (also every N steps, to find where
            ranks start to differ), or "off". None (default): `KERASDIST_REPLICA_CHECK`, "epoch"
            unless set.
        extra: more callbacks, placed after the metric averaging and before the loggers. Put
            callbacks that may stop training (`TerminateOnNaN`, `EarlyStopping`) here, or before
            this list: `StopAgreement` must run after them.

    Example:

    ```python
    import keras, kerasdist, numpy as np
    kerasdist.init()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    history = model.fit(np.ones((8, 3)), np.ones((8, 1)), verbose=0,
                        callbacks=kerasdist.callbacks(warmup_epochs=1))
    ```
    """
    is_root = runtime.state().rank == root_rank
    callbacks = [BroadcastGlobalState(root_rank)]
    if uneven_steps:
        callbacks.append(Join())  # after the broadcast: a first step's late broadcast precedes joining
    if average_models_every is not None:
        callbacks.append(ModelAveraging(average_models_every))  # before anything that reads the model at epoch end
    if average_metrics:
        callbacks.append(MetricAverage())
    if warmup_epochs:
        callbacks.append(LearningRateWarmup(warmup_epochs, scaling=scaling))
    if batch_growth is not None:
        callbacks.append(
            batch_growth if isinstance(batch_growth, AdaptiveBatchGrowth) else AdaptiveBatchGrowth(**batch_growth)
        )
    callbacks.extend(extra)
    if checkpoint_dir is not None:
        callbacks.append(
            Rank0Checkpoint(
                checkpoint_dir, resume=resume, monitor=monitor, save_best_only=save_best_only, root_rank=root_rank
            )
        )
    if is_root and tensorboard_dir is not None:
        callbacks.append(keras.callbacks.TensorBoard(tensorboard_dir))
    if is_root and csv_path is not None:
        callbacks.append(keras.callbacks.CSVLogger(csv_path))
    callbacks.append(Rank0ProgbarLogger(root_rank))
    callbacks.append(StopAgreement())  # it must see every stop the callbacks before it set
    when = runtime.state().knobs.replica_check if check_replicas is None else check_replicas
    if when not in ("epoch", "off") and (isinstance(when, bool) or not isinstance(when, int) or when < 1):
        raise ValueError(f"check_replicas={check_replicas!r}: expected 'epoch', 'off' or a whole number of steps >= 1")
    if when != "off":
        # Last: it checks what every callback before it did at the epoch's end.
        callbacks.append(ReplicaCheck(every_n_steps=None if when == "epoch" else when))
    return callbacks


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return default_callbacks(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
