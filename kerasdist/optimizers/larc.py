"""LARC: LARS's layer-wise trust ratio on top of any Keras optimizer."""

import keras
from keras import ops

from kerasdist import _compat
from kerasdist.optimizers import trust_ratio as tr
from kerasdist.wrapping_optimizer import WrappingOptimizer

_MODES = ("clip", "scale")


@keras.saving.register_keras_serializable(package="kerasdist")
class LARC(WrappingOptimizer):
    """Layer-wise Adaptive Rate Control: wraps any optimizer and scales each layer's gradient by
    a trust ratio, in the "clip" or "scale" mode of NVIDIA Apex's LARC.

    For each variable `w` with gradient `g`, trust coefficient `η`, weight decay `β` and the inner
    optimizer's current learning rate `γ`:

    ```
    λ = η·‖w‖ / (‖g‖ + β·‖w‖ + ε)              (the layer's own rate)
    clip:   g' = min(λ / γ, 1) · (g + β·w)      the layer moves at rate min(λ, γ)
    scale:  g' = λ · (g + β·w)                  it moves at rate λ·γ, as in LARS
    ```

    and the inner optimizer applies `g'` (its momentum, Adam moments, clipping and decoupled
    weight decay as usual). "clip" never lets a layer move faster than the global rate, which
    is what makes a large warmed-up rate safe for layers whose weights are small against their
    gradients; "scale" is LARS's rule on top of any update. A variable whose `‖w‖` or `‖g‖` is 0
    (a zero-initialised layer, a vanished gradient), or that is excluded, keeps `g` unchanged:
    no adaptation and no `β`. By default every variable with `ndim <= 1` (biases,
    normalisation parameters) is excluded, as in `LARS`.

    Wrapped by `kerasdist.DistributedOptimizer` (`DistributedOptimizer(LARC(SGD(...)))`), the
    ratio is computed from the averaged gradient, so it is the same on every rank.

    Args:
        optimizer: the optimizer to wrap (a `keras.optimizers.Optimizer`, or a name such as "sgd").
        trust_coefficient: Float `> 0`, `η`. Defaults to 0.02 (Apex's default).
        mode: "clip" (default) or "scale".
        weight_decay: Float `>= 0`, `β`, coupled into `g'` and the ratio. Defaults to 0. Leave the
            inner optimizer's own (decoupled) `weight_decay` unset unless you want both.
        epsilon: Float `>= 0` added to the ratio's denominator. Defaults to 1e-8.
        exclude_from_layer_adaptation: `None`, a regex, or a list of regexes searched for in
            `variable.path`: matching variables keep `g` unchanged.
        exclude_biases_and_norms: Whether every variable with `ndim <= 1` is excluded. Defaults
            to True.
        name: Defaults to `"larc_" + optimizer.name`.

    The ratio `λ` each adapted variable last used is readable with `trust_ratios()`.

    Example:

    ```python
    import keras
    import numpy as np
    from kerasdist.optimizers import LARC

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=LARC(keras.optimizers.SGD(0.5, momentum=0.9)), loss="mse")
    model.fit(np.ones((16, 4)), np.ones((16, 1)), epochs=1, verbose=0)
    print(sorted(model.optimizer.trust_ratios()))  # ['sequential/dense/kernel', 'sequential/dense_1/kernel']
    ```

    References:
        - You, Gitman, Ginsburg, "Large Batch Training of Convolutional Networks",
          arXiv 1708.03888 (2017): the trust ratio.
        - NVIDIA Apex, `apex.parallel.LARC`: the clip and scale modes around any optimizer.
    """

    def __init__(
        self,
        optimizer,
        trust_coefficient=0.02,
        mode="clip",
        weight_decay=0.0,
        epsilon=1e-8,
        exclude_from_layer_adaptation=None,
        exclude_biases_and_norms=True,
        name=None,
    ):
        if not isinstance(optimizer, (str, dict, keras.optimizers.Optimizer)):
            raise TypeError(f"LARC(optimizer={optimizer!r}): expected a keras.optimizers.Optimizer to wrap")
        optimizer = keras.optimizers.get(optimizer)
        if mode not in _MODES:
            raise ValueError(f"LARC(mode={mode!r}): expected 'clip' or 'scale'")
        if float(trust_coefficient) <= 0:
            raise ValueError(f"`trust_coefficient` must be > 0; got {trust_coefficient}.")
        if float(weight_decay) < 0:
            raise ValueError(f"`weight_decay` must be >= 0; got {weight_decay}.")
        if float(epsilon) < 0:
            raise ValueError(f"`epsilon` must be >= 0; got {epsilon}.")
        super().__init__(optimizer, name=name or f"larc_{optimizer.name}")
        self.trust_coefficient = float(trust_coefficient)
        self.mode = mode
        self.weight_decay_rate = float(weight_decay)
        self.epsilon = float(epsilon)
        self.layer_adaptation_exclusions = tr.compile_patterns(
            exclude_from_layer_adaptation, "exclude_from_layer_adaptation"
        )
        self.exclude_biases_and_norms = bool(exclude_biases_and_norms)

    @_compat.no_automatic_dependency_tracking
    def build(self, var_list):
        if self.built:
            return
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        super().build(var_list)
        self._adapted = [
            not tr.is_excluded(v, self.layer_adaptation_exclusions, self.exclude_biases_and_norms) for v in var_list
        ]
        # One slot per variable, excluded ones included (they stay at 1), as in LARS: the saved
        # state does not depend on which paths the patterns match.
        self._trust_ratio_slots = [
            self.add_variable(
                shape=(), initializer="ones", dtype=v.dtype, name=f"{tr.variable_path(v).replace('/', '_')}_trust_ratio"
            )
            for v in var_list
        ]

    def apply(self, grads, trainable_variables=None):
        grads, trainable_variables = self._apply_arguments(grads, trainable_variables)
        # The rate the inner optimizer is about to use (a schedule at its current step).
        rate = self.inner_optimizer.learning_rate
        adapted = [g if g is None else self._adapted_gradient(g, v, rate) for g, v in zip(grads, trainable_variables)]
        self.inner_optimizer.apply(adapted, trainable_variables)

    def _adapted_gradient(self, gradient, variable, rate):
        index = self._get_variable_index(variable)
        if not self._adapted[index]:
            return gradient
        dtype = variable.dtype
        g = tr.dense_gradient(gradient, dtype)
        decay = tr.to_dtype(self.weight_decay_rate, dtype)
        w_norm, g_norm = tr.l2_norm(variable), tr.l2_norm(g)
        ratio = tr.trust_ratio(
            w_norm,
            g_norm,
            denominator=g_norm + decay * w_norm + tr.to_dtype(self.epsilon, dtype),
            coefficient=self.trust_coefficient,
        )
        self._trust_ratio_slots[index].assign(ratio)
        both_nonzero = ops.logical_and(ops.greater(w_norm, 0), ops.greater(g_norm, 0))
        if self.mode == "clip":
            factor = ops.minimum(ratio / tr.to_dtype(rate, dtype), ops.ones_like(ratio))
        else:
            factor = ratio
        return ops.where(both_nonzero, factor * (g + decay * variable), g)

    def trust_ratios(self):
        """Returns `{variable.path: float}`: the ratio `λ` each adapted variable last used (1.0
        until its first update, or when its `‖w‖` or `‖g‖` was 0). Read eagerly.

        Example:

        ```python
        import keras, numpy as np
        from kerasdist.optimizers import LARC
        kernel = keras.Variable(np.full((2, 2), 3.0, "float32"), name="kernel")  # ‖w‖ = 6
        bias = keras.Variable(np.zeros(2, "float32"), name="bias")  # ndim 1: excluded
        larc = LARC(keras.optimizers.SGD(0.1), trust_coefficient=0.01, epsilon=0.0)
        print(larc.trust_ratios())  # {}
        larc.apply([np.full((2, 2), 0.5, "float32"), np.ones(2, "float32")], [kernel, bias])  # ‖g‖ = 1
        print({path: round(ratio, 6) for path, ratio in larc.trust_ratios().items()})  # {'kernel': 0.06}
        ```
        """
        if not self.built:
            return {}
        return {
            tr.variable_path(v): float(slot.numpy())
            for v, slot, adapted in zip(self._trainable_variables, self._trust_ratio_slots, self._adapted)
            if adapted
        }

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "trust_coefficient": self.trust_coefficient,
            "mode": self.mode,
            "weight_decay": self.weight_decay_rate,
            "epsilon": self.epsilon,
            "exclude_from_layer_adaptation": list(self.layer_adaptation_exclusions),
            "exclude_biases_and_norms": self.exclude_biases_and_norms,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)
