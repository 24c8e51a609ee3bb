"""LAMB: Adam with a layer-wise trust ratio (You et al. 2019, Algorithm 2)."""

import keras
from keras import ops

from kerasdist.optimizers import trust_ratio as tr
from kerasdist.optimizers.layer_adaptive import LayerAdaptiveOptimizer


@keras.saving.register_keras_serializable(package="kerasdist")
class LAMB(LayerAdaptiveOptimizer):
    """Layer-wise Adaptive Moments for Batch training (LAMB), Algorithm 2 of arXiv 1904.00962.

    For each variable `w` with gradient `g` at step `t` (from 1), learning rate `η_t` and weight
    decay `λ`:

    ```
    m ← β₁·m + (1 − β₁)·g          v ← β₂·v + (1 − β₂)·g²
    m̂ = m / (1 − β₁ᵗ)              v̂ = v / (1 − β₂ᵗ)        (m̂ = m, v̂ = v without bias correction)
    r = m̂ / (√v̂ + ε)               u = r + λ·w
    w ← w − η_t · (‖w‖ / ‖u‖) · u   (ratio 1 when ‖w‖ = 0 or ‖u‖ = 0, optionally clipped)
    ```

    A variable excluded from layer adaptation uses ratio 1 (an AdamW-like step with coupled
    `λ·w`); one excluded from weight decay uses `λ = 0`. By default every variable with
    `ndim <= 1` (biases, normalisation parameters) is excluded from both.

    How this differs from `keras.optimizers.Lamb` (Keras >= 3.5): Keras applies decoupled weight
    decay to `w` before the update and computes the ratio as `‖w‖ / ‖r‖`, leaving `λ·w` out of
    the norm, so with weight decay on it is not the paper's LAMB; it also has no exclusion from
    layer adaptation, no bias-correction switch and no ratio clamp. Here `λ·w` is part of `u`, as in
    the paper, and the base optimizer's decoupled `weight_decay` is kept off (`self.weight_decay`
    is `None`; the rate is `self.weight_decay_rate`) so decay is not applied twice.

    Options from other implementations: `bias_correction=False` matches Google's BERT/ALBERT
    LAMB; `trust_ratio_clip=(0.01, 10.0)` matches DeepSpeed's clamp (the 1.0 of a zero norm is
    not clipped).

    The ratio each adapted variable last used is readable with `trust_ratios()` (see
    `kerasdist.callbacks.TrustRatioLogger`).

    Args:
        learning_rate: Float, `keras.optimizers.schedules.LearningRateSchedule`, or a callable.
            Defaults to 0.001.
        beta_1: Float in `[0, 1)`, decay of the first moment. Defaults to 0.9.
        beta_2: Float in `[0, 1)`, decay of the second moment. Defaults to 0.999.
        epsilon: Float `> 0` added to `√v̂`. Defaults to 1e-6 (the paper's; Keras's `Lamb` uses
            1e-7).
        weight_decay: Float `>= 0`, `λ`. Defaults to 0.01.
        bias_correction: Whether to divide the moments by `1 − βᵗ`. Defaults to `True`.
        trust_ratio_clip: `None` or a pair `(lo, hi)` with `0 <= lo <= hi` to clip the ratio to.
            Defaults to `None`.
        exclude_from_weight_decay: `None`, a regex, or a list of regexes searched for in
            `variable.path` (e.g. `"LayerNorm"`, `"dense_1/kernel"`): matching variables get
            `λ = 0`.
        exclude_from_layer_adaptation: Same form; matching variables get ratio 1.
        exclude_biases_and_norms: Whether variables with `ndim <= 1` are excluded from both.
            Defaults to `True`.
        name: Defaults to `"lamb"`.
        **kwargs: Base optimizer arguments: `clipnorm`, `clipvalue`, `global_clipnorm`,
            `use_ema`, `ema_momentum`, `ema_overwrite_frequency`, `loss_scale_factor`,
            `gradient_accumulation_steps`.

    Example:

    ```python
    import keras
    import numpy as np
    from kerasdist.optimizers import LAMB

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=LAMB(learning_rate=1e-3, trust_ratio_clip=(0.01, 10.0)), loss="mse")
    model.fit(np.ones((16, 4)), np.ones((16, 1)), epochs=1, verbose=0)
    print(model.optimizer.trust_ratios())  # {'sequential/dense/kernel': ..., ...}
    ```

    References:
        - You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
          arXiv 1904.00962 (2019), Algorithm 2.
    """

    def __init__(
        self,
        learning_rate=0.001,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-6,
        weight_decay=0.01,
        bias_correction=True,
        trust_ratio_clip=None,
        exclude_from_weight_decay=None,
        exclude_from_layer_adaptation=None,
        exclude_biases_and_norms=True,
        name="lamb",
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
        for arg_name, beta in (("beta_1", beta_1), ("beta_2", beta_2)):
            if not 0.0 <= float(beta) < 1.0:
                raise ValueError(f"`{arg_name}` must be in [0, 1); got {beta}.")
        if float(epsilon) <= 0:
            raise ValueError(f"`epsilon` must be > 0; got {epsilon}.")
        self.beta_1 = float(beta_1)
        self.beta_2 = float(beta_2)
        self.epsilon = float(epsilon)
        self.bias_correction = bool(bias_correction)
        self.trust_ratio_clip = tr.validate_clip(trust_ratio_clip)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._first_moments, self._second_moments = self.add_optimizer_variables(
            var_list, ["first_moment", "second_moment"]
        )

    def update_step(self, gradient, variable, learning_rate):
        dtype = variable.dtype
        lr = tr.to_dtype(learning_rate, dtype)
        g = tr.dense_gradient(gradient, dtype)
        decay, trust_ratio_slot = self._layer_settings(variable)
        index = self._get_variable_index(variable)
        m = self._first_moments[index]
        v = self._second_moments[index]
        beta_1 = tr.to_dtype(self.beta_1, dtype)
        beta_2 = tr.to_dtype(self.beta_2, dtype)

        new_m = beta_1 * m + (1 - beta_1) * g
        new_v = beta_2 * v + (1 - beta_2) * ops.square(g)
        self.assign(m, new_m)
        self.assign(v, new_v)
        if self.bias_correction:
            step_count = tr.to_dtype(self.iterations + 1, dtype)
            new_m = new_m / (1 - ops.power(beta_1, step_count))
            new_v = new_v / (1 - ops.power(beta_2, step_count))
        update = new_m / (ops.sqrt(new_v) + tr.to_dtype(self.epsilon, dtype))
        if decay:
            update = update + tr.to_dtype(decay, dtype) * variable

        if trust_ratio_slot is not None:
            ratio = tr.trust_ratio(tr.l2_norm(variable), tr.l2_norm(update), clip=self.trust_ratio_clip)
            self.assign(trust_ratio_slot, ratio)
            update = ratio * update
        self.assign_sub(variable, lr * update)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "beta_1": self.beta_1,
                "beta_2": self.beta_2,
                "epsilon": self.epsilon,
                "bias_correction": self.bias_correction,
                "trust_ratio_clip": None if self.trust_ratio_clip is None else list(self.trust_ratio_clip),
            }
        )
        return config
