"""Gradient averaging for Keras 3: `DistributedOptimizer` for `model.fit`, and
`DistributedGradientTape` for custom training loops.

Gradients are reduced across ranks before the wrapped optimizer sees them, so its clipping,
loss-scale checks, weight decay and layer-wise trust ratios all act on the global gradient.
"""

import sys

import keras
import tensorflow as tf

from kerasdist import _compat, one_bit, ops, runtime
from kerasdist.batch_growth.noise_scale import GradientNoiseScale
from kerasdist.optimizers.wrapping import WrappingOptimizer

_COMPRESSIONS = {"none": ops.Compression.none, "fp16": ops.Compression.fp16, "bf16": ops.Compression.bf16}
_GRADIENT_OPS = {"average": ops.Average, "sum": ops.Sum}


def _compression_name(compression):
    if isinstance(compression, str):
        if compression not in _COMPRESSIONS:
            raise ValueError(f"compression={compression!r}; expected one of {sorted(_COMPRESSIONS)}")
        return compression
    for name, known in _COMPRESSIONS.items():
        if compression is known:
            return name
    raise ValueError(f"compression={compression!r}; expected kerasdist.Compression.none, .fp16 or .bf16")


def _gradient_op_name(op):
    for name, known in _GRADIENT_OPS.items():
        if op == known or op == name:
            return name
    raise ValueError(f"op={op!r}: gradients can be combined with kerasdist.Average or kerasdist.Sum only")


def reduce_gradients(grads, op=ops.Average, compression=ops.Compression.none, sparse_as_dense=False):
    """Combines a list of per-rank gradients across ranks; `None` entries stay `None`.

    Dense gradients go out in buckets of about `KERASDIST_BUCKET_BYTES` (by default an eighth
    of their bytes, between 64 KiB and 4 MiB, or one bucket when every rank is on one host
    without a GPU), last variables first,
    one grouped allreduce each (small tensors of a bucket fuse into one MPI call). Inside a
    `tf.function` a bucket's allreduce starts as soon as backprop has produced its gradients,
    so communication overlaps the rest of the backward pass. `IndexedSlices` (embedding
    gradients) are gathered, not densified, unless `sparse_as_dense`. In a world of one this
    returns `grads` unchanged and adds no op to the graph.
    """
    return _reduce(grads, op, compression, sparse_as_dense)[0]


def _reduce(grads, op, compression, sparse_as_dense, statistics=()):
    """`reduce_gradients`, plus float32 `statistics` reduced with the last bucket (uncompressed,
    so a squared norm cannot overflow float16). Returns (grads, statistics)."""
    grads, statistics = list(grads), list(statistics)
    if runtime.state().size == 1:
        return grads, statistics
    if sparse_as_dense:
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    dense_positions = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
    reduced = list(grads)
    buckets = _buckets(
        dense_positions, grads, _bucket_bytes(runtime.state().knobs.bucket_bytes, [grads[i] for i in dense_positions])
    ) or [[]]
    for bucket in buckets:
        # Statistics depend on every gradient: they ride with the last bucket, after its
        # gradients, past the end of the compressed ones.
        riders = statistics if bucket is buckets[-1] else []
        out = ops._allreduce_group(
            [grads[i] for i in bucket] + riders, op, None, 1.0, 1.0, compression.wire_dtypes(len(bucket))
        )
        for i, g in zip(bucket, out):
            reduced[i] = g
    for i, g in enumerate(grads):
        if isinstance(g, tf.IndexedSlices):
            reduced[i] = ops.allreduce(g, op=op, compression=compression)
    return reduced, (out[len(buckets[-1]) :] if statistics else [])


# KERASDIST_BUCKET_BYTES=auto: about this many buckets, within these sizes. Over a 50 Mbit/s link
# ResNet-20's step fell from 441 ms (one bucket) to 311 ms with 8 buckets, 316-348 ms with 4 and
# 393 ms with 2 (docs/network.md); the floor keeps tiny models from paying a negotiation per
# few layers, the cap keeps the buckets of large models from waiting for too many layers.
# With every rank on one CPU host, one bucket: shared memory leaves no transfer time to hide and
# every CPU is busy with backprop, so each extra bucket's negotiation only takes CPU from it
# (keras_scaling's E(2): 1.016 with one bucket, 0.707 with four; docs/performance.md).
AUTO_BUCKETS = 8
AUTO_BUCKET_BYTES_MIN, AUTO_BUCKET_BYTES_MAX = 64 * 2**10, 4 * 2**20


