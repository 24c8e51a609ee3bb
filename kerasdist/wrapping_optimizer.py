"""What an optimizer that wraps another shares: the wrapped one's rate, step count and state."""

import keras


class WrappingOptimizer(keras.optimizers.Optimizer):
    """Base of optimizers that change the gradients and hand them to `inner_optimizer`, as
    `keras.optimizers.LossScaleOptimizer` does: `LARC` and `kerasdist.DistributedOptimizer`.

    The learning rate, `iterations` (the updates made) and loss scaling are the inner
    optimizer's. `variables` lists the wrapper's own, then the inner optimizer's; each saves
    its own state (the inner one as a child object). TensorFlow backend only.
    """

    def __init__(self, inner_optimizer, name):
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def _apply_arguments(self, grads, trainable_variables):
        """`(grads, trainable_variables)` of an `apply()` as lists of one length, after
        building the optimizer at its first call."""
        if not self.built:
            if trainable_variables is None:
                raise ValueError("pass trainable_variables to the first apply() (or build the optimizer)")
            with keras.name_scope(self.name, caller=self):
                self.build(list(trainable_variables))
        trainable_variables = list(self._trainable_variables if trainable_variables is None else trainable_variables)
        grads = list(grads)
        if len(grads) != len(trainable_variables):
            raise ValueError(f"got {len(grads)} gradients for {len(trainable_variables)} variables")
        return grads, trainable_variables

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError(f"{type(self).__name__} runs on the TensorFlow backend only (no stateless_apply)")

    def save_own_variables(self, store):
        for i, variable in enumerate(self._variables):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store):
        for i, variable in enumerate(self._variables):
            variable.assign(store[str(i)])
