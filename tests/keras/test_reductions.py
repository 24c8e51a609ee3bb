"""`DistributedOptimizer(reduction=...)`: the seam through which gradients travel.

A method written against the public base alone (top-k with error feedback, each rank sending its
largest values) trains as a NumPy simulation of every rank says, saves and loads; the built-in
reductions are what the old arguments give; what cannot combine is refused, naming what was given.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from linear_task import BATCH, assert_weights, compiled_model, fit, shard, simulated_error_feedback_weights

import kerasdist as kd
from kerasdist.reductions import Allreduce, Delayed, GradientReduction, OneBit

kd.init()
RANK, SIZE = kd.rank(), kd.size()


@keras.saving.register_keras_serializable(package="kerasdist_tests")
class TopK(GradientReduction):
    """Each rank sends the k largest magnitudes of each gradient (plus what it kept back before)
    as (index, value) pairs in allgathers, and keeps the rest for its next update."""

    keeps_gradients_across_updates = True
    gathers = True

    def __init__(self, k=1):
        self.k = k

    def build(self, optimizer, variables):
        self.residuals = [optimizer.add_variable_from_reference(v, name="top_k_residual") for v in variables]

    def per_rank_variables(self):
        return self.residuals

    def reduce(self, gradients, variables, op):
        reduced = []
        for gradient, residual in zip(gradients, self.slots(self.residuals, variables)):
            corrected = tf.reshape(tf.convert_to_tensor(gradient) + residual, [-1])
            _, where = tf.math.top_k(tf.abs(corrected), min(self.k, corrected.shape[0]))
            sent = tf.gather(corrected, where)
            residual.assign(
                tf.reshape(tf.tensor_scatter_nd_update(corrected, where[:, None], tf.zeros_like(sent)), residual.shape)
            )
            total = tf.scatter_nd(kd.allgather(where)[:, None], kd.allgather(sent), corrected.shape)
            if op == kd.Average:
                total /= kd.size()
            reduced.append(tf.reshape(total, tf.shape(gradient)))
        return reduced

    def get_config(self):
        return {"k": self.k}


class WireFormatPerVariable(GradientReduction):
    """Each variable's gradient in a wire format of its own, all in one grouped allreduce: what
    the built-in `Allreduce` does for its statistics, written with the public API alone."""

    def __init__(self, compressions):
        self.compressions = compressions

    def reduce(self, gradients, variables, op):
        return kd.grouped_allreduce(gradients, op, compression=self.slots(self.compressions, variables))


# 1 + 2**-9 + 2**-12, times 2**rank: exact in float32; float16 keeps the 2**-9 (10 bits of
# mantissa), bfloat16 neither (7 bits). Each rank's value sits in its own element, so the sums
# are exact in every format and show which format each gradient travelled in.
EVERY_RANKS_VALUE = np.array([(1 + 2**-9 + 2**-12) * 2.0**r for r in range(SIZE)], np.float32)


def test_a_method_of_ones_own_sends_each_gradient_in_its_own_wire_format():
    formats = [kd.Compression.none, kd.Compression.bf16, kd.Compression.fp16]
    variables = [keras.Variable(np.zeros(SIZE, np.float32)) for _ in formats]
    optimizer = kd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=kd.Sum, reduction=WireFormatPerVariable(formats))
    own = np.where(np.arange(SIZE) == RANK, EVERY_RANKS_VALUE, 0)
    optimizer.apply([tf.constant(own) for _ in formats], variables)
    expected = [
        EVERY_RANKS_VALUE,
        EVERY_RANKS_VALUE.astype(tf.bfloat16.as_numpy_dtype),
        EVERY_RANKS_VALUE.astype(np.float16),
    ]
    expected = [sums.astype(np.float32) for sums in expected]
    for variable, sums in zip(variables, expected, strict=True):
        np.testing.assert_array_equal(-variable.numpy(), sums)
    # The three formats give three different sums: the test tells them apart.
    assert len({tuple(sums) for sums in expected}) == 3


def test_a_list_of_wire_formats_of_another_length_is_refused_naming_the_call():
    with pytest.raises(ValueError, match=r"grouped_allreduce of 2 tensor\(s\) \('wire_formats'\): compression= takes"):
        kd.grouped_allreduce([tf.ones(1), tf.ones(1)], compression=[kd.Compression.fp16], name="wire_formats")


def simulated_top_k_weights(epochs, k=1):
    def top_k(corrected):
        largest = np.argsort(-np.abs(corrected.ravel()), kind="stable")[:k]
        sent = np.zeros(corrected.size, corrected.dtype)
        sent[largest] = corrected.ravel()[largest]
        return sent.reshape(corrected.shape)

    return simulated_error_feedback_weights(epochs, SIZE, top_k)


def test_a_method_of_ones_own_trains_as_every_rank_keeping_back_all_but_its_top_k():
    model = compiled_model(reduction=TopK(k=1))
    fit(model, epochs=3)
    assert_weights(model, simulated_top_k_weights(3), rtol=1e-4, atol=1e-5)
    # The simulation tells top-1 from exact averaging: the test could fail.
    assert not np.allclose(model.get_weights()[0], simulated_top_k_weights(3, k=3)[0], atol=1e-3)


def test_its_state_saves_and_loads_with_the_optimizer_and_training_continues_exactly(tmp_path):
    path = os.path.join(str(tmp_path), f"top_k_rank{RANK}.keras")
    model = compiled_model(reduction=TopK(k=1))
    fit(model, epochs=1)
    model.save(path)
    resumed = keras.saving.load_model(path)
    assert type(resumed.optimizer.reduction) is TopK and resumed.optimizer.reduction.k == 1
    saved_per_rank = resumed.optimizer.per_rank_variables()
    assert all(a is b for a, b in zip(saved_per_rank, resumed.optimizer.reduction.residuals, strict=True))
    fit(resumed, epochs=2)
    assert_weights(resumed, simulated_top_k_weights(3), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "arguments, reduction",
    [
        ({}, Allreduce()),
        ({"compression": kd.Compression.fp16, "sparse_as_dense": True}, Allreduce(kd.Compression.fp16, True)),
        ({"delay_gradients": True, "compression": kd.Compression.bf16}, Delayed(kd.Compression.bf16)),
        ({"one_bit_gradients": True}, OneBit()),
    ],
    ids=["default", "compression", "delay_gradients", "one_bit_gradients"],
)
def test_the_old_arguments_are_the_built_in_reductions(arguments, reduction):
    optimizer = kd.DistributedOptimizer(keras.optimizers.SGD(0.1), **arguments)
    assert repr(optimizer.reduction) == repr(reduction)
    config = optimizer.get_config()
    assert "reduction" not in config  # saved as the old arguments: earlier releases load the file
    assert repr(kd.DistributedOptimizer.from_config(config).reduction) == repr(reduction)


def test_delayed_given_as_a_reduction_trains_as_delay_gradients():
    by_argument, by_reduction = compiled_model(delay_gradients=True), compiled_model(reduction=Delayed())
    for model in (by_argument, by_reduction):
        fit(model, epochs=2)
    for a, b in zip(by_argument.get_weights(), by_reduction.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_reduction_with_the_old_arguments_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"reduction=OneBit\(\) decides .* not also compression='fp16'"):
        kd.DistributedOptimizer(keras.optimizers.SGD(0.1), reduction=OneBit(), compression=kd.Compression.fp16)


def test_a_reduction_that_is_not_one_is_refused():
    with pytest.raises(TypeError, match=r"reduction='fp16'; expected a kerasdist.reductions.GradientReduction"):
        kd.DistributedOptimizer(keras.optimizers.SGD(0.1), reduction="fp16")


def test_a_reduction_cannot_serve_two_optimizers():
    shared = TopK()
    compiled_model(reduction=shared).optimizer.build([keras.Variable(np.zeros(2, np.float32))])
    second = kd.DistributedOptimizer(keras.optimizers.SGD(0.1), reduction=shared)
    with pytest.raises(ValueError, match="this TopK already belongs to an optimizer"):
        second.build([keras.Variable(np.zeros(2, np.float32))])


def test_a_method_that_keeps_gradients_is_refused_with_the_noise_scale_and_with_loss_scaling():
    with pytest.raises(ValueError, match=r"noise scale .* not with reduction=TopK\(k=1\)"):
        kd.DistributedOptimizer(
            keras.optimizers.SGD(0.1), reduction=TopK(), gradient_noise_scale=kd.GradientNoiseScale()
        )
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match=r"reduction=TopK\(k=1\) carries gradients .* not with loss scaling"):
        kd.DistributedOptimizer(scaled, reduction=TopK())


def test_join_refuses_a_method_that_gathers():
    model = compiled_model(reduction=TopK())
    x, y = shard(RANK)
    with pytest.raises(ValueError, match=r"Join .* does not work with reduction=TopK\(k=1\)"):
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[kd.callbacks.Join()])
