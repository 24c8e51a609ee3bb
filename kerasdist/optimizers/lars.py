"""LARS: SGD with momentum and a layer-wise trust ratio (You, Gitman, Ginsburg 2017)."""

import keras

from kerasdist.optimizers import trust_ratio as tr
from kerasdist.optimizers.layer_adaptive import LayerAdaptiveOptimizer


@keras.saving.register_keras_serializable(package="kerasdist")
class LARS(LayerAdaptiveOptimizer):
    """Layer-wise Adaptive Rate Scaling (LARS), as in arXiv 1708.03888.

    For each variable `w` with gradient `g`, learning rate `γ_t`, weight decay `β`, trust
    coefficient `η` and momentum `m`:

    ```
    λ = η·‖w‖ / (‖g‖ + β·‖w‖ + ε)      (λ = 1 when ‖w‖ = 0 or ‖g‖ = 0)
    v ← m·v + γ_t·λ·(g + β·w)
    w ← w − v                          (nesterov: w ← w − (m·v + γ_t·λ·(g + β·w)))
    ```

    A variable excluded from layer adaptation uses `λ = 1` (a plain momentum-SGD step); one
    excluded from weight decay uses `β = 0`. By default every variable with `ndim <= 1` (biases,
    BatchNorm/LayerNorm scales and offsets) is excluded from both: a zero-initialised bias would
    otherwise get `λ = 1` while the kernels get `λ ≈ η`.

    Variants, and the choice made here: the denominator above is the paper's
    `‖g‖ + β‖w‖`. optax's `lars` and TF Model Garden's `LARS` use `‖g + βw‖` instead (equal when
    `g` and `w` point the same way, smaller otherwise); old `tf.contrib` LARS left weight decay to
    the loss (`β = 0` here, with the decay term in the loss). The learning rate multiplies into
    the velocity, like Keras's `SGD` and the paper, so a learning-rate change takes effect through
    the velocity's memory.

    `epsilon` defaults to 1e-9: zero norms are already handled by the `λ = 1` rule, so ε only
    guards a denominator that is tiny but non-zero, and at 1e-9 it does not change `λ` at any
    realistic float32 norm.

    Weight decay here is the coupled `β·w` of the paper; the base Keras optimizer's decoupled
    `weight_decay` is kept off (`self.weight_decay` is `None`, the rate is
    `self.weight_decay_rate`) so decay is not applied twice.

    The trust ratio `λ` each adapted variable last used is readable with `trust_ratios()` (see
    `kerasdist.callbacks.TrustRatioLogger`).

    Args:
        learning_rate: Float, `keras.optimizers.schedules.LearningRateSchedule`, or a callable
            returning the rate (the global `γ_t`). Defaults to 0.01.
        momentum: Float in `[0, 1)`. 0 disables the velocity. Defaults to 0.9.
        weight_decay: Float `>= 0`, `β`. Defaults to 1e-4.
        trust_coefficient: Float `> 0`, `η`. Defaults to 0.001.
        epsilon: Float `>= 0` added to the trust-ratio denominator. Defaults to 1e-9.
        nesterov: Whether to use Nesterov momentum. Defaults to `False`.
        exclude_from_weight_decay: `None`, a regex, or a list of regexes searched for in
            `variable.path` (e.g. `"dense_1/kernel"`, `"embedding"`): matching variables get
            `β = 0`.
        exclude_from_layer_adaptation: Same form; matching variables get `λ = 1`.
        exclude_biases_and_norms: Whether variables with `ndim <= 1` are excluded from both.
            Defaults to `True`.
        name: Defaults to `"lars"`.
        **kwargs: Base optimizer arguments: `clipnorm`, `clipvalue`, `global_clipnorm`,
            `use_ema`, `ema_momentum`, `ema_overwrite_frequency`, `loss_scale_factor`,
            `gradient_accumulation_steps`.

    Example:

    ```python
    import keras
    import numpy as np
    from kerasdist.optimizers import LARS

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=LARS(learning_rate=0.5, momentum=0.9), loss="mse")
    model.fit(np.ones((16, 4)), np.ones((16, 1)), epochs=1, verbose=0)
    print(model.optimizer.trust_ratios())  # {'sequential/dense/kernel': ..., 'sequential/dense_1/kernel': ...}
    ```

    References:
        - You, Gitman, Ginsburg, "Large Batch Training of Convolutional Networks",
          arXiv 1708.03888 (2017).
    """

    def __init__(
        self,
        learning_rate=0.01,
        momentum=0.9,
        weight_decay=1e-4,
        trust_coefficient=0.001,
        epsilon=1e-9,
        nesterov=False,
        exclude_from_weight_decay=None,
        exclude_from_layer_adaptation=None,
        exclude_biases_and_norms=True,
        name="lars",
        **kwargs,
    ):
        super().__init__(
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            exclude_from_weight_decay=exclude_from_weight_decay,
            exclude_from_layer_adaptation=exclude_from_layer_adaptation,
            exclude_biases_and_norms=exclude_biases_and_norms,
            name=name,
            **kwargs,
        )
        momentum = float(momentum)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"`momentum` must be in [0, 1); got {momentum}.")
        if float(trust_coefficient) <= 0:
            raise ValueError(f"`trust_coefficient` must be > 0; got {trust_coefficient}.")
        if float(epsilon) < 0:
            raise ValueError(f"`epsilon` must be >= 0; got {epsilon}.")
        if nesterov and momentum == 0.0:
            raise ValueError("`nesterov=True` needs `momentum` > 0.")
        self.momentum = momentum
        self.trust_coefficient = float(trust_coefficient)
        self.epsilon = float(epsilon)
        self.nesterov = bool(nesterov)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._velocities = []
        if self.momentum != 0.0:
            self._velocities = self.add_optimizer_variables(var_list, "velocity")

    def update_step(self, gradient, variable, learning_rate):
        dtype = variable.dtype
        lr = tr.to_dtype(learning_rate, dtype)
        g = tr.dense_gradient(gradient, dtype)
        decay, trust_ratio_slot = self._layer_settings(variable)

        direction = g + tr.to_dtype(decay, dtype) * variable if decay else g
        if trust_ratio_slot is not None:
            w_norm = tr.l2_norm(variable)
            g_norm = tr.l2_norm(g)
            ratio = tr.trust_ratio(
                w_norm,
                g_norm,
                denominator=g_norm + tr.to_dtype(decay, dtype) * w_norm + tr.to_dtype(self.epsilon, dtype),
                coefficient=self.trust_coefficient,
            )
            self.assign(trust_ratio_slot, ratio)
            step = lr * ratio * direction
        else:
            step = lr * direction

        if self.momentum == 0.0:
            self.assign_sub(variable, step)
            return
        m = tr.to_dtype(self.momentum, dtype)
        velocity = self._velocities[self._get_variable_index(variable)]
        new_velocity = m * velocity + step
        self.assign(velocity, new_velocity)
        if self.nesterov:
            self.assign_sub(variable, m * new_velocity + step)
        else:
            self.assign_sub(variable, new_velocity)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "momentum": self.momentum,
                "trust_coefficient": self.trust_coefficient,
                "epsilon": self.epsilon,
                "nesterov": self.nesterov,
            }
        )
        return config
