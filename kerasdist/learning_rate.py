"""The learning rate of a distributed run: how it scales with the batch, and reading and setting it.

The global batch of one update is (per-rank batch) × ranks × k, with k the micro-batches each
rank accumulates (`DistributedOptimizer`'s `backward_passes_per_step`) and ranks the planned
ones (`kerasdist.planned_size()`: the job's size, unless a restart left it fewer, whose ranks
then accumulate for the missing ones). `batch_multiple` is that ranks × k; `scaling_factor` is
the rule by which the rate follows a larger batch (Goyal et al. 2017 for "linear"). The warmup
and schedule callbacks and adaptive batch growth all use these.
"""

import math

import keras

from kerasdist import _compat, runtime

SCALINGS = ("linear", "sqrt", "none")


def check_scaling(scaling, argument="scaling"):
    """Raises a ValueError naming `argument` unless `scaling` is one of `SCALINGS`.

    Example:

    ```python
    from kerasdist.learning_rate import check_scaling
    check_scaling("sqrt")  # one of SCALINGS: nothing happens
    try:
        check_scaling("quadratic", argument="lr_scaling")
    except ValueError as error:
        print(error)  # lr_scaling='quadratic'; expected one of ('linear', 'sqrt', 'none')
    ```
    """
    if scaling not in SCALINGS:
        raise ValueError(f"{argument}={scaling!r}; expected one of {SCALINGS}")


def scaling_factor(batch_factor, scaling):
    """What the learning rate is multiplied by when the batch is multiplied by `batch_factor`.

    "linear" gives `batch_factor`, "sqrt" its square root, "none" 1.

    Example:

    ```python
    from kerasdist.learning_rate import scaling_factor
    print(scaling_factor(4, "linear"), scaling_factor(4, "sqrt"), scaling_factor(4, "none"))  # 4 2.0 1.0
    ```
    """
    check_scaling(scaling)
    return {"linear": batch_factor, "sqrt": math.sqrt(batch_factor), "none": 1.0}[scaling]


def batch_multiple(backward_passes_per_step=1):
    """Planned ranks × `backward_passes_per_step`: how many per-rank micro-batches one update
    averages.

    The planned ranks are `kerasdist.planned_size()`, so the multiple stays the same when a job
    restarts on fewer ranks that accumulate for the missing ones.

    Example:

    ```python
    import kerasdist
    from kerasdist.learning_rate import batch_multiple
    kerasdist.init()
    print(batch_multiple(4) == 4 * kerasdist.planned_size())  # True
    ```
    """
    return runtime.state().planned_size * backward_passes_per_step


def batch_scale(optimizer, scaling):
    """How many times the single-worker batch the global batch is, after `scaling`.

    The factor is `batch_multiple` of the optimizer's `backward_passes_per_step` (1 for an
    optimizer that does not accumulate), passed through `scaling_factor`.

    Example:

    ```python
    import keras
    import kerasdist
    from kerasdist.learning_rate import batch_scale
    kerasdist.init()
    optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    print(batch_scale(optimizer, "linear") == 2 * kerasdist.planned_size())  # True
    print(batch_scale(optimizer, "none"))  # 1.0
    ```
    """
    return scaling_factor(batch_multiple(getattr(optimizer, "backward_passes_per_step", 1)), scaling)


def innermost_optimizer(optimizer):
    """Looks through wrappers (`DistributedOptimizer`, `LossScaleOptimizer`) to the optimizer that
    owns the update rule.

    Example:

    ```python
    import keras
    import kerasdist
    from kerasdist.learning_rate import innermost_optimizer
    sgd = keras.optimizers.SGD(0.1)
    print(innermost_optimizer(kerasdist.DistributedOptimizer(sgd)) is sgd)  # True
    print(innermost_optimizer(sgd) is sgd)  # True
    ```
    """
    while hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    return optimizer


def _velocities(optimizer):
    """State variables into which the optimizer multiplies the learning rate (SGD's and LARS's
    momentum), or [] when the rate is applied afresh each step (Adam, LAMB, plain SGD)."""
    inner = innermost_optimizer(optimizer)
    found = getattr(inner, "momentums", None) or getattr(inner, "_velocities", None) or []
    return [v for v in found if v is not None]


def current_learning_rate(optimizer):
    """The optimizer's rate as a float; a `LearningRateSchedule` object is refused (it cannot be set).

    Example:

    ```python
    import keras
    import kerasdist
    from kerasdist.learning_rate import current_learning_rate
    optimizer = kerasdist.DistributedOptimizer(keras.optimizers.Adam(0.05))
    print(round(current_learning_rate(optimizer), 6))  # 0.05
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=100, decay_rate=0.5)
    try:
        current_learning_rate(keras.optimizers.SGD(schedule))
    except ValueError as error:
        print(error)  # the optimizer's learning rate is a LearningRateSchedule object, ...
    ```
    """
    if isinstance(
        _compat.learning_rate_object(innermost_optimizer(optimizer)), keras.optimizers.schedules.LearningRateSchedule
    ):
        raise ValueError(
            "the optimizer's learning rate is a LearningRateSchedule object, which a callback "
            "cannot set; give the optimizer a float rate"
        )
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def set_learning_rate(optimizer, new_lr, momentum_correction=True):
    """Sets the rate; with `momentum_correction`, rescales SGD-like velocities by new/old rate.

    SGD's velocity holds lr·g terms: rescaling it applies the new rate to the past gradients
    too, instead of a jump that momentum would smear over many steps (Goyal et al. 2017).

    Example:

    ```python
    import keras
    import numpy as np
    from kerasdist.learning_rate import current_learning_rate, set_learning_rate
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    weight = keras.Variable([1.0])
    optimizer.apply([keras.ops.ones([1])], [weight])  # the velocity now holds -0.1 * gradient
    set_learning_rate(optimizer, 0.05)
    print(round(current_learning_rate(optimizer), 6))  # 0.05
    print(np.round(keras.ops.convert_to_numpy(optimizer.momentums[0]), 6))  # [-0.05]
    ```
    """
    old_lr = current_learning_rate(optimizer)
    if new_lr == old_lr:
        return
    if momentum_correction and old_lr > 0:
        for velocity in _velocities(optimizer):
            velocity.assign(velocity * (new_lr / old_lr))
    optimizer.learning_rate = new_lr
