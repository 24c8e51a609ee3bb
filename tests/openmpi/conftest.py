"""The Open MPI jobs skip, naming the reason, where Open MPI or .venv-openmpi is missing, and the
multi-host ones also where emulated hosts cannot be made (scripts/netns_cluster.sh check)."""

import subprocess
import sys
from pathlib import Path

import pytest

# The launch tests' job runner (output to a file, timeouts, leftover ranks killed) and the
# emulated hosts of the multi-host tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "launch"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "multihost"))

from multihost_utils import CLUSTER_SCRIPT, Cluster  # noqa: E402
from openmpi_utils import why_no_open_mpi_jobs  # noqa: E402

CLUSTER_SETUP_TIMEOUT_S = 120


@pytest.fixture(scope="session")
def open_mpi():
    """Requires Open MPI and the .venv-openmpi build; skips naming what is missing."""
    reason = why_no_open_mpi_jobs()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def two_hosts(open_mpi):
    """Two emulated hosts with 2 slots each, removed at the end of the session."""
    checked = subprocess.run([CLUSTER_SCRIPT, "check"], capture_output=True, text=True, timeout=60)
    if checked.returncode != 0:
        pytest.skip(f"no emulated hosts on this machine: {(checked.stdout + checked.stderr).strip()}")
    cluster = Cluster.up(hosts=2, slots=2, timeout=CLUSTER_SETUP_TIMEOUT_S)
    try:
        yield cluster
    finally:
        cluster.down()
