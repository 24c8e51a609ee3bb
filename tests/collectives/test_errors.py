"""Errors never hang and never poison the process.

* Ranks that disagree about one tensor name (shape, dtype, op kind, reduce op,
  root, scale factors) all get tf.errors.FailedPreconditionError within
  seconds; the message names the tensor and the disagreeing rank(s).
* A second request for a name that is still pending is a
  FailedPreconditionError; the pending one still completes.
* Invalid local input is a tf.errors.InvalidArgumentError.
* After any of these, ordinary collectives on the same process pair up and
  are correct.

Every rank issues the same number of collectives in every test, even where a
rank deviates on purpose, and catches every exception before asserting, so a
failing test leaves the ranks in step for the next one.
"""

import re
import threading
import time

import numpy as np
import pytest
import tensorflow as tf
from kd_testutil import RANK, SIZE, assert_world_still_works, needs_two_ranks

import kerasdist as kd

DEADLINE_S = 30
LAST = SIZE - 1
DEVIATES = RANK == LAST  # in the mismatch tests, the last rank disagrees


def _ones(shape, dtype=tf.float32):
    return tf.ones(shape, dtype)


# Each case runs on every rank with the same tensor name; the last rank differs.
_MISMATCHES = {
    "shape": lambda name: kd.allreduce(_ones((5,) if DEVIATES else (4,)), op=kd.Sum, name=name),
    "shape_depends_on_rank": lambda name: kd.allreduce(_ones((RANK + 1,)), op=kd.Sum, name=name),
    "dtype": lambda name: kd.allreduce(_ones((4,), tf.float64 if DEVIATES else tf.float32), op=kd.Sum, name=name),
    "op_kind_allgather": lambda name: (
        kd.allgather(_ones((4,)), name=name) if DEVIATES else kd.allreduce(_ones((4,)), op=kd.Sum, name=name)
    ),
    "op_kind_broadcast": lambda name: (
        kd.broadcast(_ones((4,)), root_rank=0, name=name)
        if DEVIATES
        else kd.allreduce(_ones((4,)), op=kd.Sum, name=name)
    ),
    "op_kind_reducescatter": lambda name: (
        kd.reducescatter(_ones((4,)), op=kd.Sum, name=name)
        if DEVIATES
        else kd.allreduce(_ones((4,)), op=kd.Sum, name=name)
    ),
    "reduce_op": lambda name: kd.allreduce(_ones((4,)), op=kd.Max if DEVIATES else kd.Sum, name=name),
    "root_rank": lambda name: kd.broadcast(_ones((4,)), root_rank=LAST if DEVIATES else 0, name=name),
    "prescale": lambda name: kd.allreduce(_ones((4,)), op=kd.Sum, prescale_factor=2.0 if DEVIATES else 1.0, name=name),
    "postscale": lambda name: kd.allreduce(
        _ones((4,)), op=kd.Sum, postscale_factor=0.5 if DEVIATES else 1.0, name=name
    ),
    "allgather_trailing_dims": lambda name: kd.allgather(_ones((2, 4) if DEVIATES else (2, 3)), name=name),
    "reducescatter_shape": lambda name: kd.reducescatter(_ones((7,) if DEVIATES else (6,)), op=kd.Sum, name=name),
    "shape_in_tf_function": lambda name: tf.function(lambda x: kd.allreduce(x, op=kd.Sum, name=name))(
        _ones((RANK + 2,))
    ),
}


def _call_catching(fn):
    """Run fn; return (exception or None, seconds taken)."""
    start = time.monotonic()
    try:
        out = fn()
        if out is not None:
            np.asarray(out)
    except Exception as error:  # noqa: BLE001 - asserted on by the caller
        return error, time.monotonic() - start
    return None, time.monotonic() - start


@needs_two_ranks
@pytest.mark.parametrize("kind", list(_MISMATCHES))
def test_disagreement_fails_every_rank_quickly_then_the_world_recovers(kind):
    name = f"mismatch_{kind}"
    error, elapsed = _call_catching(lambda: _MISMATCHES[kind](name))
    assert_world_still_works()

    assert isinstance(error, tf.errors.FailedPreconditionError), (
        f"rank {RANK}: expected FailedPreconditionError, got {error!r}"
    )
    assert elapsed < DEADLINE_S, f"rank {RANK}: error took {elapsed:.1f}s"
    message = error.message
    assert name in message, f"tensor name missing from: {message}"
    # "ranks 0, 1 sent shape [4]; rank 2 sent shape [5]": every rank named once, as a sender,
    # and the last rank in a different clause from rank 0's.
    senders = [
        [int(r) for r in clause.split(",")] for clause in re.findall(r"\branks? (\d+(?:, \d+)*) sent\b", message)
    ]
    assert sorted(r for clause in senders for r in clause) == list(range(SIZE)), (
        f"not every rank named once as a sender in: {message}"
    )
    clause_of = {r: i for i, clause in enumerate(senders) for r in clause}
    assert clause_of[LAST] != clause_of[0], f"disagreeing rank {LAST} not told apart in: {message}"


