"""The public base of the ways gradients can travel between ranks."""


class GradientReduction:
    """How a `kerasdist.DistributedOptimizer` combines each update's gradients across ranks.

    Pass one as `DistributedOptimizer(optimizer, reduction=...)`; the built-in ones are
    `kerasdist.reductions.Allreduce` (the default), `Delayed` and `OneBit`. To add a method,
    subclass this and override `reduce`; a method that keeps state from one update to the next
    (error feedback, held gradients) creates it in `build` with the optimizer's
    `add_variable...` methods, so that it is saved and restored with the optimizer, and lists in
    `per_rank_variables` the part of it that differs between ranks (`Rank0Checkpoint(resume=True)`
    saves every rank's copy of those).

    What a subclass declares, as class attributes:

    * `keeps_gradients_across_updates`: its state carries gradients into later updates. It is
      then refused with loss scaling (mixed_float16), whose scale changes between updates.
    * `gathers`: it moves the gradients with allgathers of per-rank data rather than in an
      allreduce; `kerasdist.callbacks.Join` (uneven steps per rank) cannot stand in for a rank
      in those and refuses it.
    * `densifies_sparse_gradients`: it makes an embedding's `tf.IndexedSlices` gradient dense.
      With `backward_passes_per_step` > 1 the optimizer then adds the micro-batches' gradients up
      dense too; otherwise (the default) it keeps every micro-batch's rows, so that `reduce` gets
      the same kind of gradient as without accumulation.

    Every rank must call `reduce` with the same tensors in the same order, and must get the same
    result: a rank that computed something else would train a model of its own.

    A reduction belongs to one optimizer: it is built with it and holds its state.

    Example:

    A top-k method with error feedback (each rank sends its k largest values of each
    tensor, keeps the rest for later), the shape of Deep Gradient Compression.

    ```python
    import keras, numpy as np, tensorflow as tf, kerasdist

    class TopK(kerasdist.reductions.GradientReduction):
        keeps_gradients_across_updates = True
        gathers = True

        def __init__(self, fraction=0.01):
            self.fraction = fraction

        def build(self, optimizer, variables):
            self.residuals = [optimizer.add_variable_from_reference(v, name="top_k_residual") for v in variables]

        def per_rank_variables(self):
            return self.residuals

        def reduce(self, gradients, variables, op):
            reduced = []
            for gradient, residual in zip(gradients, self.slots(self.residuals, variables)):
                corrected = tf.reshape(tf.convert_to_tensor(gradient) + residual, [-1])
                k = max(1, int(self.fraction * corrected.shape[0]))
                _, where = tf.math.top_k(tf.abs(corrected), k)
                sent = tf.gather(corrected, where)
                unsent = tf.tensor_scatter_nd_update(corrected, where[:, None], tf.zeros_like(sent))
                residual.assign(tf.reshape(unsent, residual.shape))
                every_where = kerasdist.allgather(where)  # k from each rank, rank by rank
                every_sent = kerasdist.allgather(sent)
                total = tf.scatter_nd(every_where[:, None], every_sent, corrected.shape)
                if op == kerasdist.Average:
                    total /= kerasdist.size()
                reduced.append(tf.reshape(total, gradient.shape))
            return reduced

        def get_config(self):
            return {"fraction": self.fraction}

    kerasdist.init()
    optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(1.0), reduction=TopK(fraction=0.5))
    w = keras.Variable(np.zeros(4, np.float32))
    optimizer.apply([tf.constant([4.0, -3.0, 2.0, 1.0])], [w])
    print(w.numpy().tolist())  # [-4.0, 3.0, 0.0, 0.0]
    print(optimizer.reduction.residuals[0].numpy().tolist())  # [0.0, 0.0, 2.0, 1.0]
    ```
    """

    keeps_gradients_across_updates = False
    gathers = False
    densifies_sparse_gradients = False

    def build(self, optimizer, variables):
        """Creates the method's state, if any, with `optimizer.add_variable(...)` or
        `optimizer.add_variable_from_reference(variable, name)` (saved with the optimizer,
        after its own counters). Called once, when the optimizer is built; `variables` are all its
        trainable variables, in its order.

        Example:

        The plain average, which also keeps each variable's last averaged gradient: state made
        here, one slot a variable, among the optimizer's variables and so saved with it.

        ```python
        import keras, numpy as np, tensorflow as tf, kerasdist

        class KeepsLast(kerasdist.reductions.Allreduce):
            def build(self, optimizer, variables):
                self.last = [optimizer.add_variable_from_reference(v, name="last_gradient") for v in variables]

            def reduce(self, gradients, variables, op):
                reduced = super().reduce(gradients, variables, op)
                for last, gradient in zip(self.slots(self.last, variables), reduced):
                    last.assign(gradient)
                return reduced

        kerasdist.init()
        optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.1), reduction=KeepsLast())
        kernel, bias = keras.Variable(np.zeros((3, 2), np.float32)), keras.Variable(np.zeros(2, np.float32))
        optimizer.build([kernel, bias])  # model.fit builds it before the first step
        print([tuple(slot.shape) for slot in optimizer.reduction.last])  # [(3, 2), (2,)]
        print(all(any(slot is v for v in optimizer.variables) for slot in optimizer.reduction.last))  # True
        optimizer.apply([tf.fill((3, 2), float(kerasdist.rank())), tf.ones(2)], [kernel, bias])
        # The average of the ranks' numbers 0, 1, ..., size - 1:
        print(optimizer.reduction.last[0].numpy()[0, 0] == (kerasdist.size() - 1) / 2)  # True
        ```
        """

    def reduce(self, gradients, variables, op):
        """The gradients combined across ranks, a list in the order of `gradients`.

        Args:
            gradients: this rank's gradients, one for each of `variables` (no `None`; an
                embedding's may be a `tf.IndexedSlices`, which `tf.convert_to_tensor` makes dense;
                after `backward_passes_per_step` micro-batches it holds all of their rows).
            variables: the variables they are gradients of: a subset of those `build` saw, in
                an order that is the same on every rank.
            op: `kerasdist.Average` or `kerasdist.Sum`, how ranks combine.

        Example:

        The average across ranks, halved.

        ```python
        import keras, numpy as np, tensorflow as tf, kerasdist

        class Halved(kerasdist.reductions.GradientReduction):
            def reduce(self, gradients, variables, op):
                return [g / 2 for g in kerasdist.grouped_allreduce(gradients, op=op)]

        kerasdist.init()
        optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(1.0), reduction=Halved())
        w = keras.Variable(np.zeros(2, np.float32))
        optimizer.apply([tf.constant([2.0, 4.0])], [w])  # the same gradient on every rank
        print(w.numpy().tolist())  # [-1.0, -2.0]
        ```
        """
        raise NotImplementedError(f"{type(self).__name__} must implement reduce(gradients, variables, op)")

    def reduce_and_apply(self, gradients, variables, op, apply):
        """Calls `apply(reduced)` with the result of `reduce`. A method that decides when an update
        applies anything (as `Delayed` does at its first) overrides this instead.

        Example:

        A reduction that applies every second update only.

        ```python
        import keras, numpy as np, tensorflow as tf, kerasdist

        class EveryOther(kerasdist.reductions.Allreduce):
            def build(self, optimizer, variables):
                self.calls = optimizer.add_variable(shape=(), dtype="int32", name="every_other_calls")

            def reduce_and_apply(self, gradients, variables, op, apply):
                reduced = self.reduce(gradients, variables, op)
                self.calls.assign_add(1)
                if self.calls % 2 == 0:
                    apply(reduced)

        kerasdist.init()
        optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(1.0), reduction=EveryOther())
        w = keras.Variable(np.zeros(1, np.float32))
        for _ in range(3):
            optimizer.apply([tf.constant([1.0])], [w])
        print(w.numpy().tolist())  # [-1.0]
        ```
        """
        apply(self.reduce(gradients, variables, op))

    def per_rank_variables(self):
        """The state variables whose values differ between ranks (default: none).

        Example:

        `OneBit` keeps each rank's rounding error, its own.

        ```python
        import keras, kerasdist
        optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.1), reduction=kerasdist.reductions.OneBit())
        optimizer.build([keras.Variable([1.0, 2.0], name="w")])
        print(len(optimizer.reduction.per_rank_variables()))  # 1
        print(kerasdist.reductions.Allreduce().per_rank_variables())  # []
        ```
        """
        return []

    def slots(self, states, variables):
        """Of `states`, one made in `build` for each variable `build` saw, those of `variables`.

        Example:

        An update may hold gradients for some variables only: `slots` picks their states.

        ```python
        import keras, kerasdist

        class Remembers(kerasdist.reductions.Allreduce):
            def build(self, optimizer, variables):
                self.last = [optimizer.add_variable_from_reference(v, name="last") for v in variables]

        optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.1), reduction=Remembers())
        a, b = keras.Variable([1.0], name="a"), keras.Variable([2.0, 3.0], name="b")
        optimizer.build([a, b])
        print([tuple(s.shape) for s in optimizer.reduction.slots(optimizer.reduction.last, [b])])  # [(2,)]
        ```
        """
        return [states[self._position_of(variable)] for variable in variables]

    def get_config(self):
        """The constructor's arguments, for saving in a `.keras` file (register the class with
        `keras.saving.register_keras_serializable` so that loading finds it).

        Example:

        ```python
        import kerasdist
        reduction = kerasdist.reductions.Allreduce(compression=kerasdist.Compression.fp16)
        print(reduction.get_config())  # {'compression': 'fp16', 'sparse_as_dense': False}
        ```
        """
        return {}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def _build(self, optimizer, variables):
        if getattr(self, "_position_of", None) is not None:
            raise ValueError(f"this {type(self).__name__} already belongs to an optimizer: give each its own")
        self._position_of = optimizer._get_variable_index  # the optimizer's order of its variables
        self.build(optimizer, variables)

    def __repr__(self):
        arguments = ", ".join(f"{key}={value!r}" for key, value in self.get_config().items())
        return f"{type(self).__name__}({arguments})"
