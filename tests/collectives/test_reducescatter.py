"""reducescatter: reduce over ranks, rank r keeps rows [start_r, end_r) of dim 0,
lower ranks taking the remainder rows."""

import numpy as np
import pytest
import tensorflow as tf
from kd_testutil import (
    NUMERIC_DTYPES,
    RANK,
    SHAPES,
    SIZE,
    as_tensor,
    check,
    dtype_id,
    max_abs,
    rank_values,
    reduce_op,
    reference_reduce,
    run,
    shape_id,
    split_rows,
)

import kerasdist as kd


def _expected_rows(sent, op_name, dtype):
    full = reference_reduce(sent, op_name, dtype)
    _, offsets = split_rows(full.shape[0])
    return full[offsets[RANK] : offsets[RANK + 1]]


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", NUMERIC_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op_name", ["Sum", "Average"])
def test_reducescatter_gives_each_rank_its_rows(op_name, dtype, shape):
    sent = [rank_values(r, dtype, shape) for r in range(SIZE)]
    out = kd.reducescatter(as_tensor(sent[RANK], dtype), op=reduce_op(op_name))
    check(
        out,
        _expected_rows(sent, op_name, dtype),
        dtype,
        exact=not (op_name == "Average" and dtype.is_floating),
        magnitude=max_abs(sent),
    )


@pytest.mark.parametrize("dtype", [tf.uint8, tf.int32, tf.float32], ids=dtype_id)
@pytest.mark.parametrize("op_name", ["Min", "Max", "Product"])
def test_reducescatter_with_other_reduce_ops(op_name, dtype):
    purpose = "product" if op_name == "Product" else "sum"
    sent = [rank_values(r, dtype, (5, 3), purpose) for r in range(SIZE)]
    out = kd.reducescatter(as_tensor(sent[RANK], dtype), op=reduce_op(op_name))
    check(out, _expected_rows(sent, op_name, dtype), dtype)


def test_reducescatter_default_op_is_average():
    sent = [np.full((2 * SIZE + 1, 2), 2.0 * (r + 1)) for r in range(SIZE)]
    out = kd.reducescatter(tf.constant(sent[RANK], tf.float32))
    rows, _ = split_rows(2 * SIZE + 1)
    check(out, np.full((rows[RANK], 2), float(SIZE + 1)), tf.float32)


def test_reducescatter_with_fewer_rows_than_ranks():
    # One row: rank 0 gets it, every other rank gets an empty (0, 3) result.
    out = kd.reducescatter(tf.fill([1, 3], float(RANK + 1)), op=kd.Sum)
    expected = np.full((1, 3), SIZE * (SIZE + 1) / 2) if RANK == 0 else np.zeros((0, 3))
    check(out, expected, tf.float32)


@pytest.mark.parametrize("dtype", [tf.int32, tf.float16, tf.float32], ids=dtype_id)
@pytest.mark.parametrize("op_name", ["Sum", "Average"])
def test_reducescatter_in_tf_function(op_name, dtype):
    sent = [rank_values(r, dtype, (7, 2), salt="fn") for r in range(SIZE)]
    op = reduce_op(op_name)
    out = run("function", lambda x: kd.reducescatter(x, op=op), as_tensor(sent[RANK], dtype))
    check(
        out,
        _expected_rows(sent, op_name, dtype),
        dtype,
        exact=not (op_name == "Average" and dtype.is_floating),
        magnitude=max_abs(sent),
    )


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_grouped_reducescatter_reduces_each_tensor_like_reducescatter(mode):
    dtypes = [tf.float32, tf.int32, tf.float64]
    shapes = [(SIZE * 2 + 1, 3), (SIZE,), (5,)]
    sent = [
        [rank_values(r, dtype, shape, salt=f"g{i}") for r in range(SIZE)]
        for i, (dtype, shape) in enumerate(zip(dtypes, shapes))
    ]
    outs = run(
        mode,
        lambda *xs: kd.grouped_reducescatter(list(xs), op=kd.Sum),
        *[as_tensor(s[RANK], dtype) for s, dtype in zip(sent, dtypes)],
    )
    assert len(outs) == 3
    for out, s, dtype in zip(outs, sent, dtypes):
        check(out, _expected_rows(s, "Sum", dtype), dtype)