def _nbytes(tensor):
    return (tensor.shape.num_elements() or 0) * tensor.dtype.size


def _bucket_bytes(setting, grads):
    """The bucket size `setting` (KERASDIST_BUCKET_BYTES) gives for these dense gradients."""
    if setting != "auto":
        return setting
    if runtime.state().one_cpu_host:
        return 0
    total = sum(_nbytes(g) for g in grads)
    return min(AUTO_BUCKET_BYTES_MAX, max(AUTO_BUCKET_BYTES_MIN, total // AUTO_BUCKETS))


def _buckets(positions, grads, bucket_bytes):
    """`positions` of `grads` in reduction buckets of about `bucket_bytes` (0: one bucket).

    Backprop produces the last variables' gradients first, so buckets are filled from the end:
    the first bucket can travel while earlier layers are still being differentiated. Shapes and
    order decide, so every rank makes the same buckets.
    """
    buckets, current, filled = [], [], 0
    for i in reversed(positions):
        current.append(i)
        filled += _nbytes(grads[i])
        if bucket_bytes and filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    return buckets + ([current] if current else [])


def _squared_norm(grads):
    return tf.add_n(
        [tf.reduce_sum(tf.square(tf.cast(tf.convert_to_tensor(g), tf.float32))) for g in grads if g is not None]
    )


@keras.saving.register_keras_serializable(package="kerasdist")
class DistributedOptimizer(WrappingOptimizer):
    """Wraps any Keras 3 optimizer so that gradients are averaged across ranks before each update.

    The wrapper composes, like `keras.optimizers.LossScaleOptimizer`: it reduces the gradients in
    `apply()` (one grouped allreduce, so they fuse) and hands the result to the inner optimizer,
    whose clipping, loss-scale check, weight decay and trust ratios then see the global gradient.
    Learning rate, `iterations` and loss scaling are the inner optimizer's.

    With `backward_passes_per_step=k`, each rank adds up `k` micro-batch gradients locally and
    only every `k`-th `apply()` reduces their mean (or, with `average_aggregated_gradients=False`,
    their sum) and updates the weights: the effective batch is
    (per-rank batch) × ranks × k, and communication drops k-fold. In a job restarted on fewer
    ranks than planned (`kerasdist.planned_size()`), each rank stands in for planned / running
    ranks and accumulates that many times k micro-batches, so the effective batch stays
    (per-rank batch) × planned ranks × k; `backward_passes_per_step` and checkpoints keep k.
    `k` can change while training
    runs (`optimizer.backward_passes_per_step = 4`) without retracing, as long as the optimizer was
    built with `k > 1`; raising it from 1 after the first step creates the accumulators, and the
    traced train function must then be rebuilt (`model.make_train_function(force=True)`):
    `set_backward_passes_per_step(k, model)` does both.

    Under the mixed_float16 policy, one created after the policy is set wraps its optimizer in a
    `keras.optimizers.LossScaleOptimizer` (unless it is one) and is itself a `LossScaleOptimizer`
    to Keras, so `compile` adds no second scaler. The scaled gradients are reduced first and the
    inner scaler tests the reduced ones for overflow: every rank skips the same steps.

    Callbacks that adapt training to the gradients read them through `gradient_statistics()`
    (the `GradientNoiseScale` fed by every update) and change k with
    `set_backward_passes_per_step`, as `kerasdist.callbacks.AdaptiveBatchGrowth` does.

    Args:
        optimizer: the optimizer to wrap (a `keras.optimizers.Optimizer`, or a name such as `"sgd"`).
        op: `kerasdist.Average` (default) or `kerasdist.Sum`.
        compression: `kerasdist.Compression.none` (default), `.fp16` or `.bf16`: the wire format
            of float gradients.
        backward_passes_per_step: micro-batches accumulated per update (default 1).
        average_aggregated_gradients: whether an update applies the mean of its `k` micro-batch
            gradients (default True: the gradient of the whole effective batch) or their sum
            (Horovod's default, k times larger).
        sparse_as_dense: reduce embedding (`IndexedSlices`) gradients as dense tensors instead of
            gathering them; better when most rows are touched every step.
        gradient_noise_scale: a `kerasdist.GradientNoiseScale` to feed from every update; its
            one scalar rides in the gradients' grouped allreduce.
        delay_gradients: each update applies the gradients of the update before it (reduced
            while this step computed), and keeps this step's for the next: the allreduce
            depends on nothing the step computes, so inside `tf.function` it runs during the
            forward and backward pass instead of after them. The first update applies nothing;
            the stored gradients are optimizer state, saved and restored with it. Staleness of
            one step, as in pipelined ("one-step-delayed") SGD; not with `gradient_noise_scale`.
        one_bit_gradients: send one sign bit per gradient value and a scale per tensor, with
            error feedback (see `kerasdist.one_bit`): each rank keeps what quantising lost and
            adds it to its next gradient. The residuals are optimizer state. Dense float
            gradients only (embedding gradients are densified); replaces `compression`; not
            with `gradient_noise_scale` or `delay_gradients`.
        name: defaults to `"distributed_" + optimizer.name`.

    Example:

    ```python
    import keras, kerasdist
    kerasdist.init()
    optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    # the inner optimizer's rate, a float32
    print(round(float(optimizer.learning_rate.numpy()), 6))  # 0.01
    ```

    Saved `.keras` files name the class `"kerasdist>DistributedOptimizer"`: with kerasdist
    imported, `keras.saving.load_model(path)` restores it; without kerasdist, load the model with
    `keras.saving.load_model(path, compile=False)` (weights and architecture; then compile it with
    any optimizer).
    """

    def __init__(
        self,
        optimizer,
        op=ops.Average,
        compression=ops.Compression.none,
        backward_passes_per_step=1,
        sparse_as_dense=False,
        gradient_noise_scale=None,
        name=None,
        average_aggregated_gradients=True,
        delay_gradients=False,
        one_bit_gradients=False,
        **kwargs,
    ):
        runtime.init()  # here, not at the first apply(): that runs inside a traced function
        if not isinstance(optimizer, (str, dict, keras.optimizers.Optimizer)):
            raise TypeError(
                f"DistributedOptimizer(optimizer={optimizer!r}): expected a keras.optimizers.Optimizer "
                "to wrap, e.g. keras.optimizers.SGD(0.01), or an optimizer's name such as 'sgd'"
            )
        optimizer = keras.optimizers.get(optimizer)
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("this optimizer is already a kerasdist.DistributedOptimizer; wrap it once")
        if kwargs:
            raise ValueError(f"DistributedOptimizer does not take {sorted(kwargs)}: set them on the inner optimizer")
        name = name or f"distributed_{optimizer.name}"
        if keras.mixed_precision.global_policy().name == "mixed_float16" and not isinstance(
            optimizer, keras.optimizers.LossScaleOptimizer
        ):
            # The scaler `compile` would put around this optimizer, put inside it instead.
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer, name="loss_scale_optimizer")
        super().__init__(optimizer, name=name)
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and type(self) is DistributedOptimizer:
            self.__class__ = _LossScalingDistributedOptimizer  # so that `compile` adds no second scaler
        self._op_name = _gradient_op_name(op)
        self._compression_name = _compression_name(compression)
        self.sparse_as_dense = bool(sparse_as_dense)
        self._initial_backward_passes = _check_backward_passes(backward_passes_per_step)
        # Planned and running ranks are fixed for the job's life: the traced step takes this as a constant.
        self._planned_ranks_per_rank = runtime.state().planned_size // runtime.state().size
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        for argument, value in (("delay_gradients", delay_gradients), ("one_bit_gradients", one_bit_gradients)):
            # bool(x) would read "no" as True, and delay_gradients=2 as a delay of one step
            if not isinstance(value, bool):
                delay = " (the delay is always one update)" if argument == "delay_gradients" else ""
                raise TypeError(f"{argument}={value!r}: expected True or False{delay}")
        self.delay_gradients = bool(delay_gradients)
        self.one_bit_gradients = bool(one_bit_gradients)
        if self.one_bit_gradients and (self.delay_gradients or self._compression_name != "none"):
            raise ValueError(
                "one_bit_gradients=True sends signs and scales: not with delay_gradients=True or a compression"
            )
        if self.scales_the_loss and (self.delay_gradients or self.one_bit_gradients):
            option = "delay_gradients=True" if self.delay_gradients else "one_bit_gradients=True"
            raise ValueError(_NOT_WITH_LOSS_SCALING.format(option))
        self._delayed_gradients = None
        self._one_bit_residuals = None
        self._accumulators = None
        self._micro_batch_sq_norms = None
        self.gradient_noise_scale = None
        if gradient_noise_scale is not None:
            self.attach_gradient_noise_scale(gradient_noise_scale)

    def attach_gradient_noise_scale(self, gradient_noise_scale):
        """Feeds a `kerasdist.GradientNoiseScale` from every update (before the first step only)."""
        if not isinstance(gradient_noise_scale, GradientNoiseScale):
            raise TypeError(f"gradient_noise_scale={gradient_noise_scale!r}; expected a kerasdist.GradientNoiseScale")
        if self._op_name != "average":
            raise ValueError("the gradient noise scale needs op=kerasdist.Average")
        if not self.average_aggregated_gradients:
            raise ValueError("the gradient noise scale needs average_aggregated_gradients=True (mean gradients)")
        if self.delay_gradients or self.one_bit_gradients:
            raise ValueError(
                "the gradient noise scale needs each update's own exact gradients: not with "
                "delay_gradients=True or one_bit_gradients=True"
            )
        if self.scales_the_loss:
            raise ValueError(_NOT_WITH_LOSS_SCALING.format("the gradient noise scale"))
        if self.built:
            raise ValueError(
                "attach the GradientNoiseScale before the optimizer's first step, e.g. "
                "DistributedOptimizer(..., gradient_noise_scale=kerasdist.GradientNoiseScale())"
            )
        self.gradient_noise_scale = gradient_noise_scale

    def gradient_statistics(self, batch_size=None):
        """The statistics gathered from every update's gradients: the `GradientNoiseScale`.

        When the optimizer has none, a new one is attached, which is possible only before its
        first step (the statistics' variables are created when it is built).

        Args:
            batch_size: the per-rank micro-batch size; when given, it is set on the statistics
                (it expresses tr(Σ) and B_noise in samples).

        Example:

        ```python
        import keras, kerasdist
        kerasdist.init()
        optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
        statistics = optimizer.gradient_statistics(batch_size=32)
        print(statistics is optimizer.gradient_noise_scale, statistics.batch_size)  # True 32
        ```
        """
        if self.gradient_noise_scale is None:
            self.attach_gradient_noise_scale(GradientNoiseScale())
        if batch_size is not None:
            self.gradient_noise_scale.batch_size = batch_size
        return self.gradient_noise_scale

    @property
    def scales_the_loss(self):
        """Whether the inner optimizer is a `keras.optimizers.LossScaleOptimizer` (one is added
        under the mixed_float16 policy): it then checks the reduced gradients, the same on every
        rank, so every rank skips the same steps."""
        return isinstance(self.inner_optimizer, keras.optimizers.LossScaleOptimizer)

    @property
    def op(self):
        return _GRADIENT_OPS[self._op_name]

    @property
    def compression(self):
        return _COMPRESSIONS[self._compression_name]

    @_compat.no_automatic_dependency_tracking
    def build(self, var_list):
        if keras.mixed_precision.global_policy().name == "mixed_float16" and not self.scales_the_loss:
            raise ValueError(_CREATED_BEFORE_MIXED_FLOAT16)
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        self._micro_step = self.add_variable(shape=(), dtype="int32", name="micro_step")
        self._backward_passes = self.add_variable(
            shape=(),
            dtype="int32",
            initializer=keras.initializers.Constant(self._initial_backward_passes),
            name="backward_passes_per_step",
        )
        if self.gradient_noise_scale is not None:
            self.gradient_noise_scale.build(self)
        # Named, not super(): in _LossScalingDistributedOptimizer, LossScaleOptimizer comes next,
        # whose build would make a second, unused loss scale.
        keras.optimizers.Optimizer.build(self, var_list)
        if self.delay_gradients:
            self._delayed_gradients = [
                self.add_variable_from_reference(v, name="delayed_gradient") for v in self._trainable_variables
            ]
            self._delayed_gradients_held = self.add_variable(shape=(), dtype="int32", name="delayed_gradients_held")
        if self.one_bit_gradients:
            self._one_bit_residuals = [
                self.add_variable(shape=v.shape, dtype="float32", name="one_bit_residual")
                for v in self._trainable_variables
            ]
        if self._initial_backward_passes * self._planned_ranks_per_rank > 1:
            self._create_accumulators()

    @_compat.no_automatic_dependency_tracking
    def _create_accumulators(self):
        self._accumulators = [
            self.add_variable_from_reference(v, name="gradient_sum") for v in self._trainable_variables
        ]
        if self.gradient_noise_scale is not None:
            self._micro_batch_sq_norms = self.add_variable(shape=(), dtype="float32", name="micro_batch_sq_norms")

    def _window_variables(self):
        """The partial sums of the current accumulation window."""
        return (self._accumulators or []) + (
            [self._micro_batch_sq_norms] if self._micro_batch_sq_norms is not None else []
        )

    def _variables_after_the_counters(self):
        """The window's partial sums and the delayed gradients: created after the counters, so
        saved last (see load_own_variables)."""
        delayed = [] if self._delayed_gradients is None else [*self._delayed_gradients, self._delayed_gradients_held]
        return self._window_variables() + delayed + (self._one_bit_residuals or [])

    def per_rank_variables(self):
        """The variables whose values differ between ranks: the window's partial sums, the held
        (not yet reduced) gradients and the 1-bit residuals, each rank's own. Every other
        variable holds the same value on every rank. `Rank0Checkpoint(resume=True)` saves
        every rank's values of these, so that a resumed run continues exactly."""
        return self._window_variables() + (self._delayed_gradients or []) + (self._one_bit_residuals or [])

    def reset_per_rank_state(self):
        """Starts the per-rank state afresh: an empty accumulation window, no held gradients (the
        next update applies nothing), zero residuals."""
        for partial in self._variables_after_the_counters():
            partial.assign(tf.zeros_like(partial))
        self._micro_step.assign(0)

    @property
    def backward_passes_per_step(self):
        """Micro-batches per update; settable while training (see the class docstring)."""
        if not self.built:
            return self._initial_backward_passes
        return int(self._backward_passes.numpy())

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, value):
        value = _check_backward_passes(value)
        if not self.built:
            self._initial_backward_passes = value
            return
        if value > 1 and self._accumulators is None:
            if not tf.executing_eagerly():
                raise RuntimeError("raise backward_passes_per_step from 1 outside tf.function (it creates variables)")
            self._create_accumulators()
        self._backward_passes.assign(value)

    def set_backward_passes_per_step(self, value, model=None):
        """Changes k while training runs so that the next traced step uses it; returns whether
        that needed a new trace.

        Assigning `backward_passes_per_step` changes a variable the traced step reads, except
        when k is raised from 1 after the first step: the accumulators created then are unknown
        to a step traced without them (it fails rather than ignore k), so the step must be
        traced again. Given the `model` compiled with this optimizer, its train function is then
        rebuilt here; in a custom loop, rebuild your own `tf.function` when this returns True.

        Args:
            value: the new k, an integer >= 1. Call it outside `tf.function`.
            model: the Keras model whose train function to rebuild when needed.
        """
        value = _check_backward_passes(value)
        needs_retrace = self.built and self._accumulators is None and value > 1
        self.backward_passes_per_step = value
        if needs_retrace and model is not None:
            model.make_train_function(force=True)
        return needs_retrace

    def apply(self, grads, trainable_variables=None):
        ops._refuse_xla("DistributedOptimizer.apply")
        grads, trainable_variables = self._apply_arguments(grads, trainable_variables)
        if not grads:
            return
        if self._accumulators is None:
            # Built with k = 1: a stale trace must fail, not ignore a k raised later.
            check = tf.debugging.assert_equal(
                self._backward_passes,
                1,
                message="backward_passes_per_step was raised from 1 after this function was traced; "
                "rebuild it (model.make_train_function(force=True))",
            )
            with tf.control_dependencies([] if check is None else [check]):
                self._reduce_and_apply(grads, trainable_variables)
        else:
            self._accumulate(grads, trainable_variables)

    def _reduce_and_apply(self, grads, trainable_variables, micro_batches=1, micro_batch_sq_norm=None):
        if self.delay_gradients:
            self._apply_delayed(grads, trainable_variables)
            return
        noise = self.gradient_noise_scale
        if self.one_bit_gradients:
            reduced = self._reduce_to_one_bit(grads, trainable_variables)
        elif noise is None:
            reduced = reduce_gradients(grads, self.op, self.compression, self.sparse_as_dense)
        else:
            if micro_batch_sq_norm is None:
                micro_batch_sq_norm = _squared_norm(grads)
            reduced, (mean_micro_batch_sq_norm,) = _reduce(
                grads, self.op, self.compression, self.sparse_as_dense, statistics=[micro_batch_sq_norm]
            )
            # The micro-batches this update holds on all ranks, whatever the planned ranks.
            all_micro_batches = runtime.state().size * micro_batches
            noise.update(mean_micro_batch_sq_norm, _squared_norm(reduced), big_over_small=all_micro_batches)
        with tf.control_dependencies(self._same_weights_at_the_first_update(trainable_variables)):
            self.inner_optimizer.apply(reduced, trainable_variables)

    def _same_weights_at_the_first_update(self, variables):
        # BroadcastGlobalState sets this when the model was not built at fit's start: it can only
        # broadcast after the first step, so the check's broadcast is the expected one, not news.
        announce = not getattr(self, "_broadcast_follows_first_step", False)
        return _same_weights_at_the_first_update(self.iterations, variables, announce)

    def _reduce_to_one_bit(self, grads, trainable_variables):
        present = [i for i, g in enumerate(grads) if g is not None]
        residuals = [self._one_bit_residuals[self._get_variable_index(trainable_variables[i])] for i in present]
        reduced = one_bit.reduce([grads[i] for i in present], residuals, self.op)
        out = list(grads)
        for i, r in zip(present, reduced):
            out[i] = r
        return out

    def _apply_delayed(self, grads, trainable_variables):
        """Reduces and applies the gradients held since the last update, then holds `grads`.

        The held values are read before this step's are stored (program order on the same
        variables), and their allreduce waits for nothing the step computes.
        """
        present = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
        variables = [v for _, v in present]
        held = [self._delayed_gradients[self._get_variable_index(v)] for v in variables]
        reduced = reduce_gradients([tf.convert_to_tensor(h) for h in held], self.op, self.compression)

        def apply_held():
            with tf.control_dependencies(self._same_weights_at_the_first_update(variables)):
                self.inner_optimizer.apply(reduced, variables)

        tf.cond(self._delayed_gradients_held > 0, apply_held, lambda: None)
        for (g, _), h in zip(present, held):
            h.assign(tf.convert_to_tensor(g))
        self._delayed_gradients_held.assign(1)

    def _accumulate(self, grads, trainable_variables):
        present = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
        sums = [self._accumulators[self._get_variable_index(v)] for _, v in present]
        for (g, _), total in zip(present, sums):
            total.assign_add(tf.convert_to_tensor(g))
        if self._micro_batch_sq_norms is not None:
            self._micro_batch_sq_norms.assign_add(_squared_norm([g for g, _ in present]))
        micro_step = self._micro_step.assign_add(1)
        stand_ins = self._planned_ranks_per_rank

        def update():
            # Divide by the micro-batches this window really holds: k may have been lowered
            # in the middle of it.
            mean_sq_norm = None
            if self._micro_batch_sq_norms is not None:
                mean_sq_norm = self._micro_batch_sq_norms / tf.cast(micro_step, tf.float32)
            # Give what the planned ranks this rank stands in for would give together: each the
            # mean (or sum) of its k micro-batches, combined as the op combines ranks.
            combined_as_sum = self._op_name == "sum"
            if self.average_aggregated_gradients:
                divisor = tf.cast(micro_step, tf.float32) / (stand_ins if combined_as_sum else 1)
            else:
                divisor = 1 if combined_as_sum else stand_ins
            self._reduce_and_apply(
                [total / tf.cast(divisor, total.dtype) for total in sums],
                [v for _, v in present],
                micro_step,
                mean_sq_norm,
            )
            for partial in self._window_variables():
                partial.assign(tf.zeros_like(partial))
            self._micro_step.assign(0)

        tf.cond(micro_step >= self._backward_passes * stand_ins, update, lambda: None)

    # The inner optimizer saves its own state as a child object. Accumulators are saved after
    # the counters, so a file saved with k = 1 loads into k > 1 and back.
    def load_own_variables(self, store):
        if len(store.keys()) == len(self._variables):
            for i, variable in enumerate(self._variables):
                variable.assign(store[str(i)])
            return
        trailing = self._variables_after_the_counters()
        for i, variable in enumerate(self._variables[: len(self._variables) - len(trailing)]):
            if str(i) in store:
                variable.assign(store[str(i)])
        # The partial sums and held gradients did not come back: start a fresh window, and
        # the next update applies nothing.
        self.reset_per_rank_state()

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "op": self._op_name,
            "compression": self._compression_name,
            "backward_passes_per_step": self.backward_passes_per_step,
            "sparse_as_dense": self.sparse_as_dense,
            "average_aggregated_gradients": self.average_aggregated_gradients,
            "delay_gradients": self.delay_gradients,
            "one_bit_gradients": self.one_bit_gradients,
            "gradient_noise_scale": None
            if self.gradient_noise_scale is None
            else {"batch_size": self.gradient_noise_scale.batch_size, "ema_decay": self.gradient_noise_scale.ema_decay},
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("optimizer"), custom_objects=custom_objects)
        noise = config.pop("gradient_noise_scale", None)
        return cls(inner, gradient_noise_scale=None if noise is None else GradientNoiseScale(**noise), **config)


