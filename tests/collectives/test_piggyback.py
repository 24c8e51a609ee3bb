"""Small allreduces that ride with the negotiation that agrees on them (KERASDIST_PIGGYBACK_BYTES,
4 KiB by default): results against NumPy whether they ride or not, and how often they ride,
counted by engine_times()["rode"] (never on one rank, where nothing is negotiated). A repeated set
rides from its fourth or fifth cycle on; the bounds leave room for one slow-path cycle (an eager
call kept waiting for long on a loaded machine goes through rank 0, and the set is agreed anew)."""

import numpy as np
import pytest
import tensorflow as tf
from kd_testutil import MODES, RANK, SIZE, rank_values, run

import kerasdist as kd

CALLS = 12


def rode(before):
    return kd.engine_times()["rode"] - before


@pytest.mark.parametrize("mode", MODES)
def test_a_repeated_small_sum_rides_and_matches_numpy(mode):
    sent = np.array([rank_values(r, tf.float32, (1000,), salt="piggyback") for r in range(SIZE)])
    before = kd.engine_times()["rode"]
    for call in range(CALLS):
        got = run(
            mode,
            lambda x: kd.allreduce(x, op=kd.Sum, name=f"piggyback_sum_{mode}"),
            tf.constant(sent[RANK] + call, tf.float32),
        )
        np.testing.assert_array_equal(got.numpy(), sent.sum(axis=0) + SIZE * call)
    assert rode(before) >= (CALLS // 2 if SIZE > 1 else 0), rode(before)


def test_scaled_averages_and_a_group_taking_turns_ride_and_match_numpy():
    """Two sets alternate, cycle by cycle: each rides while the other runs, so every cycle rides
    once both are agreed."""
    sent = np.array([rank_values(r, tf.float32, (3, 5), salt="piggyback_group") for r in range(SIZE)])
    average = tf.function(
        lambda x: kd.allreduce(x, op=kd.Average, name="piggyback_average", prescale_factor=0.5, postscale_factor=4.0)
    )
    group = tf.function(lambda a, b: kd.grouped_allreduce([a, b], op=kd.Sum, name="piggyback_group"))
    before = kd.engine_times()["rode"]
    for call in range(CALLS):
        got = average(tf.constant(sent[RANK] * (call + 1), tf.float32))
        np.testing.assert_allclose(got.numpy(), sent.mean(axis=0) * (call + 1) * 2.0, rtol=2e-6, atol=1e-6)
        a, b = group(tf.constant(sent[RANK][0], tf.float32), tf.constant([RANK + call], tf.float32))
        np.testing.assert_array_equal(a.numpy(), sent[:, 0].sum(axis=0))
        np.testing.assert_array_equal(b.numpy(), [SIZE * (SIZE - 1) / 2 + SIZE * call])
    assert rode(before) >= (CALLS if SIZE > 1 else 0), rode(before)


def test_sets_over_the_limit_or_of_integers_never_ride():
    before = kd.engine_times()["rode"]
    for call in range(CALLS):
        large = kd.allreduce(tf.fill([1025], float(RANK + call)), op=kd.Sum, name="piggyback_4100_bytes")
        np.testing.assert_array_equal(large.numpy(), np.full(1025, SIZE * (SIZE - 1) / 2 + SIZE * call))
        integers = kd.allreduce(tf.fill([4], RANK + call), op=kd.Sum, name="piggyback_integers")
        np.testing.assert_array_equal(integers.numpy(), np.full(4, SIZE * (SIZE - 1) // 2 + SIZE * call))
    assert rode(before) == 0


def test_riding_sums_of_inexact_floats_are_the_same_bits_on_every_rank():
    """The sums of values whose additions round: MPI's reduction order decides the last bit, and
    every rank must get the same bits (replicas that differ drift apart)."""
    rng = np.random.default_rng(RANK)
    before = kd.engine_times()["rode"]
    step = tf.function(lambda x: kd.allreduce(x, op=kd.Sum, name="piggyback_inexact"))
    sent = [rng.standard_normal(900).astype(np.float32) * 1e3 for _ in range(CALLS)]
    got = [step(tf.constant(values)).numpy() for values in sent]
    assert rode(before) >= (CALLS // 2 if SIZE > 1 else 0), rode(before)
    everyone = kd.allgather_object((sent, [sums.tobytes() for sums in got]), name="piggyback_inexact_check")
    for call in range(CALLS):
        expected = np.sum([theirs[call] for theirs, _ in everyone], axis=0)
        np.testing.assert_allclose(got[call], expected, rtol=1e-5, atol=1e-3)
        assert len({bits[call] for _, bits in everyone}) == 1, f"call {call}: the ranks' sums differ"
