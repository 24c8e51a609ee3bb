"""Average of integer tensors is exact: the sum over ranks never wraps before the divide.

`trunc(sum / n)` computed in Python's unbounded integers is what every integer dtype must give,
values at the dtype's limits included (the probe of issue 49: int8 [100] and [100] gave -28), on
allreduce, reducescatter and their grouped forms, eagerly and inside a tf.function. Sum, on the
other hand, wraps on overflow exactly as NumPy's does, as documented.
"""

import numpy as np
import pytest
import tensorflow as tf
from kd_testutil import MODES, RANK, SIZE, dtype_id, run, split_rows

import kerasdist as kd

INTEGER_DTYPES = [tf.uint8, tf.int8, tf.int32, tf.int64]


def _sent(rank, dtype):
    """What `rank` sends: a column of values at and near the dtype's limits, some alike on every
    rank (their mean is themselves), some varying by rank and sign."""
    low, high = dtype.min, dtype.max
    middle = (low + high) // 2
    sign = 1 if rank % 2 == 0 else -1
    values = [high, low, high - rank, low + rank, high if rank % 2 else low, middle + sign * (rank + 1)]
    values += [100, 34, min(high, 100 + 3 * rank), max(low, rank - 1), 0, 1]
    if low < 0:
        values += [sign * high, -100, -(rank + 1), sign * (high // 3)]
    return values


def _truncated_mean(dtype, size=SIZE):
    """Every rank's value's mean, truncated toward zero, in Python integers (no overflow)."""
    columns = zip(*(_sent(r, dtype) for r in range(size)))
    means = []
    for column in columns:
        total = sum(column)
        means.append(total // size if total >= 0 else -(-total // size))
    return np.array(means, dtype=dtype.as_numpy_dtype)


def _as_rows(values, dtype):
    return tf.constant(np.array(values, dtype=dtype.as_numpy_dtype)[:, np.newaxis])


def _my_rows(full):
    _, offsets = split_rows(len(full))
    return full[offsets[RANK] : offsets[RANK + 1]]


_KINDS = {
    "allreduce": lambda x: kd.allreduce(x),
    "grouped_allreduce": lambda x: kd.grouped_allreduce([x, tf.cast(x, tf.float64), x])[2],
    "reducescatter": lambda x: kd.reducescatter(x),
    "grouped_reducescatter": lambda x: kd.grouped_reducescatter([tf.cast(x, tf.float32), x])[1],
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", sorted(_KINDS))
@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=dtype_id)
def test_integer_average_is_the_truncated_mean_even_at_the_dtypes_limits(dtype, kind, mode):
    out = run(mode, _KINDS[kind], _as_rows(_sent(RANK, dtype), dtype))
    expected = _truncated_mean(dtype)[:, np.newaxis]
    if "reducescatter" in kind:
        expected = _my_rows(expected)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out.numpy(), expected)


@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=dtype_id)
def test_every_integer_tensor_of_a_mixed_group_is_averaged_exactly(dtype):
    # The floats of the group keep their own reduction; each integer tensor its exact mean.
    other = tf.int8 if dtype != tf.int8 else tf.int64
    floats = tf.constant([RANK + 0.5, -2.0])
    outs = kd.grouped_allreduce(
        [_as_rows(_sent(RANK, dtype), dtype), floats, _as_rows(_sent(RANK, other), other)], op=kd.Average
    )
    np.testing.assert_array_equal(outs[0].numpy(), _truncated_mean(dtype)[:, np.newaxis])
    np.testing.assert_allclose(outs[1].numpy(), [(SIZE - 1) / 2 + 0.5, -2.0], rtol=1e-6)
    np.testing.assert_array_equal(outs[2].numpy(), _truncated_mean(other)[:, np.newaxis])


@pytest.mark.parametrize("mode", MODES)
def test_the_probes_int8_averages_are_the_mean(mode):
    out = run(mode, lambda x: kd.allreduce(x), tf.constant([100, 34, -100, 127, -128], tf.int8))
    np.testing.assert_array_equal(out.numpy(), [100, 34, -100, 127, -128])


def test_an_int64_scalar_is_averaged_exactly():
    value = np.int64(2**63 - 1 - RANK)
    total = sum(2**63 - 1 - r for r in range(SIZE))
    assert int(kd.allreduce(tf.constant(value))) == total // SIZE


def test_integer_average_with_scale_factors_is_still_refused():
    with pytest.raises(tf.errors.InvalidArgumentError, match="floating-point tensors only"):
        kd.allreduce(tf.constant([1, 2], tf.int8), prescale_factor=2.0)


@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=dtype_id)
def test_integer_sum_wraps_on_overflow_as_numpy_does(dtype):
    out = kd.allreduce(_as_rows(_sent(RANK, dtype), dtype), op=kd.Sum)
    sent = np.array([_sent(r, dtype) for r in range(SIZE)], dtype=dtype.as_numpy_dtype)
    with np.errstate(over="ignore"):
        expected = sent.sum(axis=0, dtype=dtype.as_numpy_dtype)
    np.testing.assert_array_equal(out.numpy(), expected[:, np.newaxis])


@pytest.mark.parametrize("ranks", [1, 2, 3, 5, 7, 64])
def test_int64_parts_summed_over_any_number_of_ranks_give_the_truncated_mean(ranks):
    # The division of the two summed halves, checked against Python's integers on many values,
    # as if `ranks` ranks had sent them (no collective involved).
    from kerasdist import ops

    rng = np.random.default_rng(ranks)
    edges = np.array([2**63 - 1, -(2**63), 2**62, -(2**62) - 1, 2**32, -(2**32), 1, -1, 0], np.int64)
    values = np.concatenate([rng.choice(edges, (ranks, 300)), rng.integers(-(2**63), 2**63 - 1, (ranks, 300))], axis=1)
    parts = ops._integer_average_parts(tf.constant(values)).numpy().sum(axis=0)  # fits: no wrap
    got = ops._truncated_mean(tf.constant(parts), tf.constant(ranks, tf.int64), tf.int64).numpy()
    totals = [sum(int(v) for v in column) for column in values.T]
    np.testing.assert_array_equal(got, [t // ranks if t >= 0 else -(-t // ranks) for t in totals])
