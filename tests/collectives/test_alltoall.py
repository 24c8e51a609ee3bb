"""alltoall: rank r sends splits[j] rows to rank j and gets back the rows sent
to it, concatenated in source-rank order."""

import numpy as np
import pytest
import tensorflow as tf
from kd_testutil import ALL_DTYPES, RANK, SHAPES, SIZE, as_tensor, check, dtype_id, rank_values, run, shape_id

import kerasdist as kd


def _uneven_splits(src):
    # Row counts from src to each destination; includes zeros once SIZE >= 2.
    return [(src + 2 * dst + 1) % 4 for dst in range(SIZE)]


def _exchange(dtype, inner, splits_of, salt=""):
    """Every rank's input and what this rank must receive."""
    sent = [rank_values(src, dtype, (sum(splits_of(src)),) + tuple(inner), salt=salt) for src in range(SIZE)]
    received = []
    for src in range(SIZE):
        start = sum(splits_of(src)[:RANK])
        received.append(sent[src][start : start + splits_of(src)[RANK]])
    return sent, np.concatenate(received)


@pytest.mark.parametrize("splits_mode", ["equal", "uneven"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_alltoall_exchanges_rows(dtype, shape, splits_mode):
    if splits_mode == "equal":
        splits_of = lambda src: [shape[0]] * SIZE  # noqa: E731
    else:
        splits_of = _uneven_splits
    sent, expected = _exchange(dtype, shape[1:], splits_of)
    x = as_tensor(sent[RANK], dtype)
    if splits_mode == "equal":
        out = kd.alltoall(x)
    else:
        out = kd.alltoall(x, splits=splits_of(RANK))
    check(out, expected, dtype)


@pytest.mark.parametrize("splits_dtype", [tf.int32, tf.int64], ids=dtype_id)
def test_alltoall_takes_splits_as_a_tensor(splits_dtype):
    sent, expected = _exchange(tf.float32, (2,), _uneven_splits, salt="t")
    out = kd.alltoall(tf.constant(sent[RANK], tf.float32), splits=tf.constant(_uneven_splits(RANK), splits_dtype))
    check(out, expected, tf.float32)


@pytest.mark.parametrize("dtype", [tf.int8, tf.int64, tf.bfloat16, tf.float32, tf.bool], ids=dtype_id)
def test_alltoall_in_tf_function(dtype):
    sent, expected = _exchange(dtype, (3,), _uneven_splits, salt="fn")
    out = run(
        "function",
        lambda x, s: kd.alltoall(x, splits=s),
        as_tensor(sent[RANK], dtype),
        tf.constant(_uneven_splits(RANK), tf.int32),
    )
    check(out, expected, dtype)


def test_alltoall_with_equal_split_in_tf_function():
    sent, expected = _exchange(tf.float32, (2,), lambda src: [2] * SIZE, salt="eq")
    out = run("function", kd.alltoall, tf.constant(sent[RANK], tf.float32))
    check(out, expected, tf.float32)


def test_alltoall_when_a_rank_sends_nothing():
    # Rank 0 sends no rows anywhere; everyone still gets the others' rows.
    splits_of = lambda src: [0 if src == 0 else dst + 1 for dst in range(SIZE)]  # noqa: E731
    sent, expected = _exchange(tf.int32, (2,), splits_of, salt="none")
    out = kd.alltoall(tf.constant(sent[RANK].reshape(-1, 2), tf.int32), splits=splits_of(RANK))
    check(out, expected.reshape(-1, 2), tf.int32)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_alltoall_returns_the_rows_each_rank_sent_when_asked(mode):
    sent, expected = _exchange(tf.float32, (2,), _uneven_splits, salt="rs")
    out, received = run(
        mode,
        lambda x, s: kd.alltoall(x, splits=s, return_received_splits=True),
        tf.constant(sent[RANK], tf.float32),
        tf.constant(_uneven_splits(RANK), tf.int32),
    )
    check(out, expected, tf.float32)
    assert received.dtype == tf.int32
    assert received.numpy().tolist() == [_uneven_splits(src)[RANK] for src in range(SIZE)]


def test_received_splits_send_the_rows_back():
    sent, _ = _exchange(tf.float32, (3,), _uneven_splits, salt="back")
    rows, received = kd.alltoall(
        tf.constant(sent[RANK], tf.float32), splits=_uneven_splits(RANK), return_received_splits=True
    )
    returned = kd.alltoall(rows, splits=received)
    np.testing.assert_array_equal(returned.numpy(), sent[RANK])
