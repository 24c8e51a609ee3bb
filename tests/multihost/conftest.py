"""Emulated hosts for the multi-host tests: clusters from scripts/netns_cluster.sh.

A cluster is made once per pytest session and size, and removed at the end of the session, on
Ctrl-C, and on SIGTERM (turned into KeyboardInterrupt while a cluster is up, so that pytest
runs the finalizers); if pytest is killed outright, the next `up` removes it (--owner).

The tests skip, naming the reason, where clusters cannot be made (not root, no iproute2,
namespaces not permitted); a cluster that can be made but fails to come up is an error.
"""

import signal
import subprocess
import sys
from pathlib import Path

import pytest

# The launch tests' job runner (output to a file, timeouts, leftover ranks killed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "launch"))

from launch_utils import under_a_launcher  # noqa: E402
from multihost_utils import CLUSTER_SCRIPT, Cluster  # noqa: E402

CLUSTER_SETUP_TIMEOUT_S = 120


def _why_no_cluster():
    if under_a_launcher():
        return "multi-host tests start their own jobs; run them from plain pytest"
    try:
        checked = subprocess.run([CLUSTER_SCRIPT, "check"], capture_output=True, text=True, timeout=60)
    except OSError as error:
        return f"cannot run {CLUSTER_SCRIPT}: {error}"
    if checked.returncode != 0:
        return f"no emulated hosts on this machine: {(checked.stdout + checked.stderr).strip()}"
    return None


class _Clusters:
    """Clusters made on first use, one per (hosts, slots), all removed at the end."""

    def __init__(self):
        self._made = {}
        self._previous_sigterm = None

    def get(self, hosts, slots):
        key = (hosts, slots)
        if key not in self._made:
            if self._previous_sigterm is None:
                self._previous_sigterm = signal.signal(signal.SIGTERM, _interrupt)
            self._made[key] = Cluster.up(hosts=hosts, slots=slots, timeout=CLUSTER_SETUP_TIMEOUT_S)
        return self._made[key]

    def remove_all(self):
        errors = []
        for cluster in self._made.values():
            try:
                cluster.down()
            except Exception as error:  # remove the others all the same
                errors.append(error)
        self._made.clear()
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        if errors:
            raise errors[0]


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def clusters():
    reason = _why_no_cluster()
    if reason:
        pytest.skip(reason)
    made = _Clusters()
    try:
        yield made
    finally:
        made.remove_all()


@pytest.fixture(scope="session")
def two_hosts(clusters):
    """Two emulated hosts with 2 slots each."""
    return clusters.get(hosts=2, slots=2)


@pytest.fixture(scope="session")
def one_host(clusters):
    """One emulated host with 2 slots: a job started as on a cluster, its ranks all on one host."""
    return clusters.get(hosts=1, slots=2)
