"""Independent collectives in one tf.function are matched by name, not by program order."""

import numpy as np
import tensorflow as tf
from kd_testutil import RANK, SIZE, needs_two_ranks

import kerasdist as kd


@needs_two_ranks
def test_ranks_may_issue_independent_collectives_in_different_orders():
    # Even ranks trace a, b, c; odd ranks c, b, a. Serializing the ops in program order (as
    # tf.function does for ordinary stateful ops) would deadlock this; negotiation must not.
    names = ["order_a", "order_b", "order_c"]
    if RANK % 2:
        names = names[::-1]

    @tf.function
    def step():
        return {
            name: kd.allreduce(tf.fill([4], float(RANK + len(name) + ord(name[-1]))), op=kd.Sum, name=name)
            for name in names
        }

    results = step()
    for name, value in results.items():
        expected = sum(r + len(name) + ord(name[-1]) for r in range(SIZE))
        np.testing.assert_array_equal(value.numpy(), np.full([4], expected, np.float32))


def test_an_allreduce_whose_result_is_unused_still_runs_on_every_rank():
    # Rank 0 discards the result; if tf.function pruned the op there, the others would wait.
    @tf.function
    def step():
        total = kd.allreduce(tf.constant([1.0]), op=kd.Sum, name="maybe_unused")
        return tf.constant(0.0) if RANK == 0 else total[0]

    value = float(step())
    assert value == (0.0 if RANK == 0 else float(SIZE))


def _centring_model(keras):
    """A Dense layer then one that subtracts the sum over ranks of each rank's batch mean: its
    unnamed allreduce is traced under Keras's automatic model and layer names."""

    class CentreAcrossRanks(keras.layers.Layer):
        def call(self, inputs):
            return inputs - kd.allreduce(tf.reduce_mean(inputs, axis=0), op=kd.Sum)

    return keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(2, kernel_initializer="ones", use_bias=False), CentreAcrossRanks()]
    )


def _collective_names(concrete_function):
    """The names the engine negotiates: the op's name input (before the call count), or where
    empty its node name."""
    return sorted(
        tf.get_static_value(op.inputs[-2]).item().decode() or op.name
        for op in concrete_function.graph.get_operations()
        if op.type.startswith("Kerasdist") and op.type != "KerasdistExecutionCount"
    )


def test_unnamed_collectives_in_a_function_are_named_alike_however_many_models_were_built_before():
    import keras

    def traced_names():
        model = _centring_model(keras)
        return _collective_names(tf.function(lambda x: model(x)).get_concrete_function(tf.ones((3, 2))))

    first = traced_names()
    for _ in range(3):  # moves Keras's automatic names on: sequential_7, dense_7, ...
        keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert traced_names() == first and len(first) == 1, first


@needs_two_ranks
def test_a_layer_collective_pairs_across_ranks_that_built_different_numbers_of_models():
    # An evaluation model built on rank 0 alone (here: RANK throwaway models) must not change
    # what the training function's collectives are called; it used to stall until the timeout.
    import keras

    for _ in range(2 * RANK):
        keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model = _centring_model(keras)
    batches = [np.arange(6, dtype=np.float32).reshape(3, 2) * (r + 1) for r in range(SIZE)]

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            out = model(x)
            if tf.reduce_sum(x) > 0:  # AutoGraph's tf.cond: a branch graph of its own
                out = kd.allgather(out)
            loss = tf.reduce_sum(out * out)
        return out, tape.gradient(loss, model.trainable_variables)[0]

    out, _ = step(tf.constant(batches[RANK]))
    projected = [b @ np.ones((2, 2), np.float32) for b in batches]
    centre = sum(p.mean(axis=0) for p in projected)
    np.testing.assert_allclose(out.numpy(), np.concatenate([p - centre for p in projected]), rtol=1e-6)
