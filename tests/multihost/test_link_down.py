"""A host's link goes down while the ranks move data (`ip link set ... down` inside its
namespace): no rank gets an error from MPI, whose TCP connections just stop, so without the
collective timeout the job waited for TCP's own timeouts or the 30-minute stall timeout. With
KERASDIST_COLLECTIVE_TIMEOUT_S=5 it must end, non-zero, within that and one round of
questions (5 s) plus the launcher's clean-up, naming the timeout."""

import threading
import time

from multihost_utils import DEFAULT_JOB_TIMEOUT_S

TIMEOUT_S = 5
# The collective timeout, one round of the waiting rank's questions, and the launcher's clean-up.
DETECTED_WITHIN_S = TIMEOUT_S + 5 + 15


def test_a_link_down_mid_collective_ends_the_job_in_bounded_time(two_hosts, tmp_path):
    moving = tmp_path / "moving"
    finished = {}

    def run():
        finished["job"] = two_hosts.run_script(
            "moving_data.py",
            str(moving),
            num_processes=2,
            cwd=tmp_path,
            hosts=two_hosts.hosts_option(1),
            env={"KERASDIST_COLLECTIVE_TIMEOUT_S": TIMEOUT_S},
            timeout=DEFAULT_JOB_TIMEOUT_S,
        )

    job_thread = threading.Thread(target=run)
    job_thread.start()
    deadline = time.monotonic() + 120
    while not moving.exists() and job_thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert moving.exists(), finished.get("job").describe() if "job" in finished else "no data moved in 120 s"
    lost_host = two_hosts.hosts[1]
    down = two_hosts.on_host(lost_host, f"ip link set {two_hosts.interface} down")
    down_at = time.time()
    try:
        assert down.returncode == 0, down.stderr
        job_thread.join(DEFAULT_JOB_TIMEOUT_S + 30)
    finally:
        two_hosts.on_host(lost_host, f"ip link set {two_hosts.interface} up")
    job = finished["job"]
    assert not job.timed_out and job.returncode != 0, job.describe()
    detected_after = job.ended - down_at
    print(f"LINK_DOWN_DETECTED_AFTER_S={detected_after:.1f}")
    assert detected_after < DETECTED_WITHIN_S, job.describe()
    assert "KERASDIST_COLLECTIVE_TIMEOUT_S" in job.output, job.describe()
