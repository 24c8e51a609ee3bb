"""Gradients applied one update late, so that their allreduce overlaps the next step."""

import tensorflow as tf

from kerasdist import ops
from kerasdist.reductions.allreduce import Allreduce, compression_name
from kerasdist.reductions.base import GradientReduction


class Delayed(GradientReduction):
    """Each update applies the gradients of the update before it (reduced while this step
    computed), and keeps this step's for the next.

    The allreduce depends on nothing the step computes, so inside a `tf.function` it runs during
    the forward and backward pass instead of after them. The first update applies nothing; the
    held gradients are optimizer state, saved and restored with it. A staleness of one step, as
    in pipelined ("one-step-delayed") SGD. `DistributedOptimizer(..., delay_gradients=True)` is
    this reduction.

    Args:
        compression: the wire format of the held gradients, as for `Allreduce`.

    Example:

    ```python
    import keras, numpy as np, tensorflow as tf, kerasdist
    kerasdist.init()
    optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(1.0), reduction=kerasdist.reductions.Delayed())
    w = keras.Variable(np.zeros(2, np.float32))
    optimizer.apply([tf.constant([1.0, 2.0])], [w])
    print(w.numpy().tolist())  # [0.0, 0.0]
    optimizer.apply([tf.constant([5.0, 5.0])], [w])
    print(w.numpy().tolist())  # [-1.0, -2.0]
    ```
    """

    keeps_gradients_across_updates = True
    densifies_sparse_gradients = True  # the held gradients are dense variables

    def __init__(self, compression=ops.Compression.none):
        self._allreduce = Allreduce(compression)

    @property
    def compression(self):
        return self._allreduce.compression

    def build(self, optimizer, variables):
        self.held = [optimizer.add_variable_from_reference(v, name="delayed_gradient") for v in variables]
        self.holding = optimizer.add_variable(shape=(), dtype="int32", name="delayed_gradients_held")

    def per_rank_variables(self):
        return self.held

    def reduce(self, gradients, variables, op):
        """The gradients held since the last update, reduced; `gradients` are held in their place.

        The held values are read before these are stored (program order on the same variables),
        and their allreduce waits for nothing the step computes."""
        held = self.slots(self.held, variables)
        reduced = self._allreduce.reduce([tf.convert_to_tensor(h) for h in held], variables, op)
        for gradient, h in zip(gradients, held):
            h.assign(tf.convert_to_tensor(gradient))
        self.holding.assign(1)
        return reduced

    def reduce_and_apply(self, gradients, variables, op, apply):
        held_before = self.holding > 0  # read before reduce() marks this update's gradients held
        reduced = self.reduce(gradients, variables, op)
        tf.cond(held_before, lambda: apply(reduced), lambda: None)

    def get_config(self):
        return {"compression": compression_name(self.compression)}
