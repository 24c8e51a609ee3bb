"""kerasdist.join(): ranks whose data runs out first stop early without the others hanging.

* Until every rank has joined, a joined rank takes part in the others' allreduces with zeros:
  Sum is the sum over the ranks that submitted the call, Average that sum divided by their
  number (not by size), fused groups of mixed dtypes included.
* join() returns the rank that joined last, the same on every rank, and resets: the next epoch
  may join again, with other ranks running out first.
* What a joined rank cannot contribute to (allgather, object collectives, Min) fails on every
  rank that called it, naming the op and the joined ranks, instead of hanging.

Rank r runs a number of steps that depends on r; every expectation is computed with NumPy from
every rank's inputs. Multi-rank cases have the tests' stall timeout as their hang bound.
"""

import numpy as np
import pytest
import tensorflow as tf
from kd_testutil import RANK, SIZE, assert_world_still_works, needs_two_ranks

import kerasdist as kd


def _values(rank, step, shape=(3,)):
    """What `rank` sends at `step`: small integers in quarters, exact in every float dtype."""
    rng = np.random.default_rng(1000 * rank + step)
    return rng.integers(-8, 8, size=shape) + 0.25 * rng.integers(0, 4, size=shape)


def _running(step, steps_of):
    """The ranks that still have data at `step`."""
    return [r for r in range(SIZE) if steps_of(r) > step]


def test_sum_adds_the_ranks_still_running_and_join_returns_the_last_rank():
    steps_of = lambda r: r + 1  # noqa: E731 - rank r has r + 1 batches
    got = [kd.allreduce(tf.constant(_values(RANK, s), tf.float64), op=kd.Sum) for s in range(steps_of(RANK))]
    assert kd.join() == SIZE - 1
    for step, out in enumerate(got):
        expected = np.sum([_values(r, step) for r in _running(step, steps_of)], axis=0)
        np.testing.assert_array_equal(out.numpy(), expected)
    assert_world_still_works()


def test_average_divides_by_the_ranks_still_running():
    steps_of = lambda r: 2 * r + 1  # noqa: E731
    got = [kd.allreduce(tf.constant(_values(RANK, s), tf.float32)) for s in range(steps_of(RANK))]
    last = kd.join()
    assert isinstance(last, int) and last == SIZE - 1
    for step, out in enumerate(got):
        expected = np.mean([_values(r, step) for r in _running(step, steps_of)], axis=0)
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6)


