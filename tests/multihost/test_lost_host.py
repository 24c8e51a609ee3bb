"""A host lost for good: `kerasdist-run --restarts 1 --min-np 1` on 2 emulated hosts × 1 rank.

In the middle of training the second host's link goes down and stays down. The collective
timeout ends the job, the launcher's probe (through mpiexec, as the job starts) finds the host
unavailable, and the job restarts on the first host alone, as 1 rank standing in for the planned
2: it resumes from the last complete checkpoint and ends on the weights of one process trained
on the planned global batch.
"""

import sys
import threading
import time

import pytest
from launch_utils import SCRIPTS

from kerasdist.run import hosts

COLLECTIVE_TIMEOUT_S = 5
JOB_TIMEOUT_S = 300
# The collective timeout and one round of questions, the launcher's grace for mpiexec, the probe
# of the lost host, then a new rank's start (TensorFlow's import) on a busy 2-core machine.
RECOVERED_WITHIN_S = COLLECTIVE_TIMEOUT_S + 5 + 10 + hosts.HOST_PROBE_TIMEOUT_S + 30


@pytest.mark.timeout(JOB_TIMEOUT_S + 120, method="thread")
def test_a_host_lost_for_good_restarts_the_job_on_the_other_with_the_same_global_batch(two_hosts, tmp_path):
    marker = tmp_path / "epoch-2-began"
    script = SCRIPTS / "shrinking_training.py"
    finished = {}

    def run():
        finished["job"] = two_hosts.launch(
            2,
            [sys.executable, str(script), str(tmp_path / "checkpoints"), "slow", str(marker)],
            tmp_path,
            hosts=two_hosts.hosts_option(1),
            env={"KERASDIST_COLLECTIVE_TIMEOUT_S": COLLECTIVE_TIMEOUT_S, "TF_NUM_INTRAOP_THREADS": "1"},
            extra_flags=["--restarts", "1", "--min-np", "1"],
            timeout=JOB_TIMEOUT_S,
            script_name=script.name,
        )

    job_thread = threading.Thread(target=run)
    job_thread.start()
    deadline = time.monotonic() + 180
    while not marker.exists() and job_thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), finished["job"].describe() if "job" in finished else "epoch 2 did not begin in 180 s"
    kept, lost = two_hosts.hosts
    down = two_hosts.on_host(lost, f"ip link set {two_hosts.interface} down")
    fault_at = time.time()
    try:
        assert down.returncode == 0, down.stderr
        job_thread.join(JOB_TIMEOUT_S + 30)
    finally:
        two_hosts.on_host(lost, f"ip link set {two_hosts.interface} up")
    job = finished["job"]
    assert job.returncode == 0 and not job.timed_out, job.describe()
    assert f"host {lost} is unavailable (" in job.output, job.describe()
    assert f"starting 1 of the planned 2 ranks on {kept}:1" in job.output, job.describe()
    # The second attempt: one rank for the planned two, from the last complete epoch (1).
    assert sorted(job.lines_with("ATTEMPT=")) == [
        "0 SIZE=2 PLANNED=2 RESUMED_FROM=0",
        "0 SIZE=2 PLANNED=2 RESUMED_FROM=0",
        "1 SIZE=1 PLANNED=2 RESUMED_FROM=2",
    ], job.describe()
    assert job.lines_with("ITERATIONS=") == ["20"], job.describe()  # 5 epochs of 4 updates, as planned
    assert float(job.lines_with("MAX_DIFFERENCE=")[0]) < 1e-5, job.describe()
    restarted_at = max(float(t) for t in job.lines_with("STARTED_AT="))
    print(f"LOST_HOST_RANK_RESTARTED_AFTER_S={restarted_at - fault_at:.1f}")
    print(f"LOST_HOST_JOB_DONE_AFTER_S={job.ended - fault_at:.1f}")
    assert restarted_at - fault_at < RECOVERED_WITHIN_S, job.describe()
