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
