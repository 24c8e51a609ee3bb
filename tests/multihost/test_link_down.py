"""Faults of a whole host while the ranks move data, at 1 and 2 ranks per host.

* Its link goes down (`ip link set ... down` inside its namespace): no rank gets an error from
  MPI, whose TCP connections just stop, so without the collective timeout the job waited for
  TCP's own timeouts or the 30-minute stall timeout. With KERASDIST_COLLECTIVE_TIMEOUT_S=5 it
  must end, non-zero, within that and one round of questions (5 s) plus the launcher's grace
  for mpiexec (10 s), naming the timeout.
* Every rank on it is killed (SIGKILL): the launcher sees the exits and ends the job at once.
"""

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from multihost_utils import DEFAULT_JOB_TIMEOUT_S

TIMEOUT_S = 5
# The collective timeout, one round of the waiting rank's questions, and the launcher's clean-up.
DETECTED_WITHIN_S = TIMEOUT_S + 5 + 15


def _fault_while_data_moves(cluster, tmp_path, ranks_per_host, make_fault):
    """Starts moving_data.py, calls make_fault(lost_host) for the last host once data moves,
    and returns (the job, seconds from the fault to the job's end)."""
    moving = tmp_path / "moving"
    finished = {}

    def run():
        finished["job"] = cluster.run_script(
            "moving_data.py",
            str(moving),
            num_processes=len(cluster.hosts) * ranks_per_host,
            cwd=tmp_path,
            hosts=cluster.hosts_option(ranks_per_host),
            env={"KERASDIST_COLLECTIVE_TIMEOUT_S": TIMEOUT_S},
            timeout=DEFAULT_JOB_TIMEOUT_S,
        )

    job_thread = threading.Thread(target=run)
    job_thread.start()
    deadline = time.monotonic() + 120
    while not moving.exists() and job_thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert moving.exists(), finished["job"].describe() if "job" in finished else "no data moved in 120 s"
    lost_host = cluster.hosts[-1]
    make_fault(lost_host)
    fault_at = time.time()
    try:
        job_thread.join(DEFAULT_JOB_TIMEOUT_S + 30)
    finally:
        cluster.on_host(lost_host, f"ip link set {cluster.interface} up")
    job = finished["job"]
    return job, job.ended - fault_at


@pytest.mark.parametrize("ranks_per_host", [1, 2])
def test_a_link_down_mid_collective_ends_the_job_in_bounded_time(two_hosts, tmp_path, ranks_per_host):
    def take_the_link_down(host):
        down = two_hosts.on_host(host, f"ip link set {two_hosts.interface} down")
        assert down.returncode == 0, down.stderr

    job, detected_after = _fault_while_data_moves(two_hosts, tmp_path, ranks_per_host, take_the_link_down)
    print(f"LINK_DOWN_DETECTED_AFTER_S={detected_after:.1f}")
    assert not job.timed_out and job.returncode != 0, job.describe()
    assert detected_after < DETECTED_WITHIN_S, job.describe()
    assert "KERASDIST_COLLECTIVE_TIMEOUT_S" in job.output, job.describe()


def test_every_rank_of_a_host_killed_ends_the_job_at_once(two_hosts, tmp_path):
    def kill_its_ranks(host):
        # The hosts share one process table: the host's ranks are the processes in its namespace.
        in_namespace = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True, check=True)
        ranks = [pid for pid in map(int, in_namespace.stdout.split()) if b"moving_data.py" in _command_line(pid)]
        assert len(ranks) == 2, ranks
        for pid in ranks:
            os.kill(pid, signal.SIGKILL)

    job, detected_after = _fault_while_data_moves(two_hosts, tmp_path, 2, kill_its_ranks)
    print(f"HOST_KILLED_DETECTED_AFTER_S={detected_after:.1f}")
    assert not job.timed_out and job.returncode != 0, job.describe()
    assert detected_after < 10, job.describe()


def _command_line(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
