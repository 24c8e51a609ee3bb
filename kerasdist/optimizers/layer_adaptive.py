"""The part of LARS and LAMB that is not their update rule.

Both take a weight-decay rate that enters the trust ratio (so Keras's own decoupled decay must stay
off), two exclusion lists, and record the last trust ratio of every adapted layer in an optimizer
variable so that it can be read after a `tf.function` step. `LayerAdaptiveOptimizer` holds that
once; `LARS` and `LAMB` add their slots in `build`, their rule in `update_step`, their keys in
`get_config`.
"""

import keras

from kerasdist.optimizers import trust_ratio as tr


class LayerAdaptiveOptimizer(keras.optimizers.Optimizer):
    """Base of optimizers that scale each layer's step by a trust ratio.

    Not used directly; see `LARS` and `LAMB`.

    Args:
        learning_rate: Float, `keras.optimizers.schedules.LearningRateSchedule`, or a callable.
        weight_decay: Float `>= 0`, the decay coefficient that enters the update direction and the
            trust ratio. Kept in `self.weight_decay_rate`; Keras's base `weight_decay` (decoupled
            decay applied before `update_step`) is always `None` here so decay is not applied
            twice.
        exclude_from_weight_decay: `None`, a regex, or a list of regexes searched for in
            `variable.path` (not anchored on the model name, which a reload can drop); matching
            variables get no weight decay. Keras's
            `optimizer.exclude_from_weight_decay(var_list=..., var_names=...)` is honoured as well
            when called before the optimizer is built.
        exclude_from_layer_adaptation: Same form; matching variables get a trust ratio of 1.
            `None` does not copy `exclude_from_weight_decay` (unlike TF Model Garden's LAMB).
        exclude_biases_and_norms: Whether every variable with `ndim <= 1` (biases, normalisation
            scales and offsets) is excluded from both weight decay and layer adaptation.
        name: Name of the optimizer's variables' scope.
        **kwargs: The other base optimizer arguments (`clipnorm`, `global_clipnorm`, `use_ema`,
            `gradient_accumulation_steps`, ...).
    """

    def __init__(
        self,
        learning_rate,
        weight_decay,
        exclude_from_weight_decay,
        exclude_from_layer_adaptation,
        exclude_biases_and_norms,
        name,
        **kwargs,
    ):
        super().__init__(learning_rate=learning_rate, weight_decay=None, name=name, **kwargs)
        weight_decay = 0.0 if weight_decay is None else float(weight_decay)
        if weight_decay < 0:
            raise ValueError(f"`weight_decay` must be >= 0; got {weight_decay}.")
        self.weight_decay_rate = weight_decay
        self.weight_decay_exclusions = tr.compile_patterns(exclude_from_weight_decay, "exclude_from_weight_decay")
        self.layer_adaptation_exclusions = tr.compile_patterns(
            exclude_from_layer_adaptation, "exclude_from_layer_adaptation"
        )
        self.exclude_biases_and_norms = bool(exclude_biases_and_norms)

    def build(self, var_list):
        """Decides per variable its decay rate and adaptation, and adds the trust-ratio slots."""
        if self.built:
            return
        super().build(var_list)
        # Decided once in Python: paths and shapes are static, and update_step then branches in
        # Python rather than in the graph.
        self._decay_rates = [
            0.0
            if tr.is_excluded(v, self.weight_decay_exclusions, self.exclude_biases_and_norms)
            or not self._use_weight_decay(v)
            else self.weight_decay_rate
            for v in var_list
        ]
        self._adapted = [
            not tr.is_excluded(v, self.layer_adaptation_exclusions, self.exclude_biases_and_norms) for v in var_list
        ]
        # One slot per variable, excluded ones included (they stay at 1): the optimizer's
        # variable list then does not depend on the exclusions, so a saved state still loads when
        # the paths a pattern sees change (a reloaded Sequential drops its "sequential/" prefix).
        self._trust_ratio_slots = []
        for variable in var_list:
            if self._overwrite_variable_with_gradient(variable):
                self._trust_ratio_slots.append(None)
                continue
            self._trust_ratio_slots.append(
                self.add_variable(
                    shape=(),
                    initializer="ones",
                    dtype=variable.dtype,
                    name=f"{tr.variable_path(variable).replace('/', '_')}_trust_ratio",
                )
            )

    def trust_ratios(self):
        """Returns `{variable.path: float}`: the trust ratio each adapted layer last used.

        Variables excluded from layer adaptation (ratio always 1) are left out. Values are 1.0
        until the first update. Read eagerly, e.g. from a callback; empty before `build`.
        """
        if not self.built:
            return {}
        return {
            tr.variable_path(variable): float(slot.numpy())
            for variable, slot, adapted in zip(self._trainable_variables, self._trust_ratio_slots, self._adapted)
            if adapted and slot is not None
        }

    def _layer_settings(self, variable):
        """Returns `(decay_rate, trust_ratio_slot)` for `variable`; the slot is `None` when the
        variable is excluded from layer adaptation."""
        index = self._get_variable_index(variable)
        slot = self._trust_ratio_slots[index] if self._adapted[index] else None
        return self._decay_rates[index], slot

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "weight_decay": self.weight_decay_rate,
                "exclude_from_weight_decay": list(self.weight_decay_exclusions),
                "exclude_from_layer_adaptation": list(self.layer_adaptation_exclusions),
                "exclude_biases_and_norms": self.exclude_biases_and_norms,
            }
        )
        return config
