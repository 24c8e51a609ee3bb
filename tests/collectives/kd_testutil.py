"""Helpers for the collective tests.

Every rank builds the input of *every* rank from (rank, dtype, shape, purpose),
so each rank can compute the expected result of a collective with NumPy alone,
independently of kerasdist. Values are small integers (quarters for float32 and
float64) so that sums, minima, maxima and products are exact in every dtype,
including float16 and bfloat16; only Average on floats needs a tolerance.
"""

import zlib

import numpy as np
import pytest
import tensorflow as tf

import kerasdist as kd

kd.init()
RANK = kd.rank()
SIZE = kd.size()

NUMERIC_DTYPES = [tf.uint8, tf.int8, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32, tf.float64]
FLOAT_DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
ALL_DTYPES = NUMERIC_DTYPES + [tf.bool]
SHAPES = [(7,), (3, 5), (2, 3, 4)]
REDUCE_OPS = ["Sum", "Average", "Min", "Max", "Product"]
MODES = ["eager", "function"]

# Relative tolerance for results that involve one inexact division or scaling.
_RTOL = {tf.float16: 4e-3, tf.bfloat16: 2e-2, tf.float32: 2e-6, tf.float64: 1e-13}

needs_two_ranks = pytest.mark.skipif(SIZE < 2, reason="needs at least 2 ranks (run under mpiexec -n 2)")


def dtype_id(dtype):
    return dtype.name


def shape_id(shape):
    return "x".join(str(d) for d in shape) or "scalar"


def reduce_op(op_name):
    return getattr(kd, op_name)


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def rank_values(rank, dtype, shape, purpose="sum", salt=""):
    """What `rank` sends for a test: int64, float64 or bool NumPy values.

    `purpose="product"` draws from {-3..3} without 0 (only +-1 beyond rank 2)
    so that a product over ranks stays within int8; otherwise the magnitude
    shrinks with the world size so that a sum over ranks fits in int8/uint8.
    """
    rng = _rng(rank, dtype.name, tuple(shape), purpose, salt)
    shape = tuple(shape)
    if dtype == tf.bool:
        return rng.integers(0, 2, size=shape).astype(bool)
    if purpose == "product":
        if rank < 3:
            choices = [1, 2, 3] if dtype.is_unsigned else [-3, -2, -1, 1, 2, 3]
        else:
            choices = [1] if dtype.is_unsigned else [-1, 1]
        return rng.choice(choices, size=shape).astype(np.int64)
    amplitude = max(1, 60 // max(SIZE, 3))
    if dtype.is_unsigned:
        values = rng.integers(0, 2 * amplitude, size=shape)
    else:
        values = rng.integers(-amplitude, amplitude, size=shape)
    if dtype in (tf.float32, tf.float64):
        return values + 0.25 * rng.integers(0, 4, size=shape)
    return values.astype(np.float64) if dtype.is_floating else values.astype(np.int64)


def as_tensor(values, dtype):
    if dtype == tf.bool:
        return tf.constant(values, dtype=tf.bool)
    return tf.cast(tf.constant(values), dtype)


def to_numpy(tensor):
    """float64 / int64 / bool NumPy copy of a tensor of any supported dtype."""
    tensor = tf.convert_to_tensor(tensor)
    if tensor.dtype == tf.bool:
        return tensor.numpy()
    if tensor.dtype.is_floating:
        return tf.cast(tensor, tf.float64).numpy()
    return tensor.numpy().astype(np.int64)


def reference_reduce(arrays, op_name, dtype):
    """NumPy reduction over ranks; Average on integers truncates toward zero."""
    stacked = np.stack(arrays)
    if op_name == "Sum":
        return stacked.sum(axis=0)
    if op_name == "Average":
        total = stacked.sum(axis=0)
        if dtype.is_integer:
            return np.sign(total) * (np.abs(total) // len(arrays))
        return total / len(arrays)
    if op_name == "Min":
        return stacked.min(axis=0)
    if op_name == "Max":
        return stacked.max(axis=0)
    if op_name == "Product":
        return stacked.prod(axis=0)
    raise ValueError(op_name)


def check(actual, expected, dtype, exact=True, magnitude=1.0):
    """Assert dtype, shape and values; inexact float results get a tolerance of
    rtol * max(1, magnitude), magnitude being the largest input in play."""
    assert actual.dtype == dtype, f"dtype {actual.dtype.name}, expected {dtype.name}"
    got = to_numpy(actual)
    expected = np.asarray(expected)
    assert got.shape == expected.shape, f"shape {got.shape}, expected {expected.shape}"
    if exact or not dtype.is_floating:
        np.testing.assert_array_equal(got, expected)
    else:
        rtol = _RTOL[dtype]
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol * max(1.0, float(magnitude)))


def max_abs(arrays):
    return max((float(np.max(np.abs(a))) for a in arrays if np.size(a)), default=1.0)


def split_rows(n, size=None):
    """Rows each rank gets when n rows are scattered: lower ranks take the remainder."""
    size = SIZE if size is None else size
    rows = [n // size + (1 if r < n % size else 0) for r in range(size)]
    offsets = np.concatenate([[0], np.cumsum(rows)]).astype(int)
    return rows, offsets


def run(mode, fn, *args):
    """Call fn(*args) eagerly or through a fresh tf.function."""
    if mode == "eager":
        return fn(*args)
    if mode == "function":
        return tf.function(fn)(*args)
    raise ValueError(mode)


def assert_world_still_works():
    """After an error, unnamed collectives must still pair up and be right."""
    total = kd.allreduce(tf.constant([RANK + 1.0, 1.0]), op=kd.Sum)
    gathered = kd.allgather(tf.constant([[RANK]], dtype=tf.int32))
    np.testing.assert_array_equal(total.numpy(), [SIZE * (SIZE + 1) / 2, SIZE])
    np.testing.assert_array_equal(gathered.numpy().ravel(), np.arange(SIZE))
