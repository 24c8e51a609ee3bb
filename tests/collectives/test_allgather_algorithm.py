"""Allgathers whatever algorithm KERASDIST_ALLREDUCE_ALGORITHM chooses: the same bits, in rank
order, as NumPy's concatenation of what every rank sent. `make test` runs this file as part of the
suite (one host: MPI's own allgather) and again on hosts MPICH emulates (MPIR_CVAR_NUM_CLIQUES,
which places ranks round-robin, so a host's ranks are not neighbours in rank order) with
KERASDIST_ALLREDUCE_ALGORITHM=hierarchical, where every allgather runs as the hierarchy, and with
auto, where those of 4 MiB or more do. Each test also checks from engine_times()["hierarchical"]
that the hierarchy ran exactly where the configuration says it must.

The row counts leave host blocks that do not split evenly among a host's ranks, so the slices
that cross hosts start and end inside a rank's rows; one pattern keeps every rank of a host
equal (no gathering within the host first), one leaves a whole host without rows."""

import os
import pickle

import numpy as np
import pytest
import tensorflow as tf
from kd_testutil import RANK, SIZE, dtype_id, run
from mpi4py import MPI

import kerasdist as kd

# Hosts found as the engine finds them: ranks that share memory, numbered by their lowest rank.
_host = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
_LOWEST_RANK_OF_HOST = MPI.COMM_WORLD.allgather(_host.allreduce(RANK, op=MPI.MIN))
_host.Free()
HOST_OF = [sorted(set(_LOWEST_RANK_OF_HOST)).index(lowest) for lowest in _LOWEST_RANK_OF_HOST]
HOSTS = len(set(HOST_OF))
_RANKS_PER_HOST = {HOST_OF.count(h) for h in range(HOSTS)}
HIERARCHY_AVAILABLE = HOSTS >= 2 and len(_RANKS_PER_HOST) == 1 and _RANKS_PER_HOST.pop() >= 2
ALGORITHM = os.environ.get("KERASDIST_ALLREDUCE_ALGORITHM", "auto")
AUTO_HIERARCHY_FROM_BYTES = 4 << 20  # allreduce_algorithm.h, kAllgatherHierarchyFromBytes

DTYPES = [tf.float32, tf.float64, tf.int32, tf.int64, tf.float16]
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

# Rows each rank sends: equal; unequal with rank 0 sending none; equal within a host but not
# between hosts, host 0 sending none; equal but for the last rank, which sends none.
ROWS = {
    "same_rows": lambda r: 3,
    "rows_differ": lambda r: (3 * r) % 5,
    "rows_per_host": lambda r: 2 * HOST_OF[r],
    "last_rank_sends_none": lambda r: 0 if r == SIZE - 1 else 3,
}


def runs_as_hierarchy(total_bytes):
    if not HIERARCHY_AVAILABLE:
        return False
    return ALGORITHM == "hierarchical" or (ALGORITHM == "auto" and total_bytes >= AUTO_HIERARCHY_FROM_BYTES)


def _sent(rank, dtype, rows, row_shape, salt):
    rng = np.random.default_rng([rank, rows, *row_shape, DTYPES.index(dtype), salt])
    shape = (rows, *row_shape)
    if dtype.is_integer:
        info = np.iinfo(dtype.as_numpy_dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype.as_numpy_dtype, endpoint=True)
    # Values of every magnitude, so the exponent and mantissa bits vary as well as the sign.
    return (rng.standard_normal(shape) * 2.0 ** rng.integers(-12, 12, size=shape)).astype(dtype.as_numpy_dtype)


def _check_same_bits(got, expected):
    assert got.shape == expected.shape, f"shape {got.shape}, expected {expected.shape}"
    bits = _BITS[expected.dtype.itemsize]
    wrong = np.flatnonzero(got.view(bits).ravel() != expected.view(bits).ravel())
    assert wrong.size == 0, f"{wrong.size} of {expected.size} values differ, the first at flat index {wrong[0]}"


def _gather_and_check(mode, dtype, rows_of, row_shape, salt):
    sent = [_sent(r, dtype, rows_of(r), row_shape, salt) for r in range(SIZE)]
    expected = np.concatenate(sent)
    before = kd.engine_times()["hierarchical"]
    out = run(mode, kd.allgather, tf.constant(sent[RANK]))
    ran_as_hierarchy = kd.engine_times()["hierarchical"] - before
    _check_same_bits(out.numpy(), expected)
    assert ran_as_hierarchy == runs_as_hierarchy(expected.nbytes), (
        f"{ran_as_hierarchy} hierarchical allgathers of {expected.nbytes} bytes under {ALGORITHM} on {HOSTS} hosts"
    )


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("row_shape", [(), (3, 5)], ids=["one_value_rows", "3x5_rows"])
@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_small_allgather_is_numpys_concatenation_bit_for_bit(dtype, rows, row_shape, mode):
    _gather_and_check(mode, dtype, ROWS[rows], row_shape, salt=1)


@pytest.mark.parametrize("fraction_of_threshold", [0.75, 1.25], ids=["below_auto_threshold", "above_auto_threshold"])
@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("dtype", [tf.float16, tf.float32, tf.int64], ids=dtype_id)
def test_large_allgather_is_numpys_concatenation_bit_for_bit(dtype, rows, fraction_of_threshold):
    total_rows = max(1, sum(ROWS[rows](r) for r in range(SIZE)))
    row_bytes = fraction_of_threshold * AUTO_HIERARCHY_FROM_BYTES / total_rows
    # An odd row length, so that slices of a host's block end inside rows.
    columns = int(row_bytes // dtype.size) | 1
    _gather_and_check("eager", dtype, ROWS[rows], (columns,), salt=2)


@pytest.mark.parametrize("payload_bytes", [100, 5 << 20], ids=["small", "megabytes"])
def test_allgather_object_returns_every_ranks_object_in_rank_order(payload_bytes):
    # Rank 0's payload is empty, the others' lengths differ.
    def sent(r):
        return {"rank": r, "payload": np.random.default_rng(r).bytes(payload_bytes + r if r else 0)}

    total_bytes = sum(len(pickle.dumps(sent(r))) for r in range(SIZE))
    before = kd.engine_times()["hierarchical"]
    got = kd.allgather_object(sent(RANK))
    ran_as_hierarchy = kd.engine_times()["hierarchical"] - before
    assert got == [sent(r) for r in range(SIZE)]
    # Each pickle travels after 8 bytes of length.
    assert ran_as_hierarchy == runs_as_hierarchy(total_bytes + 8 * SIZE), ran_as_hierarchy
