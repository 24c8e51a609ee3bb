"""Gradients of the collectives.

Convention: the global objective is the SUM over ranks of each rank's loss.
Here rank r's loss is sum(w_r * out_r) with weights w_r that every rank can
recompute, so d(global objective)/d(x_r) has a closed form in NumPy:

  allreduce Sum          sum_j w_j           Average: mean_j w_j
  allreduce scaled       pre * post * sum_j w_j
  allgather              (sum_j w_j)[rows of rank r]
  broadcast from root    sum_j w_j on the root, zeros elsewhere
  reducescatter Sum      concat_j w_j        Average: concat_j w_j / size
  alltoall               each sent row gets its receiver's weight for that row
"""

import numpy as np
import pytest
import tensorflow as tf
from kd_testutil import MODES, RANK, SIZE, as_tensor, check, rank_values, run, split_rows

import kerasdist as kd

GRAD_DTYPES = [tf.float32, tf.float64]


def _weights(rank, shape, dtype=tf.float32, salt=""):
    return rank_values(rank, dtype, shape, salt="w" + salt)


def _gradient(mode, forward, x, w):
    """d sum(w * forward(x)) / dx on this rank, eagerly or in a tf.function."""

    def grad(x, w):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(w * forward(x))
        return tape.gradient(loss, x)

    return run(mode, grad, x, w)


def _inputs(shape, dtype, salt=""):
    x = as_tensor(rank_values(RANK, dtype, shape, salt="x" + salt), dtype)
    weights = [_weights(r, shape, dtype, salt) for r in range(SIZE)]
    return x, weights


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
def test_allreduce_sum_gradient_sums_upstream_gradients(dtype, mode):
    x, w = _inputs((3, 4), dtype)
    g = _gradient(mode, lambda t: kd.allreduce(t, op=kd.Sum), x, as_tensor(w[RANK], dtype))
    check(g, np.sum(w, axis=0), dtype)


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_average_gradient_averages_upstream_gradients(mode):
    x, w = _inputs((5,), tf.float32, "avg")
    g = _gradient(mode, lambda t: kd.allreduce(t, op=kd.Average), x, as_tensor(w[RANK], tf.float32))
    check(g, np.mean(w, axis=0), tf.float32, exact=False, magnitude=20)


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_gradient_carries_the_scale_factors(mode):
    pre, post = 0.5, 3.0
    x, w = _inputs((4,), tf.float64, "scale")
    g = _gradient(
        mode,
        lambda t: kd.allreduce(t, op=kd.Sum, prescale_factor=pre, postscale_factor=post),
        x,
        as_tensor(w[RANK], tf.float64),
    )
    check(g, pre * post * np.sum(w, axis=0), tf.float64, exact=False, magnitude=60)


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce_gradient_matches_per_tensor_rule(mode):
    shapes = [(3,), (2, 2)]
    xs = [as_tensor(rank_values(RANK, tf.float32, s, salt=f"gx{i}"), tf.float32) for i, s in enumerate(shapes)]
    ws = [[_weights(r, s, salt=f"g{i}") for r in range(SIZE)] for i, s in enumerate(shapes)]

    def grads(x0, x1, w0, w1):
        with tf.GradientTape() as tape:
            tape.watch([x0, x1])
            y0, y1 = kd.grouped_allreduce([x0, x1], op=kd.Sum)
            loss = tf.reduce_sum(w0 * y0) + tf.reduce_sum(w1 * y1)
        return tape.gradient(loss, [x0, x1])

    g0, g1 = run(mode, grads, *xs, *[tf.constant(w[RANK], tf.float32) for w in ws])
    check(g0, np.sum(ws[0], axis=0), tf.float32)
    check(g1, np.sum(ws[1], axis=0), tf.float32)


@pytest.mark.parametrize("mode", MODES)
def test_allgather_gradient_is_this_ranks_slice_of_summed_gradients(mode):
    rows = [r + 1 for r in range(SIZE)]  # rank r contributes r + 1 rows
    offsets = np.concatenate([[0], np.cumsum(rows)])
    x = as_tensor(rank_values(RANK, tf.float32, (rows[RANK], 3), salt="ag"), tf.float32)
    w = [_weights(r, (offsets[-1], 3), salt="ag") for r in range(SIZE)]
    g = _gradient(mode, kd.allgather, x, tf.constant(w[RANK], tf.float32))
    check(g, np.sum(w, axis=0)[offsets[RANK] : offsets[RANK + 1]], tf.float32)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("root", ["first", "last"])
def test_broadcast_gradient_flows_only_to_the_root(root, mode):
    root_rank = 0 if root == "first" else SIZE - 1
    x, w = _inputs((2, 3), tf.float32, "bc")
    g = _gradient(mode, lambda t: kd.broadcast(t, root_rank=root_rank), x, tf.constant(w[RANK], tf.float32))
    expected = np.sum(w, axis=0) if RANK == root_rank else np.zeros((2, 3))
    check(g, expected, tf.float32)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op_name", ["Sum", "Average"])
def test_reducescatter_gradient_gathers_upstream_gradients(op_name, mode):
    n = 2 * SIZE + 1  # uneven rows for every size > 1
    rows, _ = split_rows(n)
    x = as_tensor(rank_values(RANK, tf.float32, (n, 2), salt="rs"), tf.float32)
    w = [_weights(r, (rows[r], 2), salt="rs") for r in range(SIZE)]
    op = getattr(kd, op_name)
    g = _gradient(mode, lambda t: kd.reducescatter(t, op=op), x, tf.constant(w[RANK], tf.float32))
    expected = np.concatenate(w)
    if op_name == "Average":
        expected = expected / SIZE
    check(g, expected, tf.float32, exact=op_name == "Sum", magnitude=20)


@pytest.mark.parametrize("mode", MODES)
def test_alltoall_gradient_returns_each_row_its_receivers_gradient(mode):
    # A row sent from src to dst is read once, by dst, so its gradient is dst's
    # weight at the place that row landed in dst's output.
    def splits_of(src):
        return [(src + 2 * dst + 1) % 4 for dst in range(SIZE)]

    received_rows = [sum(splits_of(src)[dst] for src in range(SIZE)) for dst in range(SIZE)]
    w = [_weights(dst, (received_rows[dst], 2), salt="a2a") for dst in range(SIZE)]
    expected = []
    for dst in range(SIZE):
        start = sum(splits_of(src)[dst] for src in range(RANK))  # rows from lower sources
        expected.append(w[dst][start : start + splits_of(RANK)[dst]])
    x = as_tensor(rank_values(RANK, tf.float32, (sum(splits_of(RANK)), 2), salt="a2a"), tf.float32)
    splits = tf.constant(splits_of(RANK), tf.int32)
    g = _gradient(mode, lambda t: kd.alltoall(t, splits=splits), x, tf.constant(w[RANK], tf.float32))
    check(g, np.concatenate(expected), tf.float32)
