"""16-bit reductions: float16 and bfloat16 tensors, and float32/float64 tensors compressed to
them, are summed in float32 and rounded to 16 bits once, after the scale.

The expected values are computed here with TensorFlow's own casts (round to nearest even) and
NumPy float32 arithmetic, in the order the documentation gives: round every rank's values to
the wire type, add them in float32, multiply by the scale (1/size for Average), round to the
wire type, return in the tensor's own dtype. The values are integers of 2,000-5,000 (+ rank),
which float16 and bfloat16 cannot all hold, so rounding happens at every step that rounds; at 3
ranks 2048 + 1 + 1 style sums also tell float32 accumulation from pairwise 16-bit additions.
"""

import numpy as np
import pytest
import tensorflow as tf
from kd_testutil import RANK, SIZE, run

import kerasdist as kd

# (tensor dtype, compression): native 16-bit tensors, and wide ones compressed.
CASES = [(tf.float16, None), (tf.bfloat16, None), (tf.float32, "fp16"), (tf.float32, "bf16"), (tf.float64, "fp16")]
# 5 values are fused with a companion tensor; 300,001 (600 KB on the wire) are reduced alone, in
# two pieces: the first splits evenly among the ranks (MPI's Alltoall and Allgather), the odd
# remainder does not at 2 or 3 ranks (their v-variants).
LENGTHS = [5, 300_001]


def _case_id(case):
    dtype, compression = case
    return dtype.name + (f"-as-{compression}" if compression else "")


def _wire(dtype, compression):
    if compression is None:
        return dtype
    return tf.float16 if compression == "fp16" else tf.bfloat16


def _sent(rank, length):
    rng = np.random.default_rng([rank, length])
    values = rng.integers(2000, 5000, size=length).astype(np.float64) + rank
    values[:3] = [2048.0, 1.0 if rank else 2048.0, -3.0]  # 2048 + 1 + 1: float16 keeps 2050 only in float32
    return values


def _rounded(values, wire):
    """`values` rounded to `wire` by TensorFlow, as float32."""
    return tf.cast(tf.cast(tf.constant(values, tf.float32), wire), tf.float32).numpy()


def _expected(op_name, dtype, compression, length):
    wire = _wire(dtype, compression)
    on_the_wire = [_rounded(_sent(r, length), wire) for r in range(SIZE)]
    if op_name == "Max":
        combined = np.max(on_the_wire, axis=0)
    else:
        combined = np.zeros(length, np.float32)
        for values in on_the_wire:  # in rank order, in float32
            combined = combined + values
        if op_name == "Average":
            combined = combined * np.float32(1.0 / SIZE)
    return _rounded(combined, wire).astype(np.float64)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("op_name", ["Sum", "Average", "Max"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_sixteen_bit_reductions_add_in_float32_and_round_once(case, op_name, length, mode):
    dtype, compression = case
    x = tf.cast(tf.constant(_sent(RANK, length)), dtype)
    companion = tf.ones([3], dtype)  # makes the short tensor part of a fused group

    def reduce(x, companion):
        return kd.grouped_allreduce(
            [x, companion], op=getattr(kd, op_name), compression=getattr(kd.Compression, compression or "none")
        )

    out, _ = run(mode, reduce, x, companion)
    assert out.dtype == dtype
    got = tf.cast(out, tf.float64).numpy()
    np.testing.assert_array_equal(got, _expected(op_name, dtype, compression, length))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_scale_factors_apply_before_the_one_rounding(case):
    dtype, compression = case
    wire = _wire(dtype, compression)
    sent = _sent(RANK, 7)
    out = kd.allreduce(
        tf.cast(tf.constant(sent), dtype),
        op=kd.Sum,
        prescale_factor=0.5,
        postscale_factor=3.0,
        compression=getattr(kd.Compression, compression or "none"),
    )
    on_the_wire = [
        _rounded(_rounded(_sent(r, 7), wire) * np.float32(0.5) if compression is None else _sent(r, 7) * 0.5, wire)
        for r in range(SIZE)
    ]
    combined = np.zeros(7, np.float32)
    for values in on_the_wire:
        combined = combined + values
    expected = _rounded(combined * np.float32(3.0), wire)
    np.testing.assert_array_equal(tf.cast(out, tf.float64).numpy(), expected.astype(np.float64))


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16], ids=lambda d: d.name)
def test_sixteen_bit_reducescatter_adds_in_float32(dtype):
    rows = 2 * SIZE + 1
    sent = [np.stack([_sent(r, 4) + i for i in range(rows)]) for r in range(SIZE)]
    out = kd.reducescatter(tf.cast(tf.constant(sent[RANK]), dtype), op=kd.Average)
    combined = np.zeros((rows, 4), np.float32)
    for values in sent:
        combined = combined + _rounded(values, dtype)
    expected = _rounded(combined * np.float32(1.0 / SIZE), dtype)
    start = sum(rows // SIZE + (1 if r < rows % SIZE else 0) for r in range(RANK))
    mine = rows // SIZE + (1 if RANK < rows % SIZE else 0)
    np.testing.assert_array_equal(tf.cast(out, tf.float64).numpy(), expected[start : start + mine])