_NOT_WITH_LOSS_SCALING = (
    "{} carries gradients (or their statistics) from one update into later ones, in the units of a "
    "loss scale that changes between them, and a step whose gradients overflowed would poison them: "
    "not with loss scaling (an inner keras.optimizers.LossScaleOptimizer, which DistributedOptimizer "
    "adds by itself under the mixed_float16 policy); mixed_bfloat16 needs no loss scaling"
)
_CREATED_BEFORE_MIXED_FLOAT16 = (
    "this DistributedOptimizer was created before keras.mixed_precision.set_global_policy('mixed_float16'), "
    "so it does not scale the loss, and model.compile puts a LossScaleOptimizer around it that checks "
    "each rank's own gradients: a step that overflows on one rank would be skipped on that rank only. "
    "Create the DistributedOptimizer after setting the policy (it then scales the loss itself, checking "
    "the reduced gradients), or give it one: DistributedOptimizer(keras.optimizers.LossScaleOptimizer(opt))"
)


def _inner_loss_scale_attribute(name):
    return property(lambda self: getattr(self.inner_optimizer, name), doc=f"The inner LossScaleOptimizer's `{name}`.")


@keras.saving.register_keras_serializable(package="kerasdist", name="LossScalingDistributedOptimizer")
class _LossScalingDistributedOptimizer(DistributedOptimizer, keras.optimizers.LossScaleOptimizer):
    """The class a `DistributedOptimizer` takes when its inner optimizer is a `LossScaleOptimizer`.

    Under mixed_float16, `model.compile` wraps every optimizer that is not a `LossScaleOptimizer`
    in one. Around a `DistributedOptimizer` that scaler would unscale the gradients a second
    time, and would test the local gradients for overflow: a rank whose batch overflowed would
    skip its update, and with it the gradient allreduce, alone. Being a `LossScaleOptimizer`
    keeps `compile` from adding it; all behaviour is `DistributedOptimizer`'s, and the loss
    scale is the inner optimizer's.
    """

    dynamic_scale = _inner_loss_scale_attribute("dynamic_scale")
    initial_scale = _inner_loss_scale_attribute("initial_scale")
    dynamic_growth_steps = _inner_loss_scale_attribute("dynamic_growth_steps")

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return DistributedOptimizer.from_config(config, custom_objects)  # which takes this class by itself


