"""Shrink and grow back in one run: 4 emulated hosts × 1 rank, `kerasdist-run --min-np 2`.

The ranks on two hosts are given notice to leave in epoch 2, and those hosts go (the discovery
program stops listing them): every rank stops at one step with a checkpoint, the job starts again
on the 2 hosts left, each rank accumulating twice the micro-batches. Once that job trains, the two
hosts come back (listed again): the launcher stops it at a step boundary and starts it on all 4.
The run ends on the weights of plain Keras in one process on the planned global batch, as an
uninterrupted 4-rank run does (tests/launch/test_notice.py checks that one on one host).
"""

import sys

import pytest
from launch_utils import SCRIPTS

JOB_TIMEOUT_S = 420
UPDATES = 4 * 6  # notice_training.py's epochs × updates per epoch


@pytest.mark.timeout(JOB_TIMEOUT_S + 120, method="thread")
def test_a_job_shrinks_from_4_hosts_to_2_on_notice_and_grows_back_to_4_ending_on_the_planned_weights(
    clusters, tmp_path
):
    cluster = clusters.get(hosts=4, slots=1)
    every_host = ",".join(f"{host}:1" for host in cluster.hosts)
    kept = ",".join(f"{host}:1" for host in cluster.hosts[:2])
    listing = tmp_path / "hosts"
    listing.write_text(every_host.replace(",", "\n") + "\n")
    discover = tmp_path / "find-hosts"
    discover.write_text(f"#!/bin/sh\ncat {listing}\n")
    discover.chmod(0o755)
    script = SCRIPTS / "notice_training.py"
    job = cluster.launch(
        4,
        [sys.executable, str(script), str(tmp_path / "checkpoints"), "--notice-ranks", "2", "3"]
        + ["--hosts-file", str(listing), "--after-notice", kept, "--offer", every_host, "--offer-attempt", "1"],
        tmp_path,
        env={"TF_NUM_INTRAOP_THREADS": "1"},
        extra_flags=["--restarts", "1", "--min-np", "2", "--discovery-interval", "1"]
        + ["--host-discovery-script", str(discover)],
        timeout=JOB_TIMEOUT_S,
        script_name=script.name,
    )
    assert job.returncode == 0 and not job.timed_out, job.describe()
    lost = cluster.hosts[2:]
    for host in lost:
        assert f"notice received on rank {cluster.hosts.index(host)}, host {host}" in job.output, job.describe()
    assert f"starting it again without {', '.join(sorted(lost))}" in job.output, job.describe()
    assert f"starting 2 of the planned 4 ranks on {kept}" in job.output, job.describe()
    assert f"4 of the planned 4 ranks fit now, on {every_host}; the job runs 2" in job.output, job.describe()
    assert "the job stopped at a step boundary to grow" in job.output, job.describe()
    attempts = sorted(job.lines_with("ATTEMPT="))
    # Epoch 2 stopped after its batch 1 on 4 ranks: 8 micro-batches, 4 for each of 2 ranks.
    assert attempts[:6] == ["0 SIZE=4 RESUMED_FROM=0/0"] * 4 + ["1 SIZE=2 RESUMED_FROM=2/4"] * 2, job.describe()
    # The 2-rank job grew in epoch 2 or 3, wherever the launcher's look found the hosts back.
    regrown = attempts[6:]
    assert len(regrown) == 4 and len(set(regrown)) == 1, job.describe()
    assert regrown[0].startswith(("2 SIZE=4 RESUMED_FROM=2/", "2 SIZE=4 RESUMED_FROM=3/")), job.describe()
    assert job.lines_with("ITERATIONS=") == [str(UPDATES)], job.describe()
    assert float(job.lines_with("MAX_DIFFERENCE=")[0]) < 1e-5, job.describe()
