"""Allreduces whatever algorithm MPI runs them with (KERASDIST_ALLREDUCE_ALGORITHM): results equal
NumPy's to float tolerance and are the same bits on every rank. `make test` runs this file as part
of the suite (MPI's own choice on one host) and again with KERASDIST_ALLREDUCE_ALGORITHM=ring at 2
and 3 ranks, where every float and integer allreduce that MPI reduces runs as MPICH's ring, and
with KERASDIST_ALLREDUCE_ALGORITHM=hierarchical on 2 and 3 hosts of 2 ranks that MPICH emulates
(MPIR_CVAR_NUM_CLIQUES), where they run as reduce-scatter within hosts, allreduce across,
allgather within; the lengths leave a rest that does not split evenly among a host's ranks.

The float values are not small integers: sums round, and they round differently in different
orders, so a rank that combined in an order of its own would show in the bitwise comparison."""

import numpy as np
import pytest
import tensorflow as tf
from kd_testutil import RANK, SIZE, dtype_id

import kerasdist as kd

# 5 values are fused with a companion; 100,003 (400 KB as float32) and 1,000,003 are reduced alone,
# and the largest in pieces when the fusion threshold is small; none divides evenly among 2 or 3 ranks.
LENGTHS = [5, 100_003, 1_000_003]
FLOATS = [tf.float32, tf.float64]
OPS = ["Sum", "Average", "Min", "Max"]
_BITS = {tf.float32: tf.int32, tf.float64: tf.int64, tf.int32: tf.int32}


def _sent(rank, dtype, length, salt=0):
    rng = np.random.default_rng([rank, length, salt])
    if dtype == tf.int32:
        return rng.integers(-1000, 1000, size=length)
    return rng.standard_normal(length) * 10.0 ** rng.integers(-3, 4, size=length)


def _expected(op_name, dtype, length, salt=0):
    # What every rank sent, in its own dtype, combined in float64 (exact for Min and Max).
    sent = np.stack([tf.constant(_sent(r, dtype, length, salt), dtype).numpy().astype(np.float64) for r in range(SIZE)])
    combined = {"Sum": np.sum, "Average": np.mean, "Min": np.min, "Max": np.max}[op_name](sent, axis=0)
    return combined, np.abs(sent).sum(axis=0)


def _check_close(out, op_name, dtype, length, salt=0):
    expected, magnitude = _expected(op_name, dtype, length, salt)
    got = out.numpy().astype(np.float64)
    if op_name in ("Min", "Max") or dtype == tf.int32:
        np.testing.assert_array_equal(got, expected)
        return
    # Each addition rounds by at most one unit in the last place of the running sum.
    unit = np.finfo(dtype.as_numpy_dtype).eps
    np.testing.assert_array_less(np.abs(got - expected), SIZE * unit * magnitude + np.finfo(np.float64).tiny)


def _check_same_bits_on_every_rank(out):
    bits = tf.bitcast(out, _BITS[out.dtype])
    rows = kd.allgather(bits[tf.newaxis]).numpy()
    different = [r for r in range(SIZE) if not np.array_equal(rows[r], rows[0])]
    assert different == [], f"ranks {different} hold other bits than rank 0 (of {SIZE})"


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("dtype", FLOATS, ids=dtype_id)
@pytest.mark.parametrize("op_name", OPS)
def test_float_allreduce_matches_numpy_and_is_the_same_on_every_rank(op_name, dtype, length):
    out = kd.allreduce(tf.constant(_sent(RANK, dtype, length), dtype), op=getattr(kd, op_name))
    _check_close(out, op_name, dtype, length)
    _check_same_bits_on_every_rank(out)


@pytest.mark.parametrize("length", LENGTHS)
def test_integer_sum_is_exact(length):
    out = kd.allreduce(tf.constant(_sent(RANK, tf.int32, length), tf.int32), op=kd.Sum)
    _check_close(out, "Sum", tf.int32, length)


@pytest.mark.parametrize("op_name", ["Sum", "Average"])
def test_fused_group_matches_numpy_and_is_the_same_on_every_rank(op_name):
    lengths = [5, 1000, 30_001, 65_536]  # each under the fusion limit: one fused call
    outs = tf.function(
        lambda: kd.grouped_allreduce(
            [tf.constant(_sent(RANK, tf.float32, n, salt=i), tf.float32) for i, n in enumerate(lengths)],
            op=getattr(kd, op_name),
        )
    )()
    for i, (out, n) in enumerate(zip(outs, lengths)):
        _check_close(out, op_name, tf.float32, n, salt=i)
        _check_same_bits_on_every_rank(out)