_DIFFERENT_WEIGHTS = (
    "kerasdist: the ranks held different trainable weights at the first update, so each would have "
    "trained its own model; rank 0's weights were broadcast to every rank first. Either the model was "
    "not built when training started (no keras.Input or input shape: fit builds it in its first step, "
    "so BroadcastGlobalState, or Horovod's BroadcastGlobalVariablesCallback, can broadcast only after "
    "that step; start the model with keras.Input(shape) or call model.build(shape) before fit), or "
    "nothing broadcast rank 0's state before training (for model.fit, pass "
    "callbacks=kerasdist.callbacks(); in a custom loop, call "
    "kerasdist.broadcast_variables(model.variables, root_rank=0) once they exist)."
)


def _same_weights_at_the_first_update(iterations, variables, announce=True):
    """Control dependencies that make every rank's weights rank 0's before the first update.

    Ranks initialise their weights independently: without a broadcast of rank 0's state they
    would each train their own model, with no error. At the first update (`iterations` 0), one
    allgather of exact checksums tells whether the ranks agree; if not, rank 0's trainable
    weights are broadcast and rank 0 says so. Every rank sees the same gathered checksums, so
    every rank takes the same branch. `announce=False` keeps rank 0 quiet about it.
    """
    if runtime.state().size == 1 or not variables:
        return []

    def check():
        checksums = ops.allgather(tf.stack([_checksum(v) for v in variables])[tf.newaxis])
        differ = tf.reduce_any(tf.not_equal(checksums, checksums[:1]))

        def broadcast():
            ops.broadcast_variables(variables, root_rank=0)
            if announce and runtime.state().rank == 0:
                tf.print(_DIFFERENT_WEIGHTS, output_stream=sys.stderr)
            return tf.constant(True)

        return tf.cond(differ, broadcast, lambda: tf.constant(False))

    return [tf.cond(tf.equal(iterations, 0), check, lambda: tf.constant(False))]


