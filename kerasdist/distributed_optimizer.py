"""Gradient averaging for Keras 3: `DistributedOptimizer` for `model.fit`, and
`DistributedGradientTape` for custom training loops.

Gradients are reduced across ranks before the wrapped optimizer sees them, so its clipping,
loss-scale checks, weight decay and layer-wise trust ratios all act on the global gradient.
"""

import sys

import keras
import tensorflow as tf

from kerasdist import _compat, ops, runtime
from kerasdist.gradient_statistics import GradientNoiseScale
from kerasdist.reductions import Allreduce, Delayed, GradientReduction, OneBit, reduce_gradients
from kerasdist.reductions.agreement import GradientLayouts, variable_name
from kerasdist.reductions.allreduce import COMPRESSIONS, compression_name
from kerasdist.wrapping_optimizer import WrappingOptimizer

_GRADIENT_OPS = {"average": ops.Average, "sum": ops.Sum}


def _gradient_op_name(op):
    for name, known in _GRADIENT_OPS.items():
        if op == known or op == name:
            return name
    raise ValueError(f"op={op!r}: gradients can be combined with kerasdist.Average or kerasdist.Sum only")


def _squared_norm(grads):
    return tf.add_n(
        [tf.reduce_sum(tf.square(tf.cast(tf.convert_to_tensor(g), tf.float32))) for g in grads if g is not None]
    )


