"""A mistake on one rank is an error on every rank, never a wrong answer or a hang.

* Calls that do not correspond across ranks (an extra eager call on one rank, an object
  collective on one rank only) fail on every rank with a message naming where each rank
  waits, instead of pairing with the next call of another rank.
* A call one rank cannot make (bad input found on that rank) fails there at once and, through
  the engine, on every other rank, naming the rank and its error.
* Min and Max give every rank the same bits, NaN included, as NumPy's minimum/maximum do.
* Bad arguments are refused with a message that names the argument and what is allowed.

Every rank makes the same calls (deviating ranks included) and catches every exception before
asserting, so a failing test leaves the ranks in step for the next one.
"""

import pickle
import threading
import time

import numpy as np
import pytest
import tensorflow as tf
from kd_testutil import FLOAT_DTYPES, RANK, SIZE, assert_world_still_works, needs_two_ranks

import kerasdist as kd

LAST = SIZE - 1
DEVIATES = RANK == LAST


def _call_catching(fn):
    try:
        return fn(), None
    except Exception as error:  # noqa: BLE001 - asserted on by the caller
        return None, error


def _ranks_phrase(ranks):
    """How the engine's messages list ranks: 'rank 1' or 'ranks 1, 2'."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


# ------------------------------------------------------------ calls that do not correspond


@needs_two_ranks
def test_an_extra_eager_call_on_one_rank_fails_every_rank_instead_of_shifting_the_pairing():
    def body():
        if RANK == 0:
            kd.allreduce(tf.constant([1.0]), op=kd.Sum)  # on rank 0 only
        return kd.allreduce(tf.constant([100.0]), op=kd.Sum)

    result, error = _call_catching(body)
    assert_world_still_works()
    assert result is None, f"rank {RANK}: an extra call on rank 0 paired and gave {result.numpy()}"
    assert isinstance(error, tf.errors.FailedPreconditionError), f"rank {RANK}: {error!r}"
    message = error.message
    assert "rank 0 waits in 'allreduce@test_cross_rank_errors.py:" in message, message
    assert f"{_ranks_phrase(list(range(1, SIZE)))} wait" in message, message


@needs_two_ranks
def test_a_collective_skipped_inside_a_tf_function_fails_every_rank_instead_of_pairing_the_next_call():
    # Names inside a tf.function are fixed per trace: only the count of calls tells call 1 from 2.
    @tf.function
    def step_that_one_rank_skips_once(x, go):
        return tf.cond(go, lambda: kd.allreduce(x, op=kd.Sum), lambda: tf.fill([1], -1.0))

    results, error = [], None
    for step in range(4):
        skips = DEVIATES and step == 1
        try:
            out = step_that_one_rank_skips_once(tf.constant([100.0 * step + RANK]), tf.constant(not skips))
        except tf.errors.OpError as caught:
            error = caught
            break
        if not skips:
            results.append((step, float(out[0])))
    assert_world_still_works()
    # Every result a rank got is the true sum of that step over every rank.
    for step, value in results:
        assert value == 100.0 * step * SIZE + SIZE * (SIZE - 1) / 2, f"rank {RANK}: step {step} gave {value}"
    assert isinstance(error, tf.errors.FailedPreconditionError), f"rank {RANK}: {error!r}, results {results}"
    assert "was submitted from different calls of the tf.function that contains it" in error.message
    # The name points at this file's line, not at AutoGraph's generated code.
    assert "allreduce@step_that_one_rank_skips_once/test_cross_rank_errors.py:" in error.message, error.message
    assert f"rank {LAST} is in call 2" in error.message, error.message


@needs_two_ranks
def test_a_rank_in_a_traced_step_and_one_in_an_eager_call_fail_within_seconds_naming_the_cause():
    @tf.function
    def training_step(x):
        return kd.allreduce(x, op=kd.Sum)

    training_step(tf.constant([1.0]))  # every rank once: the step's collective is cached
    started = time.monotonic()
    if DEVIATES:  # left the training loop early, as a stop decided on one rank does
        _, error = _call_catching(lambda: kd.allreduce(tf.constant([2.0]), name="after_training", op=kd.Sum))
    else:
        _, error = _call_catching(lambda: training_step(tf.constant([1.0])))
    waited = time.monotonic() - started
    kd.join()  # the ranks called training_step unequally often: join starts their counts alike
    assert_world_still_works()
    assert isinstance(error, tf.errors.FailedPreconditionError), f"rank {RANK}: {error!r}"
    assert "wait inside a tf.function call" in error.message and "different numbers of steps" in error.message
    assert "'after_training'" in error.message and "allreduce@training_step/" in error.message, error.message
    # The mismatch timeout (5 s) plus a cycle, not the stall timeout (60 s here).
    assert waited < 30, f"rank {RANK} waited {waited:.1f} s"


@needs_two_ranks
def test_an_object_collective_on_one_rank_only_fails_instead_of_pairing_with_the_next_one():
    def body():
        if RANK == 0:
            kd.broadcast_object("meant for nobody")
        return kd.broadcast_object("hello" if RANK == 0 else None)

    result, error = _call_catching(body)
    assert_world_still_works()
    assert kd.broadcast_object("hello" if RANK == 0 else None) == "hello"  # pairs again afterwards
    assert result is None, f"rank {RANK} received {result!r}"
    assert isinstance(error, tf.errors.FailedPreconditionError), f"rank {RANK}: {error!r}"
    assert "broadcast_object@test_cross_rank_errors.py:" in error.message


@needs_two_ranks
def test_object_collectives_from_different_lines_do_not_pair_unless_named_alike():
    if RANK == 0:
        named = kd.allgather_object(RANK, name="gather_ranks")
    else:
        named = kd.allgather_object(RANK, name="gather_ranks")
    assert named == list(range(SIZE))


@needs_two_ranks
def test_a_barrier_on_one_rank_only_fails_every_rank():
    def body():
        if RANK == 0:
            kd.barrier()
        return kd.allreduce(tf.constant([1.0]))

    _, error = _call_catching(body)
    assert_world_still_works()
    assert isinstance(error, tf.errors.FailedPreconditionError), f"rank {RANK}: {error!r}"
    assert "barrier@test_cross_rank_errors.py:" in error.message


# ------------------------------------------------------------ a local error reaches every rank


@needs_two_ranks
def test_bad_splits_on_one_rank_fail_the_alltoall_on_every_rank():
    splits = [SIZE + 1, -1] + [0] * (SIZE - 2) if DEVIATES else [1] * SIZE
    _, error = _call_catching(lambda: kd.alltoall(tf.ones([SIZE, 2]), splits=splits))
    assert_world_still_works()
    assert isinstance(error, tf.errors.InvalidArgumentError), f"rank {RANK}: {error!r}"
    assert "splits" in error.message
    if not DEVIATES:
        assert f"rank {LAST}: " in error.message, error.message


@needs_two_ranks
def test_an_object_the_root_cannot_pickle_fails_every_rank_naming_the_root():
    _, error = _call_catching(lambda: kd.broadcast_object(threading.Lock() if RANK == 0 else None))
    assert_world_still_works()
    if RANK == 0:
        assert isinstance(error, (TypeError, pickle.PicklingError)), repr(error)
    else:
        assert isinstance(error, tf.errors.InvalidArgumentError), f"rank {RANK}: {error!r}"
        assert "rank 0: TypeError" in error.message and "pickle" in error.message, error.message


@needs_two_ranks
def test_an_unsupported_dtype_on_one_rank_fails_every_rank_naming_it():
    tensor = tf.constant(["a", "b"]) if DEVIATES else tf.constant([1.0, 2.0])
    _, error = _call_catching(lambda: kd.allreduce(tensor))
    assert_world_still_works()
    if DEVIATES:
        assert isinstance(error, TypeError) and "string" in str(error), repr(error)
    else:
        assert isinstance(error, tf.errors.InvalidArgumentError), f"rank {RANK}: {error!r}"
        assert f"rank {LAST}: TypeError" in error.message, error.message


# ------------------------------------------------------------ Min and Max with NaN


@pytest.mark.parametrize("op_name", ["Min", "Max"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
def test_min_and_max_propagate_nan_and_give_every_rank_the_same_bits(dtype, op_name):
    def values(rank):
        return np.array(
            [
                np.nan if rank == LAST else rank,  # NaN on the last rank
                np.nan if rank == 0 else 1.0,  # NaN on rank 0
                -0.0 if rank == 0 else 0.0,  # zeros of both signs
                rank - 1.5,
            ]
        )

    result = kd.allreduce(tf.cast(values(RANK), dtype), op=getattr(kd, op_name))
    combine = np.maximum if op_name == "Max" else np.minimum
    expected = combine.reduce([tf.cast(values(r), dtype).numpy().astype(np.float64) for r in range(SIZE)])
    got = tf.cast(result, tf.float64).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(got, expected)  # NaN positions agree, values too (0.0 == -0.0)
    bits = tf.cast(tf.bitcast(result, {2: tf.int16, 4: tf.int32, 8: tf.int64}[dtype.size]), tf.int64)
    every_rank = kd.allgather(bits[tf.newaxis]).numpy()
    assert (every_rank == every_rank[0]).all(), f"ranks got different bits: {every_rank}"


# ------------------------------------------------------------ arguments named in the error


@pytest.mark.parametrize("dtype", [tf.string, tf.complex64, tf.int16, tf.bool], ids=lambda d: d.name)
def test_allreduce_of_an_unsupported_dtype_says_which_dtypes_it_takes(dtype):
    tensor = tf.constant(["x"]) if dtype == tf.string else tf.cast(tf.constant([1]), dtype)
    with pytest.raises(TypeError, match=f"takes tensors of dtype uint8, .*float64; got {dtype.name}"):
        kd.allreduce(tensor)
    assert_world_still_works()


def test_allgather_takes_bool_but_not_strings():
    flags = kd.allgather(tf.constant([RANK % 2 == 0]))
    assert flags.numpy().tolist() == [r % 2 == 0 for r in range(SIZE)]
    with pytest.raises(TypeError, match="kerasdist.allgather takes tensors of dtype .*bool; got string"):
        kd.allgather(tf.constant(["x"]))
    assert_world_still_works()


def test_a_collective_inside_an_xla_function_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="jit_compile=True"):
        tf.function(lambda x: kd.allreduce(x), jit_compile=True)(tf.constant([1.0]))
    assert_world_still_works()


@pytest.mark.parametrize(
    "splits", [[2.9] + [1.0] * (SIZE - 1), ["1"] * SIZE, [True] * SIZE], ids=["fractional", "strings", "bools"]
)
def test_alltoall_refuses_splits_that_are_not_integers(splits):
    with pytest.raises(TypeError, match="splits must be integers"):
        kd.alltoall(tf.ones([SIZE + 2, 1]), splits=splits)
    assert_world_still_works()


def test_alltoall_takes_whole_floats_as_splits():
    got = kd.alltoall(tf.fill([SIZE], RANK), splits=[1.0] * SIZE)
    assert got.numpy().tolist() == list(range(SIZE))


@pytest.mark.parametrize("root_rank", [SIZE, -1, "0", 0.0], ids=["size", "negative", "string", "float"])
def test_broadcast_object_refuses_a_root_that_is_not_a_rank(root_rank):
    with pytest.raises(ValueError, match=rf"root_rank={root_rank!r} is not a rank of this job .*0 to {SIZE - 1}"):
        kd.broadcast_object("x", root_rank=root_rank)
    assert_world_still_works()


def test_object_collectives_carry_any_picklable_object():
    payload = {"rank": RANK, "array": np.arange(RANK + 1), "text": "é" * RANK}
    gathered = kd.allgather_object(payload)
    assert [item["rank"] for item in gathered] == list(range(SIZE))
    for r, item in enumerate(gathered):
        np.testing.assert_array_equal(item["array"], np.arange(r + 1))
        assert item["text"] == "é" * r
    assert kd.broadcast_object(payload, root_rank=LAST)["rank"] == LAST
    assert kd.allgather_object(None) == [None] * SIZE