def _checksum(variable):
    """The sum of a variable's bit patterns, exact: ranks holding equal values get equal sums
    whatever order their reductions add in (a float sum could differ in its last bits)."""
    value = tf.convert_to_tensor(variable)
    if value.dtype.is_floating:  # float64 becomes pairs of int32
        value = tf.bitcast(value, tf.int16 if value.dtype.size == 2 else tf.int32)
    return tf.reduce_sum(tf.cast(value, tf.int64))


def _check_backward_passes(value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"backward_passes_per_step={value!r} must be an integer >= 1")
    return value


class DistributedGradientTape:
    """A `tf.GradientTape` whose `gradient()` returns gradients reduced across ranks.

    Use it in custom training loops; everything but `gradient()` is the wrapped tape's.

    Args:
        tape: the `tf.GradientTape` to wrap.
        op: `kerasdist.Average` (default) or `kerasdist.Sum`.
        compression: wire format of float gradients (`kerasdist.Compression.none/.fp16/.bf16`).
        sparse_as_dense: reduce `IndexedSlices` gradients as dense tensors.

    Example:

    ```python
    import tensorflow as tf, kerasdist
    kerasdist.init()
    w = tf.Variable(2.0)
    with kerasdist.DistributedGradientTape(tf.GradientTape()) as tape:
        loss = w * w
    # the same on every rank: d(w²)/dw averaged
    print(float(tape.gradient(loss, w)))  # 4.0
    ```
    """

    def __init__(self, tape, op=ops.Average, compression=ops.Compression.none, sparse_as_dense=False):
        runtime.init()
        self._tape = tape
        self._op = _GRADIENT_OPS[_gradient_op_name(op)]
        self._compression = _COMPRESSIONS[_compression_name(compression)]
        self._sparse_as_dense = sparse_as_dense

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self._tape.__exit__(*exc_info)

    def __getattr__(self, name):
        return getattr(self._tape, name)

    def gradient(self, target, sources, output_gradients=None, unconnected_gradients=tf.UnconnectedGradients.NONE):
        ops._refuse_xla("DistributedGradientTape.gradient")
        grads = self._tape.gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads, expand_composites=False)
        reduced = reduce_gradients(flat, self._op, self._compression, self._sparse_as_dense)
        return tf.nest.pack_sequence_as(grads, reduced, expand_composites=False)
