"""Property-based tests (hypothesis) of the engine's bookkeeping on any input it may get.

* Fusion: any group of tensors (mixed dtypes, scalars, empty and long tensors, compression,
  scale factors) is packed into buffers and unpacked into the right outputs. Long tensors
  (past 256 KiB) are reduced alone, in pieces of the fusion threshold; the launch suite runs
  this module once more with a tiny threshold, so that pieces and packing boundaries fall
  everywhere.
* Negotiation: named requests that the ranks submit in different orders pair by name, through
  a response cache whose slots are refilled, invalidated (a name comes back with another shape)
  and, with a small capacity (the launch suite again), evicted at any point.

Every rank draws the same examples (derandomize), and the ranks agree on each example's outcome
before hypothesis sees it: a failure on one rank fails every rank alike, so shrinking stays in
step and no rank waits in a collective that the others have left.
"""

import itertools
import threading

import numpy as np
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kd_testutil import RANK, SIZE, as_tensor, check, max_abs, rank_values, reduce_op, reference_reduce
from mpi4py import MPI

import kerasdist as kd

SAME_EXAMPLES_ON_EVERY_RANK = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=30,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
_example_names = itertools.count()


def agreed(check_example):
    """Runs check_example(); if it failed on any rank, raises on every rank with all ranks' errors."""
    try:
        check_example()
        error = None
    except Exception as e:  # noqa: BLE001 - reported below, on every rank
        error = f"rank {RANK}: {type(e).__name__}: {e}"
    errors = [e for e in MPI.COMM_WORLD.allgather(error) if e]
    if errors:
        raise AssertionError("\n".join(errors))


# A tensor past 256 KiB is reduced alone, in its own memory (and in pieces of the threshold).
_LONG_SHAPES = [(70_000,), (260, 260)]
_SHAPES = st.one_of(
    st.lists(st.integers(0, 9), max_size=3).map(tuple),  # scalars and empty tensors included
    st.sampled_from(_LONG_SHAPES),
)
_DTYPES = [tf.uint8, tf.int8, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32, tf.float64]
_TENSORS = st.tuples(st.sampled_from(_DTYPES), _SHAPES)
# Powers of two keep the scaled values exact.
_SCALES = st.sampled_from([1.0, 0.5, 2.0, 0.25])
_WIRE_RTOL = {"fp16": 4e-3, "bf16": 2e-2}


@SAME_EXAMPLES_ON_EVERY_RANK
@given(
    group=st.lists(_TENSORS, min_size=1, max_size=10),
    op_name=st.sampled_from(["Sum", "Average", "Min", "Max"]),
    prescale=_SCALES,
    postscale=_SCALES,
    compression=st.sampled_from(["none", "fp16", "bf16"]),
)
def test_any_group_is_packed_and_unpacked_into_the_right_outputs(group, op_name, prescale, postscale, compression):
    all_floats = all(dtype.is_floating for dtype, _ in group)
    if not all_floats:  # scale factors apply to floating-point tensors only
        prescale = postscale = 1.0
    name = f"property_group_{next(_example_names)}"
    sent = [
        [rank_values(r, dtype, shape, salt=f"{name}/{i}") for r in range(SIZE)]
        for i, (dtype, shape) in enumerate(group)
    ]

    def check_example():
        tensors = [as_tensor(s[RANK], dtype) for s, (dtype, _) in zip(sent, group)]
        outs = kd.grouped_allreduce(
            tensors,
            op=reduce_op(op_name),
            name=name,
            prescale_factor=prescale,
            postscale_factor=postscale,
            compression=getattr(kd.Compression, compression),
        )
        assert len(outs) == len(group)
        for i, (out, s, (dtype, shape)) in enumerate(zip(outs, sent, group)):
            scaled = [prescale * np.asarray(v) for v in s]
            expected = postscale * reference_reduce(scaled, op_name, dtype)
            compressed = compression != "none" and dtype in (tf.float32, tf.float64)
            exact = not compressed and not (op_name == "Average" and dtype.is_floating)
            try:
                if compressed:
                    rtol = _WIRE_RTOL[compression]
                    assert out.dtype == dtype and tuple(out.shape) == shape
                    np.testing.assert_allclose(
                        out.numpy().astype(np.float64), expected, rtol=rtol, atol=rtol * max(1.0, max_abs(scaled))
                    )
                else:
                    check(out, expected, dtype, exact=exact, magnitude=max_abs(scaled))
            except AssertionError as e:
                raise AssertionError(f"tensor {i} ({dtype.name}, shape {shape}): {e}") from None

    agreed(check_example)


_NAME_POOL = [f"property_order_{k}" for k in range(10)]


@SAME_EXAMPLES_ON_EVERY_RANK
@given(
    requests=st.lists(
        st.tuples(st.sampled_from(_NAME_POOL), st.integers(1, 5)), min_size=1, max_size=8, unique_by=lambda r: r[0]
    ),
    order_seed=st.integers(0, 2**16),
)
def test_requests_submitted_in_any_order_pair_by_name(requests, order_seed):
    # The names recur across examples, so later examples find them cached; a name that comes
    # back with another length invalidates its slot.
    order = np.random.default_rng([order_seed, RANK]).permutation(len(requests))
    results, started = {}, threading.Barrier(len(requests))

    def submit(name, length):
        started.wait()
        results[name] = kd.allreduce(tf.fill([length], float(RANK + 1)), op=kd.Sum, name=name).numpy()

    def check_example():
        threads = [threading.Thread(target=submit, args=requests[i], daemon=True) for i in order]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(t.is_alive() for t in threads), "a request never completed"
        for name, length in requests:
            np.testing.assert_array_equal(results[name], np.full(length, SIZE * (SIZE + 1) / 2), err_msg=name)

    agreed(check_example)
