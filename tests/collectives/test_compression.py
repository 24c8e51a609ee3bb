"""Compression: float32/float64 travel as float16/bfloat16 and come back in
their own dtype; every other dtype passes through untouched."""

import numpy as np
import pytest
import tensorflow as tf

import kerasdist as kd
from kd_testutil import (MODES, RANK, SIZE, as_tensor, check, dtype_id,
                         rank_values, run)

COMPRESSIONS = ["fp16", "bf16"]
WIDE_FLOATS = [tf.float32, tf.float64]


def _compression(name):
    return getattr(kd.Compression, name)


def _small_integers(rank, shape, salt=""):
    # Exact in float16 and bfloat16, and so are their sums over <= 4 ranks.
    return np.floor(rank_values(rank, tf.float64, shape, salt=salt))


def test_compression_none_is_the_default_and_exact():
    x = tf.constant([RANK + 1 / 3, 1e-8 * (RANK + 1)], tf.float32)
    default = kd.allreduce(x, op=kd.Sum)
    explicit = kd.allreduce(x, op=kd.Sum, compression=kd.Compression.none)
    np.testing.assert_array_equal(default.numpy(), explicit.numpy())
    expected = np.sum([np.float32([r + 1 / 3, 1e-8 * (r + 1)]) for r in range(SIZE)],
                      axis=0, dtype=np.float64)
    np.testing.assert_allclose(default.numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", WIDE_FLOATS, ids=dtype_id)
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_representable_values_round_trip_exactly(compression, dtype, mode):
    sent = [_small_integers(r, (4, 5)) for r in range(SIZE)]
    out = run(mode, lambda x: kd.allreduce(x, op=kd.Sum,
                                           compression=_compression(compression)),
              tf.constant(sent[RANK], dtype))
    check(out, np.sum(sent, axis=0), dtype)


@pytest.mark.parametrize("dtype", WIDE_FLOATS, ids=dtype_id)
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_unrepresentable_values_come_back_close_in_their_own_dtype(compression, dtype):
    sent = [np.linspace(-3, 3, 12) / 7 + r / 3 for r in range(SIZE)]
    out = kd.allreduce(tf.constant(sent[RANK], dtype), op=kd.Average,
                       compression=_compression(compression))
    assert out.dtype == dtype
    rtol = 4e-3 if compression == "fp16" else 3e-2
    np.testing.assert_allclose(out.numpy(), np.mean(sent, axis=0), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_integers_pass_through_uncompressed(compression):
    # 100001 is not representable in float16 or bfloat16.
    sent = [np.array([100_001 * (r + 1), -7, r], np.int64) for r in range(SIZE)]
    out = kd.allreduce(tf.constant(sent[RANK], tf.int32), op=kd.Sum,
                       compression=_compression(compression))
    check(out, np.sum(sent, axis=0), tf.int32)


def test_float16_passes_through_bf16_compression():
    # 100.25 * k needs 11 significant bits: exact in float16, not in bfloat16.
    sent = [np.full((3,), 100.25 * (r + 1)) for r in range(SIZE)]
    out = kd.allreduce(tf.constant(sent[RANK], tf.float16), op=kd.Sum,
                       compression=kd.Compression.bf16)
    check(out, np.sum(sent, axis=0), tf.float16)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_grouped_allreduce_with_compression_keeps_each_dtype(compression, mode):
    dtypes = [tf.float32, tf.float64, tf.int32, tf.float16]
    sent = [[_small_integers(r, (3,), salt=i) for r in range(SIZE)]
            for i in range(len(dtypes))]
    tensors = [as_tensor(s[RANK], d) for s, d in zip(sent, dtypes)]
    outs = run(mode, lambda *ts: kd.grouped_allreduce(
        list(ts), op=kd.Sum, compression=_compression(compression)), *tensors)
    for out, s, dtype in zip(outs, sent, dtypes):
        check(out, np.sum(s, axis=0), dtype)