def test_integer_average_truncates_the_mean_of_the_ranks_still_running():
    steps_of = lambda r: r + 1  # noqa: E731
    got = [kd.allreduce(tf.constant([7 * (RANK + 1), -5], tf.int32)) for _ in range(steps_of(RANK))]
    kd.join()
    for step, out in enumerate(got):
        running = _running(step, steps_of)
        total = np.array([sum(7 * (r + 1) for r in running), -5 * len(running)])
        np.testing.assert_array_equal(out.numpy(), np.sign(total) * (np.abs(total) // len(running)))


@pytest.mark.parametrize("dtype", [tf.uint8, tf.int8, tf.int64], ids=lambda d: d.name)
def test_integer_average_at_the_dtypes_limits_is_exact_over_the_ranks_still_running(dtype):
    # Summed in the dtype itself, these wrapped before the divide.
    steps_of = lambda r: r + 1  # noqa: E731
    sent = lambda r: [dtype.max, dtype.max - r, dtype.min + r]  # noqa: E731
    got = [kd.allreduce(tf.constant(sent(RANK), dtype)) for _ in range(steps_of(RANK))]
    kd.join()
    for step, out in enumerate(got):
        running = _running(step, steps_of)
        totals = [sum(column) for column in zip(*(sent(r) for r in running))]
        expected = [t // len(running) if t >= 0 else -(-t // len(running)) for t in totals]
        assert out.numpy().tolist() == expected, (step, running)


_GROUP = [(tf.float32, (5,)), (tf.int32, (2, 3)), (tf.float64, (4, 1, 2)), (tf.float16, (6,)), (tf.float32, (2,))]


@pytest.mark.parametrize("op_name", ["Sum", "Average"])
def test_a_fused_group_of_mixed_dtypes_reduces_over_the_ranks_still_running(op_name):
    steps_of = lambda r: SIZE - r + 1  # noqa: E731 - here the last rank runs out first

    def sent_at(step):
        return [
            [np.round(_values(r, 10 * step + i, shape)) for i, (_, shape) in enumerate(_GROUP)] for r in range(SIZE)
        ]

    outs = [
        kd.grouped_allreduce(
            [tf.cast(tf.constant(v), dtype) for v, (dtype, _) in zip(sent_at(step)[RANK], _GROUP)],
            op=getattr(kd, op_name),
        )
        for step in range(steps_of(RANK))
    ]
    assert kd.join() == 0
    for step, got in enumerate(outs):
        sent, running = sent_at(step), _running(step, steps_of)
        for i, (dtype, _) in enumerate(_GROUP):
            total = np.sum([sent[r][i] for r in running], axis=0)
            if op_name == "Sum":
                expected = total
            elif dtype.is_integer:
                expected = np.sign(total) * (np.abs(total) // len(running))
            else:
                expected = total / len(running)
            assert got[i].dtype == dtype
            np.testing.assert_allclose(
                tf.cast(got[i], tf.float64).numpy(), expected, rtol=4e-3 if dtype == tf.float16 else 1e-6
            )


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_a_compressed_allreduce_reduces_over_the_ranks_still_running(compression):
    steps_of = lambda r: r + 1  # noqa: E731
    got = [
        kd.allreduce(tf.constant([float(RANK + 1), -2.0]), op=kd.Sum, compression=getattr(kd.Compression, compression))
        for _ in range(steps_of(RANK))
    ]
    kd.join()
    for step, out in enumerate(got):
        running = _running(step, steps_of)
        assert out.dtype == tf.float32
        np.testing.assert_array_equal(out.numpy(), [sum(r + 1 for r in running), -2.0 * len(running)])


def test_join_resets_so_the_next_epoch_can_join_again():
    epochs = [lambda r: r + 1, lambda r: SIZE - r]
    got, lasts = [], []
    for steps_of in epochs:
        got.append([kd.allreduce(tf.constant([float(RANK + 1)]), op=kd.Sum) for _ in range(steps_of(RANK))])
        lasts.append(kd.join())
    # Nobody is joined any more: every rank's data goes in again, Min included.
    minimum = kd.allreduce(tf.constant([float(RANK)]), op=kd.Min)
    assert lasts == [SIZE - 1, 0]
    for epoch, steps_of in enumerate(epochs):
        for step, out in enumerate(got[epoch]):
            assert out.numpy()[0] == sum(r + 1 for r in _running(step, steps_of)), (epoch, step)
    assert minimum.numpy()[0] == 0.0
    assert_world_still_works()


def _call_catching(fn):
    try:
        return fn(), None
    except Exception as error:  # noqa: BLE001 - asserted on by the caller
        return None, error


@needs_two_ranks
@pytest.mark.parametrize(
    "call",
    [
        lambda: kd.allgather(tf.constant([[RANK]])),
        lambda: kd.broadcast(tf.constant([1.0]), root_rank=SIZE - 1),
        lambda: kd.allgather_object(RANK),
        lambda: kd.allreduce(tf.constant([1.0]), op=kd.Min),
    ],
    ids=["allgather", "broadcast", "allgather_object", "allreduce_min"],
)
def test_what_a_joined_rank_cannot_contribute_to_fails_on_every_rank_that_calls_it(call):
    error = None
    if RANK != 0:  # rank 0 has no data and joins at once
        _, error = _call_catching(call)
    last = kd.join()
    assert last == SIZE - 1
    assert_world_still_works()
    if RANK != 0:
        assert isinstance(error, tf.errors.FailedPreconditionError), f"rank {RANK}: {error!r}"
        assert "rank(s) 0 have joined" in error.message, error.message
        assert any(op in error.message for op in ("allgather", "broadcast", "op Min")), error.message


@needs_two_ranks
def test_an_object_collective_refused_while_a_rank_has_joined_is_named_as_the_user_called_it():
    error = None
    if RANK != 0:
        _, error = _call_catching(lambda: kd.broadcast_object({"lr": 0.1}, root_rank=SIZE - 1, name="settings"))
    kd.join()
    assert_world_still_works()
    if RANK != 0:
        assert isinstance(error, tf.errors.FailedPreconditionError), f"rank {RANK}: {error!r}"
        assert "cannot run broadcast_object 'settings'" in error.message, error.message


@needs_two_ranks
def test_a_traced_step_pairs_again_after_ranks_ran_it_unequally_often_and_joined():
    # The ranks' counts of the step's calls differ after each epoch; join starts them alike again.
    @tf.function
    def summed_over_ranks(x):
        return kd.allreduce(x, op=kd.Sum)

    for _ in range(2):
        for _ in range(RANK + 1):  # rank r has r + 1 batches this epoch
            summed_over_ranks(tf.constant([1.0]))
        kd.join()
    for _ in range(2):
        assert float(summed_over_ranks(tf.constant([1.0]))[0]) == SIZE


def test_join_inside_a_tf_function_is_refused():
    with pytest.raises(RuntimeError, match="eagerly only"):
        tf.function(kd.join)()
    assert_world_still_works()


def test_a_custom_loop_with_unequal_batches_trains_to_the_weights_numpy_computes():
    # y = x . w with MSE: the gradient of rank r's batch is 2/n X_r^T (X_r w - y_r); each step
    # applies the average over the ranks that still have a batch.
    features, rows, lr = 3, 4, 0.05
    batches_of = lambda r: r + 2  # noqa: E731

    def batch(r, step):
        rng = np.random.default_rng(7919 * r + step)
        return rng.normal(size=(rows, features)), rng.normal(size=(rows, 1))

    w_init = np.array([[0.5], [-1.0], [2.0]])
    w = tf.Variable(w_init, dtype=tf.float64)
    for step in range(batches_of(RANK)):
        x, y = batch(RANK, step)
        with kd.DistributedGradientTape(tf.GradientTape()) as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
        (grad,) = tape.gradient(loss, [w])
        w.assign_sub(lr * grad)
    # The rank that joined last ran every step: its weights are the job's.
    last = kd.join()
    kd.broadcast_variables([w], root_rank=last)

    expected = w_init.copy()
    for step in range(max(batches_of(r) for r in range(SIZE))):
        grads = []
        for r in _running(step, batches_of):
            x, y = batch(r, step)
            grads.append(2.0 / rows * x.T @ (x @ expected - y))
        expected = expected - lr * np.mean(grads, axis=0)
    np.testing.assert_allclose(w.numpy(), expected, rtol=1e-12, atol=1e-12)
    every_rank = kd.allgather(w.value()[tf.newaxis]).numpy()
    assert (every_rank == every_rank[0]).all(), "ranks ended with different weights"
