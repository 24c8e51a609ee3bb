"""Compression: float32/float64 travel as float16/bfloat16 and come back in
their own dtype; every other dtype passes through untouched."""

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from kd_testutil import MODES, RANK, SIZE, as_tensor, check, dtype_id, rank_values, run

import kerasdist as kd

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
    expected = np.sum([np.float32([r + 1 / 3, 1e-8 * (r + 1)]) for r in range(SIZE)], axis=0, dtype=np.float64)
    np.testing.assert_allclose(default.numpy(), expected, rtol=1e-6)


# float32 values that round differently to float16 (10 fraction bits) and bfloat16 (7), so
# the result tells which dtype travelled: 1 + 2^-9 + 2^-12 is 1 + 2^-9 in float16 but 1 in
# bfloat16; 1000.3 is 1000.5 and 1000; 0.1, -3e-3 and the fourth differ in all three.
_ROUNDING_PROBES = np.float32([1 + 2**-9 + 2**-12, 1000.3, 0.1, -(2 + 2**-5 + 2**-8 + 2**-14), -3e-3])
_WIRE_DTYPES = {"none": None, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}


def _as_sent_by(name, values):
    """What the wire makes of float32 values (NumPy's rounding, not TensorFlow's), as float64."""
    wire = _WIRE_DTYPES[name]
    return (values if wire is None else values.astype(wire)).astype(np.float64)


def _one_sender_per_element(rank):
    """Element i is sent by rank i % SIZE, the others send 0: the sum is the sender's value as
    the wire carried it, with no rounding of its own."""
    values = np.tile(_ROUNDING_PROBES, SIZE)
    return np.where(np.arange(len(values)) % SIZE == rank, values, np.float32(0))


def test_the_rounding_probes_tell_the_three_wire_formats_apart():
    none, fp16, bf16 = (_as_sent_by(name, _ROUNDING_PROBES) for name in ("none", "fp16", "bf16"))
    assert np.all(none != fp16) and np.all(none != bf16) and np.all(fp16 != bf16)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", WIDE_FLOATS, ids=dtype_id)
@pytest.mark.parametrize("compression", ["none"] + COMPRESSIONS)
def test_values_travel_in_the_wire_dtype_and_come_back_rounded_by_it(compression, dtype, mode):
    out = run(
        mode,
        lambda x: kd.allreduce(x, op=kd.Sum, compression=_compression(compression)),
        tf.constant(_one_sender_per_element(RANK), dtype),
    )
    check(out, _as_sent_by(compression, np.tile(_ROUNDING_PROBES, SIZE)), dtype)


@pytest.mark.parametrize("compression", ["none"] + COMPRESSIONS)
def test_each_tensor_of_a_group_travels_in_the_wire_dtype(compression):
    sent = [_one_sender_per_element(RANK), -2 * _one_sender_per_element(RANK)]
    outs = kd.grouped_allreduce(
        [tf.constant(sent[0], tf.float32), tf.constant(sent[1], tf.float64)],
        op=kd.Sum,
        compression=_compression(compression),
    )
    probes = np.tile(_ROUNDING_PROBES, SIZE)
    check(outs[0], _as_sent_by(compression, probes), tf.float32)
    check(outs[1], _as_sent_by(compression, -2 * probes), tf.float64)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", WIDE_FLOATS, ids=dtype_id)
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_representable_values_round_trip_exactly(compression, dtype, mode):
    sent = [_small_integers(r, (4, 5)) for r in range(SIZE)]
    out = run(
        mode,
        lambda x: kd.allreduce(x, op=kd.Sum, compression=_compression(compression)),
        tf.constant(sent[RANK], dtype),
    )
    check(out, np.sum(sent, axis=0), dtype)


@pytest.mark.parametrize("dtype", WIDE_FLOATS, ids=dtype_id)
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_unrepresentable_values_come_back_close_in_their_own_dtype(compression, dtype):
    sent = [np.linspace(-3, 3, 12) / 7 + r / 3 for r in range(SIZE)]
    out = kd.allreduce(tf.constant(sent[RANK], dtype), op=kd.Average, compression=_compression(compression))
    assert out.dtype == dtype
    rtol = 4e-3 if compression == "fp16" else 3e-2
    np.testing.assert_allclose(out.numpy(), np.mean(sent, axis=0), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_integers_pass_through_uncompressed(compression):
    # 100001 is not representable in float16 or bfloat16.
    sent = [np.array([100_001 * (r + 1), -7, r], np.int64) for r in range(SIZE)]
    out = kd.allreduce(tf.constant(sent[RANK], tf.int32), op=kd.Sum, compression=_compression(compression))
    check(out, np.sum(sent, axis=0), tf.int32)


def test_float16_passes_through_bf16_compression():
    # 100.25 * k needs 11 significant bits: exact in float16, not in bfloat16.
    sent = [np.full((3,), 100.25 * (r + 1)) for r in range(SIZE)]
    out = kd.allreduce(tf.constant(sent[RANK], tf.float16), op=kd.Sum, compression=kd.Compression.bf16)
    check(out, np.sum(sent, axis=0), tf.float16)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_grouped_allreduce_with_compression_keeps_each_dtype(compression, mode):
    dtypes = [tf.float32, tf.float64, tf.int32, tf.float16]
    sent = [[_small_integers(r, (3,), salt=i) for r in range(SIZE)] for i in range(len(dtypes))]
    tensors = [as_tensor(s[RANK], d) for s, d in zip(sent, dtypes)]
    outs = run(
        mode, lambda *ts: kd.grouped_allreduce(list(ts), op=kd.Sum, compression=_compression(compression)), *tensors
    )
    for out, s, dtype in zip(outs, sent, dtypes):
        check(out, np.sum(s, axis=0), dtype)
