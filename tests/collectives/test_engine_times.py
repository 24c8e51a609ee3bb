"""kd.engine_times(): where the engine thread's time goes, checked against what the test makes
happen (calls counted, a rank kept waiting for a known time)."""

import time

import numpy as np
import pytest
import tensorflow as tf
from kd_testutil import RANK, SIZE

import kerasdist as kd

PHASES = ["idle", "negotiation", "slow_path", "copy_in", "transfer", "outputs", "hand_back", "other"]


def delta(before, after):
    return {key: after[key] - before[key] for key in before}


def test_keys_are_the_phases_then_pickup_and_the_counts():
    times = kd.engine_times()
    assert list(times) == [*PHASES, "pickup", "cycles", "collectives", "rode", "hierarchical"]
    assert all(value >= 0 for value in times.values()), times


def test_counts_one_collective_per_call_and_charges_the_data_movement():
    before = kd.engine_times()
    for i in range(5):
        got = kd.allreduce(tf.fill([4096], float(RANK + 1)), op=kd.Sum, name=f"engine_times_count_{i}")
        assert np.all(got.numpy() == SIZE * (SIZE + 1) / 2)
    spent = delta(before, kd.engine_times())
    assert spent["collectives"] == 5, spent
    assert 5 <= spent["cycles"], spent  # one eager call at a time: a cycle each at least
    assert spent["transfer"] > 0 and spent["hand_back"] > 0 and spent["outputs"] > 0, spent


def test_phases_add_up_to_no_more_than_the_wall_time():
    """Every stretch of the engine thread's time goes to one phase, once: the phases charged while
    the test runs cannot exceed its wall time, except for the idle stretch under way at the start,
    charged when the engine wakes."""
    kd.barrier(name="engine_times_wall_start")
    start, before = time.monotonic(), kd.engine_times()
    tensors = [tf.fill([256], float(i)) for i in range(8)]
    for step in range(20):
        kd.grouped_allreduce(tensors, op=kd.Sum, name=f"engine_times_wall_{step}")
    spent = delta(before, kd.engine_times())
    wall = time.monotonic() - start
    busy = sum(spent[phase] for phase in PHASES if phase != "idle")
    assert 0 < busy <= wall, (busy, wall, spent)


def test_a_rank_kept_waiting_for_a_late_one_charges_it_to_negotiation():
    """Compared with the late rank's, and with half the sleep as the margin: the ranks leave the
    barrier at moments a loaded machine can set apart, and a loaded machine stretches every
    phase, so neither a tight lower bound nor an upper bound would hold there."""
    if SIZE == 1:
        pytest.skip("one rank waits for nobody")
    late_s = 1.0
    kd.barrier(name="engine_times_late_start")
    before = kd.engine_times()
    if RANK == SIZE - 1:
        time.sleep(late_s)
    kd.allreduce(tf.ones([16]), name="engine_times_late")
    spent = delta(before, kd.engine_times())
    waited = kd.allgather_object(spent["negotiation"] + spent["slow_path"], name="engine_times_late_waits")
    late = waited[-1]  # it came last: nothing to wait for
    assert all(late + late_s / 2 < other for other in waited[:-1]), (waited, spent)
