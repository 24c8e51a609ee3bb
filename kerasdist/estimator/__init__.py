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

from kerasdist.estimator.config import EvalSpec, RunConfig, TrainSpec
from kerasdist.estimator.estimator import Estimator, train_and_evaluate
from kerasdist.estimator.inputs import InputContext
from kerasdist.estimator.spec import EstimatorSpec, ModeKeys

__all__ = [
    "EstimatorSpec",
    "Estimator",
    "EvalSpec",
    "InputContext",
    "ModeKeys",
    "RunConfig",
    "TrainSpec",
    "train_and_evaluate",
]

# Users import these from here: here is where they are documented, shown and pickled from.
for _name in __all__:
    if globals()[_name].__module__.startswith(f"{__name__}."):  # ours; InputContext is TensorFlow's
        globals()[_name].__module__ = __name__
del _name
