"""Runtime queries and the object collectives: rank/size/topology, init,
broadcast_object, allgather_object, barrier."""

import json
import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from kd_testutil import RANK, SIZE

import kerasdist as kd


def _launcher_rank_size():
    for rank_var, size_var in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


def test_mpi_built_is_true():
    assert kd.mpi_built() is True


def test_nccl_built_says_which_library_was_loaded():
    # `make test-nccl` sets KD_TEST_EXPECT_NCCL=1 and must run against the NCCL variant, not the
    # normal library of the source tree; build_info.json records what setup.py compiled.
    expected = os.environ.get("KD_TEST_EXPECT_NCCL", "0") == "1"
    build_info = json.loads((Path(kd.__file__).parent / "build_info.json").read_text())
    assert build_info["nccl"] is expected
    assert kd.nccl_built() is expected
    assert (build_info["nccl_version"] is not None) is expected


def test_init_is_idempotent_and_keeps_the_world():
    kd.init()
    kd.init()
    assert kd.is_initialized()
    assert (kd.rank(), kd.size()) == (RANK, SIZE)
    total = kd.allreduce(tf.constant([1.0]), op=kd.Sum)
    assert total.numpy().tolist() == [float(SIZE)]


def test_rank_and_size_match_the_launcher():
    assert (kd.rank(), kd.size()) == _launcher_rank_size()


def test_every_rank_has_a_distinct_rank():
    assert kd.allgather_object(kd.rank()) == list(range(SIZE))


def test_local_and_cross_ranks_describe_the_hosts():
    mine = dict(
        host=socket.gethostname(),
        rank=kd.rank(),
        local_rank=kd.local_rank(),
        local_size=kd.local_size(),
        cross_rank=kd.cross_rank(),
        cross_size=kd.cross_size(),
    )
    world = kd.allgather_object(mine)
    assert [info["rank"] for info in world] == list(range(SIZE))

    hosts = sorted({info["host"] for info in world}, key=lambda h: min(i["rank"] for i in world if i["host"] == h))
    for host_index, host in enumerate(hosts):
        on_host = [info for info in world if info["host"] == host]
        # Local ranks number the host's processes in global-rank order.
        assert [info["local_rank"] for info in on_host] == list(range(len(on_host)))
        assert {info["local_size"] for info in on_host} == {len(on_host)}
        assert {info["cross_rank"] for info in on_host} == {host_index}
    assert {info["cross_size"] for info in world} == {len(hosts)}
    assert mine["local_size"] * mine["cross_size"] == SIZE  # homogeneous layout
    if len(hosts) == 1:
        assert (mine["local_rank"], mine["local_size"]) == (RANK, SIZE)
        assert (mine["cross_rank"], mine["cross_size"]) == (0, 1)


def _object_of(rank):
    return {
        "rank": rank,
        "items": list(range(rank + 3)),
        "text": "r" * rank,
        "nested": {"tuple": (rank, "x"), "none": None},
        "array": np.arange(rank + 2, dtype=np.float32) * 1.5,
    }


def _assert_same_object(got, expected):
    assert got.keys() == expected.keys()
    for key in expected:
        if isinstance(expected[key], np.ndarray):
            np.testing.assert_array_equal(got[key], expected[key])
            assert got[key].dtype == expected[key].dtype
        else:
            assert got[key] == expected[key]


@pytest.mark.parametrize("root", ["first", "last"])
def test_broadcast_object_returns_the_root_object(root):
    root_rank = 0 if root == "first" else SIZE - 1
    got = kd.broadcast_object(_object_of(RANK), root_rank=root_rank)
    _assert_same_object(got, _object_of(root_rank))


def test_broadcast_object_defaults_to_root_zero():
    got = kd.broadcast_object(_object_of(RANK))
    _assert_same_object(got, _object_of(0))


def test_broadcast_object_of_a_large_payload():
    payload = bytes([RANK % 256]) * (1 << 20)
    got = kd.broadcast_object(payload, root_rank=SIZE - 1)
    assert got == bytes([(SIZE - 1) % 256]) * (1 << 20)


def test_allgather_object_lists_objects_in_rank_order():
    got = kd.allgather_object(_object_of(RANK))
    assert len(got) == SIZE
    for rank, obj in enumerate(got):
        _assert_same_object(obj, _object_of(rank))


def test_allgather_object_with_sizes_differing_per_rank():
    got = kd.allgather_object(b"z" * (100_000 * RANK + 1))
    assert [len(obj) for obj in got] == [100_000 * r + 1 for r in range(SIZE)]


@pytest.mark.parametrize("late", ["first", "last"])
def test_no_rank_leaves_a_barrier_before_the_late_rank_enters_it(late):
    # Causality, not speed: ranks on the late rank's host share its clock, so each must leave
    # after the moment the late rank entered, however loaded the machine is. The sleep makes a
    # barrier that does not wait visibly wrong.
    late_rank = 0 if late == "first" else SIZE - 1
    kd.barrier()
    if RANK == late_rank:
        time.sleep(0.3)
    entered = time.time()
    returned = kd.barrier()
    left = time.time()
    world = kd.allgather_object((socket.gethostname(), entered, left))
    late_host, late_entered, _ = world[late_rank]
    assert returned is None
    for rank, (host, _, rank_left) in enumerate(world):
        if host == late_host:
            assert rank_left >= late_entered, f"rank {rank} left {late_entered - rank_left:.3f}s early"


@pytest.mark.parametrize(
    "environ, launcher",
    [
        ({"PMI_SIZE": "4", "PMI_RANK": "2"}, "a PMI launcher (hydra's mpiexec, or srun --mpi=pmi2)"),
        ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}, "Open MPI's mpirun"),
        ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "5"}, "srun"),
    ],
)
def test_a_process_mpi_sees_alone_among_launched_ranks_is_refused_naming_the_launcher(environ, launcher):
    message = kd.runtime.launch_mpi_did_not_see(environ, size=1)
    size_variable, rank_variable = list(environ)
    assert f"started by {launcher} as rank {environ[rank_variable]} of {environ[size_variable]}" in message
    assert "MPI sees a world of 1 process" in message and "--check-build" in message


@pytest.mark.parametrize(
    "environ, size",
    [
        ({}, 1),  # python train.py
        ({"PMI_SIZE": "1", "PMI_RANK": "0"}, 1),  # mpiexec -n 1
        ({"PMI_SIZE": "4", "PMI_RANK": "2"}, 4),  # a launch MPI joined up
        ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, 1),  # python train.py in a batch script of 4 tasks
    ],
)
def test_a_process_that_is_alone_as_launched_or_sees_its_launch_passes(environ, size):
    assert kd.runtime.launch_mpi_did_not_see(environ, size) is None