class _NoticeFlags:
    """A notice to leave, carried by the gradients' own allreduce: `here` is this rank's (1.0 once
    `StopAgreement` saw the notice signal, set between steps), `agreed` its average over the
    ranks at the last update (above 0 when any rank has one). Every rank reads the same `agreed`
    after the same update, so all stop there, without a collective of their own per batch.

    Plain `tf.Variable`s outside the optimizer's variables: not saved, not broadcast, not checked
    by the replica check (`here` differs between ranks by design)."""

    def __init__(self):
        with tf.init_scope():  # the optimizer may be made inside a traced function
            self.here = tf.Variable(0.0, trainable=False, name="notice_here")
            self.agreed = tf.Variable(0.0, trainable=False, name="notice_agreed")


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
    (per-rank batch) × ranks × k, and communication drops k-fold. An embedding's gradient
    (`tf.IndexedSlices`) is not added up: the window keeps every micro-batch's rows, and the
    update hands on all of them from every rank, as one process with the whole batch would
    (unless the reduction makes them dense anyway, as `sparse_as_dense=True` does). In a job restarted on fewer
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
        reduction: how the gradients travel, a `kerasdist.reductions.GradientReduction`:
            `Allreduce()` (the default: exact, optionally in a 16-bit wire format), `Delayed()`
            (each update applies the step before's gradients, whose allreduce overlapped this
            step), `OneBit()` (one sign bit per value, with error feedback), or a method of your
            own. Its state (held gradients, residuals) is optimizer state, saved with it.
        backward_passes_per_step: micro-batches accumulated per update (default 1).
        average_aggregated_gradients: whether an update applies the mean of its `k` micro-batch
            gradients (default True: the gradient of the whole effective batch) or their sum
            (Horovod's default, k times larger).
        gradient_noise_scale: a `kerasdist.GradientNoiseScale` to feed from every update; its
            one scalar rides in the gradients' grouped allreduce (with `Allreduce` only).
        compression, sparse_as_dense: the same as `reduction=kerasdist.reductions.Allreduce(
            compression, sparse_as_dense)`; `compression` is `kerasdist.Compression.none`
            (default), `.fp16` or `.bf16`.
        delay_gradients: `True` is `reduction=kerasdist.reductions.Delayed(compression)`.
        one_bit_gradients: `True` is `reduction=kerasdist.reductions.OneBit()`.
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
        reduction=None,
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
        self._initial_backward_passes = _check_backward_passes(backward_passes_per_step)
        # Planned and running ranks are fixed for the job's life: the traced step takes this as a constant.
        self._planned_ranks_per_rank = runtime.state().planned_size // runtime.state().size
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        self.reduction, self._reduction_named = _chosen_reduction(
            reduction, compression, sparse_as_dense, delay_gradients, one_bit_gradients
        )
        if self.scales_the_loss and self.reduction.keeps_gradients_across_updates:
            raise ValueError(_NOT_WITH_LOSS_SCALING.format(self._reduction_named))
        self._reduction_variables = []
        self._accumulators = None
        self._held_rows = None  # with k > 1, each variable's embedding-gradient rows of the window
        self._micro_batch_sq_norms = None
        self._gradient_layouts = None
        # A notice to leave rides in the gradients' allreduce (see _NoticeFlags) when the
        # reduction is the plain one, which takes riders; otherwise StopAgreement asks every batch.
        notices_ride = runtime.state().knobs.notice_signal != "off" and type(self.reduction) is Allreduce
        self._notice_flags = _NoticeFlags() if notices_ride else None
        self.gradient_noise_scale = None
        if gradient_noise_scale is not None:
            self.attach_gradient_noise_scale(gradient_noise_scale)

    def attach_gradient_noise_scale(self, gradient_noise_scale):
        """Feeds a `kerasdist.GradientNoiseScale` from every update (before the first step only).

        Example:

        ```python
        import keras, kerasdist
        kerasdist.init()
        optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.1))
        optimizer.attach_gradient_noise_scale(kerasdist.GradientNoiseScale(batch_size=32))
        print(optimizer.gradient_noise_scale.batch_size)  # 32
        summed = kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.1), op=kerasdist.Sum)
        try:
            summed.attach_gradient_noise_scale(kerasdist.GradientNoiseScale())
        except ValueError as error:
            print(error)  # the gradient noise scale needs op=kerasdist.Average
        ```
        """
        if not isinstance(gradient_noise_scale, GradientNoiseScale):
            raise TypeError(f"gradient_noise_scale={gradient_noise_scale!r}; expected a kerasdist.GradientNoiseScale")
        if self._op_name != "average":
            raise ValueError("the gradient noise scale needs op=kerasdist.Average")
        if not self.average_aggregated_gradients:
            raise ValueError("the gradient noise scale needs average_aggregated_gradients=True (mean gradients)")
        if type(self.reduction) is not Allreduce:
            raise ValueError(
                "the gradient noise scale needs each update's own exact gradients, reduced by "
                f"kerasdist.reductions.Allreduce: not with {self._reduction_named}"
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
        rank, so every rank skips the same steps.

        Example:

        ```python
        import keras, kerasdist
        scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        print(kerasdist.DistributedOptimizer(scaled).scales_the_loss)  # True
        print(kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.1)).scales_the_loss)  # False
        ```
        """
        return isinstance(self.inner_optimizer, keras.optimizers.LossScaleOptimizer)

    @property
    def op(self):
        return _GRADIENT_OPS[self._op_name]

    @property
    def compression(self):
        """The reduction's wire format (`kerasdist.Compression.none` when it has none).

        Example:

        ```python
        import keras, kerasdist
        optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=kerasdist.Compression.fp16)
        print(optimizer.compression is kerasdist.Compression.fp16)  # True
        ```
        """
        return getattr(self.reduction, "compression", ops.Compression.none)

    @property
    def sparse_as_dense(self):
        return getattr(self.reduction, "sparse_as_dense", False)

    @property
    def delay_gradients(self):
        """Whether the reduction is `kerasdist.reductions.Delayed`.

        Example:

        ```python
        import keras, kerasdist
        delayed = kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.1), reduction=kerasdist.reductions.Delayed())
        print(delayed.delay_gradients, delayed.one_bit_gradients)  # True False
        ```
        """
        return isinstance(self.reduction, Delayed)

    @property
    def one_bit_gradients(self):
        """Whether the reduction is `kerasdist.reductions.OneBit`.

        Example:

        ```python
        import keras, kerasdist
        one_bit = kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.1), reduction=kerasdist.reductions.OneBit())
        print(one_bit.one_bit_gradients, one_bit.delay_gradients)  # True False
        ```
        """
        return isinstance(self.reduction, OneBit)

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
        before = len(self._variables)
        self.reduction._build(self, self._trainable_variables)
        self._reduction_variables = self._variables[before:]
        self._gradient_layouts = GradientLayouts()
        if self._initial_backward_passes * self._planned_ranks_per_rank > 1:
            self._create_accumulators()

    @_compat.no_automatic_dependency_tracking
    def _create_accumulators(self):
        self._accumulators = [
            self.add_variable_from_reference(v, name="gradient_sum") for v in self._trainable_variables
        ]
        if not self.reduction.densifies_sparse_gradients:
            # Any variable with rows may get slices (a lookup, tf.gather): only its first trace tells.
            self._held_rows = [_HeldRows(v) if len(v.shape) else None for v in self._trainable_variables]
        if self.gradient_noise_scale is not None:
            self._micro_batch_sq_norms = self.add_variable(shape=(), dtype="float32", name="micro_batch_sq_norms")

    def _held_row_variables(self):
        return [variable for held in self._held_rows or [] if held is not None for variable in held.variables]

    def _window_variables(self):
        """The partial sums of the current accumulation window."""
        return (self._accumulators or []) + (
            [self._micro_batch_sq_norms] if self._micro_batch_sq_norms is not None else []
        )

    def _variables_after_the_counters(self):
        """The window's partial sums and the reduction's state: created after the counters, so
        saved last (see load_own_variables)."""
        return self._window_variables() + self._reduction_variables

    def per_rank_variables(self):
        """The variables whose values differ between ranks: the window's partial sums and
        embedding-gradient rows, and the reduction's per-rank state (held gradients, 1-bit
        residuals), each rank's own. Every other variable holds the same value on every rank.
        `Rank0Checkpoint(resume=True)` saves every rank's values of these, so that a resumed run
        continues exactly. The rows' variables have no fixed first dimension: they hold as many
        rows as the window's micro-batches looked up.

        Example:

        Three micro-batches with k = 2 leave one in the window, this rank's own.

        ```python
        import keras, kerasdist, numpy as np
        kerasdist.init()
        keras.utils.set_random_seed(kerasdist.rank())
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.01), backward_passes_per_step=2)
        model.compile(optimizer, loss="mse")
        model.fit(np.ones((6, 3)), np.zeros((6, 1)), batch_size=2, verbose=0, callbacks=kerasdist.callbacks())
        held = optimizer.per_rank_variables()
        print(any(np.any(keras.ops.convert_to_numpy(v) != 0) for v in held))  # True
        ```
        """
        return self._window_variables() + self._held_row_variables() + self.reduction.per_rank_variables()

    def reset_per_rank_state(self):
        """Starts the per-rank state afresh: an empty accumulation window and zeroed reduction
        state (no held gradients, so the next update of `Delayed` applies nothing; zero residuals).

        Example:

        ```python
        import keras, kerasdist, numpy as np
        kerasdist.init()
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.01), backward_passes_per_step=2)
        model.compile(optimizer, loss="mse")
        model.fit(np.ones((6, 3)), np.zeros((6, 1)), batch_size=2, verbose=0, callbacks=kerasdist.callbacks())
        optimizer.reset_per_rank_state()  # the third micro-batch's gradient is dropped
        held = optimizer.per_rank_variables()
        print(any(np.any(keras.ops.convert_to_numpy(v) != 0) for v in held))  # False
        ```
        """
        for partial in self._variables_after_the_counters():
            partial.assign(tf.zeros_like(partial))
        for held in self._held_rows or []:
            if held is not None:
                held.clear()
        self._micro_step.assign(0)

    @property
    def backward_passes_per_step(self):
        """Micro-batches per update; settable while training (see the class docstring).

        Example:

        ```python
        import keras, kerasdist
        optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=4)
        print(optimizer.backward_passes_per_step)  # 4
        optimizer.backward_passes_per_step = 2  # before the first step, or while training
        print(optimizer.backward_passes_per_step)  # 2
        ```
        """
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

        Example:

        ```python
        import keras, kerasdist, numpy as np
        kerasdist.init()
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.01))
        model.compile(optimizer, loss="mse")
        x, y = np.ones((8, 3)), np.zeros((8, 1))
        model.fit(x, y, batch_size=2, verbose=0, callbacks=kerasdist.callbacks())
        print(optimizer.set_backward_passes_per_step(2, model))  # True
        model.fit(x, y, batch_size=2, verbose=0, callbacks=kerasdist.callbacks())  # 2 micro-batches an update
        print(optimizer.set_backward_passes_per_step(4, model))  # False
        print(optimizer.backward_passes_per_step)  # 4
        ```
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
        # Before anything travels, every rank's gradients must line up with every other rank's.
        with tf.control_dependencies(self._gradient_layouts.check(grads, trainable_variables)):
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
        present = [i for i, g in enumerate(grads) if g is not None]
        grads = [grads[i] for i in present]
        variables = [trainable_variables[i] for i in present]

        def apply(reduced):
            with tf.control_dependencies(self._same_weights_at_the_first_update(trainable_variables)):
                self.inner_optimizer.apply(reduced, variables)

        noise, notice = self.gradient_noise_scale, self._notice_flags
        if noise is None and notice is None:
            self.reduction.reduce_and_apply(grads, variables, self.op, apply)
            return
        riders = []
        if noise is not None:
            riders.append(_squared_norm(grads) if micro_batch_sq_norm is None else micro_batch_sq_norm)
        if notice is not None:
            riders.append(notice.here.read_value())
        reduced, reduced_riders = self.reduction.reduce_with_statistics(grads, self.op, riders)
        if notice is not None:
            notice.agreed.assign(reduced_riders.pop())
        if noise is not None:
            # The micro-batches this update holds on all ranks, whatever the planned ranks.
            all_micro_batches = runtime.state().size * micro_batches
            noise.update(reduced_riders[0], _squared_norm(reduced), big_over_small=all_micro_batches)
        apply(reduced)

    def _same_weights_at_the_first_update(self, variables):
        return _same_weights_at_the_first_update(self.iterations, variables)

    def _accumulate(self, grads, trainable_variables):
        present = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
        windows = [self._window_of(g, v) for g, v in present]
        for (g, _), window in zip(present, windows):
            if isinstance(window, _HeldRows):
                window.add(g)
            else:
                window.assign_add(tf.convert_to_tensor(g))
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
                [
                    window.slices(g.dense_shape, divisor)
                    if isinstance(window, _HeldRows)
                    else window / tf.cast(divisor, window.dtype)
                    for (g, _), window in zip(present, windows)
                ],
                [v for _, v in present],
                micro_step,
                mean_sq_norm,
            )
            self._empty_the_window()

        tf.cond(micro_step >= self._backward_passes * stand_ins, update, lambda: None)

    def _window_of(self, gradient, variable):
        """Where the window keeps `variable`'s gradients: its held rows when they come as slices
        (each micro-batch's rows, as one process with the whole batch would see them), else its
        partial sum."""
        index = self._get_variable_index(variable)
        held = None if self._held_rows is None else self._held_rows[index]
        if held is None:
            return self._accumulators[index]
        held.note_kind(isinstance(gradient, tf.IndexedSlices))
        return held if held.sparse else self._accumulators[index]

    def _empty_the_window(self):
        """Zero partial sums and no held rows. The partial sums of variables whose gradients come
        as slices are never used (nothing to zero); the rows of variables whose gradients are
        dense are never filled."""
        for total, held in zip(self._accumulators, self._held_rows or [None] * len(self._accumulators)):
            if held is None or held.sparse is not True:
                total.assign(tf.zeros_like(total))
            if held is not None and held.sparse is not False:
                held.clear()
        if self._micro_batch_sq_norms is not None:
            self._micro_batch_sq_norms.assign(0.0)
        self._micro_step.assign(0)

    # The inner optimizer saves its own state as a child object. Accumulators are saved after
    # the counters, so a file saved with k = 1 loads into k > 1 and back. Held embedding-gradient
    # rows, whose number varies, follow under names of their own, when the window holds some.
    def save_own_variables(self, store):
        super().save_own_variables(store)
        for index, held in enumerate(self._held_rows or []):
            if held is not None:
                held.save(store, index)

    def load_own_variables(self, store):
        keys = list(store.keys())
        counted = [key for key in keys if key.isdigit()]
        holds_rows = len(counted) < len(keys)
        if len(counted) == len(self._variables) and (self._held_rows is not None or not holds_rows):
            for i, variable in enumerate(self._variables):
                variable.assign(store[str(i)])
            for index, held in enumerate(self._held_rows or []):
                if held is not None:
                    held.load(store, index)
            return
        trailing = self._variables_after_the_counters()
        for i, variable in enumerate(self._variables[: len(self._variables) - len(trailing)]):
            if str(i) in store:
                variable.assign(store[str(i)])
        # The partial sums and held gradients did not come back: start a fresh window, and
        # the next update applies nothing.
        self.reset_per_rank_state()

    def get_config(self):
        config = {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "op": self._op_name,
            "backward_passes_per_step": self.backward_passes_per_step,
            "average_aggregated_gradients": self.average_aggregated_gradients,
            "gradient_noise_scale": None
            if self.gradient_noise_scale is None
            else {"batch_size": self.gradient_noise_scale.batch_size, "ema_decay": self.gradient_noise_scale.ema_decay},
        }
        if type(self.reduction) in (Allreduce, Delayed, OneBit):
            # The built-in reductions as the arguments they had before `reduction=`, so that files
            # saved now load into earlier releases of kerasdist too.
            config.update(
                compression=compression_name(self.compression),
                sparse_as_dense=self.sparse_as_dense,
                delay_gradients=self.delay_gradients,
                one_bit_gradients=self.one_bit_gradients,
            )
        else:
            config["reduction"] = keras.saving.serialize_keras_object(self.reduction)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("optimizer"), custom_objects=custom_objects)
        noise = config.pop("gradient_noise_scale", None)
        if config.get("reduction") is not None:
            config["reduction"] = keras.saving.deserialize_keras_object(
                config["reduction"], custom_objects=custom_objects
            )
        return cls(inner, gradient_noise_scale=None if noise is None else GradientNoiseScale(**noise), **config)


class _HeldRows:
    """One variable's embedding-gradient rows held by an accumulation window.

    One process with the whole batch hands its optimizer a lookup's gradient as `tf.IndexedSlices`,
    one row per lookup, duplicates kept; Adam, Adagrad and RMSprop square each row before adding
    duplicates up, so the slices' dense sum would update otherwise. So the window keeps every
    micro-batch's rows, and an update hands on all of them. Their number grows with each
    micro-batch: the two variables have no fixed first dimension and are assigned a concatenation.
    Plain `tf.Variable`s, outside Keras's list of optimizer variables (which `.keras` files save by
    position and shape); `DistributedOptimizer` saves them itself.
    """

    def __init__(self, variable):
        self._variable_name = variable_name(variable)
        self._row_shape = list(variable.shape[1:])
        with tf.init_scope():  # may be built inside a traced step
            self.values = tf.Variable(
                tf.zeros([0, *self._row_shape], variable.dtype),
                shape=[None, *self._row_shape],
                trainable=False,
                name="held_gradient_rows",
            )
            self.indices = tf.Variable(
                tf.zeros([0], tf.int64), shape=[None], trainable=False, name="held_gradient_row_indices"
            )
        self.sparse = None  # whether the gradients come as slices: the first trace that has one says

    @property
    def variables(self):
        return [self.values, self.indices]

    def note_kind(self, sparse):
        if self.sparse is None:
            self.sparse = sparse
        elif self.sparse != sparse:
            raise ValueError(
                f"kerasdist: the gradient of '{self._variable_name}' comes as tf.IndexedSlices in one "
                "traced step and as a dense tensor in another, but backward_passes_per_step > 1 "
                "keeps a variable's gradients of a window in one form. Compute it the same way in "
                "every step, or pass sparse_as_dense=True to DistributedOptimizer (gradients then "
                "add up dense)."
            )

    def add(self, slices):
        self.values.assign(tf.concat([self.values, tf.cast(slices.values, self.values.dtype)], 0))
        self.indices.assign(tf.concat([self.indices, tf.cast(slices.indices, tf.int64)], 0))

    def slices(self, dense_shape, divisor):
        """The held rows as one gradient, their values divided by `divisor`."""
        return tf.IndexedSlices(
            self.values / tf.cast(divisor, self.values.dtype), tf.identity(self.indices), dense_shape
        )

    def clear(self):
        self.values.assign(tf.zeros([0, *self._row_shape], self.values.dtype))
        self.indices.assign(tf.zeros([0], tf.int64))

    def save(self, store, index):
        indices = self.indices.numpy()
        if len(indices):
            store[f"held_gradient_rows_{index}"] = self.values.numpy()
            store[f"held_gradient_row_indices_{index}"] = indices

    def load(self, store, index):
        if f"held_gradient_rows_{index}" not in store.keys():
            self.clear()
            return
        self.values.assign(store[f"held_gradient_rows_{index}"])
        self.indices.assign(store[f"held_gradient_row_indices_{index}"])
        self.note_kind(True)


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
    "trained its own model; rank 0's weights were broadcast to every rank before it, but the first "
    "step's gradients were computed from each rank's own weights. Nothing broadcast rank 0's state "
    "before training: for model.fit, pass callbacks=kerasdist.callbacks() (or "
    "kerasdist.callbacks.BroadcastGlobalState()); in a custom loop, call "
    "kerasdist.broadcast_variables(model.variables, root_rank=0) once they exist, before the first "
    "step (build the model first: model.build(shape) or a first call on a batch)."
)


def _same_weights_at_the_first_update(iterations, variables):
    """Control dependencies that make every rank's weights rank 0's before the first update.

    Ranks initialise their weights independently: without a broadcast of rank 0's state they
    would each train their own model, with no error. At the first update (`iterations` 0), one
    allgather of exact checksums tells whether the ranks agree; if not, rank 0's trainable
    weights are broadcast and rank 0 says so. Every rank sees the same gathered checksums, so
    every rank takes the same branch.
    """
    if runtime.state().size == 1 or not variables:
        return []

    def check():
        checksums = ops.allgather(tf.stack([_bit_pattern_checksum(v) for v in variables])[tf.newaxis])
        differ = tf.reduce_any(tf.not_equal(checksums, checksums[:1]))

        def broadcast():
            ops.broadcast_variables(variables, root_rank=0)
            if runtime.state().rank == 0:
                tf.print(_DIFFERENT_WEIGHTS, output_stream=sys.stderr)
            return tf.constant(True)

        return tf.cond(differ, broadcast, lambda: tf.constant(False))

    return [tf.cond(tf.equal(iterations, 0), check, lambda: tf.constant(False))]


def _bit_pattern_checksum(variable):
    """The sum of a variable's bit patterns, exact: ranks holding equal values get equal sums
    whatever order their reductions add in (a float sum could differ in its last bits)."""
    value = tf.convert_to_tensor(variable)
    if value.dtype.is_floating:  # float64 becomes pairs of int32
        value = tf.bitcast(value, tf.int16 if value.dtype.size == 2 else tf.int32)
    return tf.reduce_sum(tf.cast(value, tf.int64))


def _chosen_reduction(reduction, compression, sparse_as_dense, delay_gradients, one_bit_gradients):
    """The reduction `DistributedOptimizer`'s arguments ask for, and how to name it in an error."""
    for argument, value in (("delay_gradients", delay_gradients), ("one_bit_gradients", one_bit_gradients)):
        # bool(x) would read "no" as True, and delay_gradients=2 as a delay of one step
        if not isinstance(value, bool):
            delay = " (the delay is always one update)" if argument == "delay_gradients" else ""
            raise TypeError(f"{argument}={value!r}: expected True or False{delay}")
    compression = compression_name(compression)
    if reduction is not None:
        if not isinstance(reduction, GradientReduction):
            raise TypeError(
                f"reduction={reduction!r}; expected a kerasdist.reductions.GradientReduction, "
                "e.g. kerasdist.reductions.Allreduce(compression=kerasdist.Compression.fp16)"
            )
        given = [
            f"{argument}={value!r}"
            for argument, value, default in (
                ("compression", compression, "none"),
                ("sparse_as_dense", sparse_as_dense, False),
                ("delay_gradients", delay_gradients, False),
                ("one_bit_gradients", one_bit_gradients, False),
            )
            if value != default
        ]
        if given:
            raise ValueError(
                f"reduction={reduction!r} decides how gradients travel: not also {', '.join(given)} "
                "(give those to the reduction, e.g. kerasdist.reductions.Allreduce(compression=...))"
            )
        return reduction, f"reduction={reduction!r}"
    if one_bit_gradients:
        if delay_gradients or compression != "none":
            raise ValueError(
                "one_bit_gradients=True sends signs and scales: not with delay_gradients=True or a compression"
            )
        return OneBit(), "one_bit_gradients=True"
    if delay_gradients:
        return Delayed(compression), "delay_gradients=True"
    return Allreduce(compression, sparse_as_dense), f"compression={compression!r}"


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
        self._compression = COMPRESSIONS[compression_name(compression)]
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
        sources_flat = tf.nest.flatten(sources, expand_composites=False)
        with tf.control_dependencies(_tape_gradient_layouts().check(flat, sources_flat)):
            reduced = reduce_gradients(flat, self._op, self._compression, self._sparse_as_dense)
        return tf.nest.pack_sequence_as(grads, reduced, expand_composites=False)


_TAPE_GRADIENT_LAYOUTS = []  # one GradientLayouts for every DistributedGradientTape, made at first use


def _tape_gradient_layouts():
    if not _TAPE_GRADIENT_LAYOUTS:
        _TAPE_GRADIENT_LAYOUTS.append(GradientLayouts())
    return _TAPE_GRADIENT_LAYOUTS[0]