@needs_two_ranks
def test_second_request_for_a_pending_name_fails_and_the_first_completes():
    # Rank r sends "pending_dup_r" twice from two threads. No other rank sends
    # that name until every rank has seen its own duplicate refused (an object
    # allgather, outside the engine, separates the phases), so the first
    # request is certainly still pending when the second arrives. Then every
    # rank sends every other rank's name once, completing all pending requests.
    mine = f"pending_dup_{RANK}"
    x = tf.constant([RANK + 1.0])
    results = [None, None]
    refused = threading.Event()

    def submit(slot):
        try:
            results[slot] = ("ok", kd.allreduce(x, op=kd.Sum, name=mine).numpy())
        except Exception as error:  # noqa: BLE001
            results[slot] = ("error", error)
            refused.set()

    threads = [threading.Thread(target=submit, args=(slot,), daemon=True) for slot in (0, 1)]
    for thread in threads:
        thread.start()
    refused_in_time = refused.wait(DEADLINE_S)
    kd.allgather_object(refused_in_time)  # every rank is past its refusal (or gave up)
    others = {}
    for j in range(SIZE):
        if j != RANK:
            others[j] = _call_catching(lambda j=j: kd.allreduce(x, op=kd.Sum, name=f"pending_dup_{j}"))
    for thread in threads:
        thread.join(DEADLINE_S)
    assert_world_still_works()

    assert refused_in_time, f"rank {RANK}: duplicate of a pending name was not refused"
    kinds = sorted(kind for kind, _ in filter(None, results))
    assert kinds == ["error", "ok"], f"rank {RANK}: results {results}"
    for kind, value in results:
        if kind == "error":
            assert isinstance(value, tf.errors.FailedPreconditionError), repr(value)
            assert mine in value.message
        else:
            assert value.tolist() == [SIZE * (SIZE + 1) / 2]
    for j, (error, _) in others.items():
        assert error is None, f"rank {RANK}: pending_dup_{j} failed: {error!r}"


# ------------------------------------------------------------ invalid input


def _expect_invalid_argument(fn):
    error, _ = _call_catching(fn)
    assert_world_still_works()
    assert isinstance(error, tf.errors.InvalidArgumentError), (
        f"rank {RANK}: expected InvalidArgumentError, got {error!r}"
    )


@pytest.mark.parametrize("root_rank", ["size", "minus_one"])
def test_broadcast_root_out_of_range_is_invalid(root_rank):
    root = SIZE if root_rank == "size" else -1
    _expect_invalid_argument(lambda: kd.broadcast(_ones((3,)), root_rank=root))


def test_allgather_of_a_scalar_is_invalid():
    _expect_invalid_argument(lambda: kd.allgather(tf.constant(1.0)))


@pytest.mark.parametrize("factor", ["prescale_factor", "postscale_factor"])
@pytest.mark.parametrize("dtype", [tf.int32, tf.uint8], ids=lambda d: d.name)
def test_scale_factors_on_integers_are_invalid(dtype, factor):
    _expect_invalid_argument(lambda: kd.allreduce(_ones((3,), dtype), op=kd.Sum, **{factor: 2.0}))


def test_scale_factors_on_integers_in_a_group_are_invalid():
    _expect_invalid_argument(
        lambda: kd.grouped_allreduce([_ones((3,)), _ones((2,), tf.int64)], op=kd.Sum, prescale_factor=0.5)
    )


def _bad_splits(kind):
    """(rows of the input, splits) that are wrong in the named way on every rank."""
    if kind == "too_many_entries":
        return SIZE + 1, [1] * (SIZE + 1)
    if kind == "sum_differs_from_rows":
        return SIZE + 1, [1] * SIZE
    if kind == "negative_entry":
        splits = [-1, 2] + [1] * (SIZE - 2) if SIZE >= 2 else [-1]
        return max(sum(splits), 0), splits
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["too_many_entries", "sum_differs_from_rows", "negative_entry"])
def test_alltoall_with_bad_splits_is_invalid(kind):
    rows, splits = _bad_splits(kind)
    _expect_invalid_argument(lambda: kd.alltoall(_ones((rows, 2)), splits=splits))


def test_alltoall_with_bad_splits_in_tf_function_is_invalid():
    rows, splits = _bad_splits("sum_differs_from_rows")
    fn = tf.function(lambda x, s: kd.alltoall(x, splits=s))
    _expect_invalid_argument(lambda: fn(_ones((rows, 2)), tf.constant(splits, tf.int32)))


@needs_two_ranks
def test_alltoall_equal_split_of_indivisible_rows_is_invalid():
    _expect_invalid_argument(lambda: kd.alltoall(_ones((SIZE + 1, 2))))
