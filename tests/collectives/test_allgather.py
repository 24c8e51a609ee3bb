"""allgather: rank-order concatenation along dim 0, dim 0 may differ per rank."""

import numpy as np
import pytest
import tensorflow as tf
from kd_testutil import ALL_DTYPES, RANK, SHAPES, SIZE, as_tensor, check, dtype_id, rank_values, run, shape_id

import kerasdist as kd


def _rows(shape, rank, uneven):
    return shape[0] + rank if uneven else shape[0]


def _sent(dtype, shape, uneven, salt=""):
    return [rank_values(r, dtype, (_rows(shape, r, uneven),) + tuple(shape[1:]), salt=salt) for r in range(SIZE)]


@pytest.mark.parametrize("uneven", [False, True], ids=["same_rows", "rows_differ"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_allgather_concatenates_in_rank_order(dtype, shape, uneven):
    sent = _sent(dtype, shape, uneven)
    out = kd.allgather(as_tensor(sent[RANK], dtype))
    check(out, np.concatenate(sent), dtype)


@pytest.mark.parametrize("dtype", [tf.int32, tf.float32, tf.bfloat16, tf.bool], ids=dtype_id)
def test_allgather_in_tf_function(dtype):
    sent = _sent(dtype, (3, 5), uneven=True, salt="fn")
    out = run("function", kd.allgather, as_tensor(sent[RANK], dtype))
    check(out, np.concatenate(sent), dtype)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_allgather_when_rank_zero_sends_no_rows(mode):
    # Rank r sends r rows: rank 0 contributes an empty (0, 2) tensor.
    sent = [np.full((r, 2), r + 0.5) for r in range(SIZE)]
    out = run(mode, kd.allgather, tf.constant(sent[RANK].reshape(RANK, 2), tf.float32))
    check(out, np.concatenate(sent).reshape(-1, 2), tf.float32)


def test_allgather_of_a_large_tensor():
    rows = 1 << 16  # 64 Ki rows x 8 float32 = 2 MiB per rank
    x = tf.fill([rows, 8], float(RANK))
    out = kd.allgather(x)
    assert out.shape == (rows * SIZE, 8)
    got = out.numpy()
    for r in range(SIZE):
        assert np.all(got[r * rows : (r + 1) * rows] == r), f"block of rank {r} is wrong"


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_grouped_allgather_gathers_each_tensor_in_rank_order(mode):
    dtypes = [tf.float32, tf.int64, tf.bool]
    shapes = [(2, 3), (4,), (1, 2)]
    sent = [_sent(dtype, shape, uneven=True, salt=f"group{i}") for i, (dtype, shape) in enumerate(zip(dtypes, shapes))]
    outs = run(mode, lambda *xs: kd.grouped_allgather(list(xs)), *[as_tensor(s[RANK], d) for s, d in zip(sent, dtypes)])
    assert len(outs) == 3
    for out, s, dtype in zip(outs, sent, dtypes):
        check(out, np.concatenate(s), dtype)


def test_grouped_allgather_of_nothing_is_nothing():
    assert kd.grouped_allgather([]) == []
