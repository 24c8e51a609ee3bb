"""Leaving on notice: a notice signal (SIGUSR1 unless KERASDIST_NOTICE_SIGNAL says otherwise) to
one rank makes every rank stop `fit` at the same step boundary, Rank0Checkpoint save that step and
the job exit with status 75; kerasdist-run starts it again without counting a failure (under
--min-np without the noticed host), and the restarted job ends on the weights of one process
trained on the planned global batch."""

import json
import signal
import socket
import subprocess
import sys
import zipfile
from types import SimpleNamespace

from launch_utils import LAUNCH_TEST_MARKS, SCRIPTS, run_job

from kerasdist import knobs
from kerasdist.callbacks.checkpoint import METADATA_ENTRY
from kerasdist.run import launcher

pytestmark = LAUNCH_TEST_MARKS
LAUNCHER = [sys.executable, "-m", "kerasdist.run"]
JOB_TIMEOUT_S = 240
SCRIPT = SCRIPTS / "notice_training.py"
UPDATES = 4 * 6  # the script's epochs × updates per epoch


def _last_batch_of_each_rank(job):
    last = {}
    for line in job.lines_with("BATCH_END="):
        rank, epoch, batch = (int(word) for word in line.split())
        last[rank] = (epoch, batch)
    return last


def test_a_notice_to_one_rank_stops_every_rank_at_one_step_that_the_restart_resumes_exactly(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    job = run_job(
        [*LAUNCHER, "-np", "2", "--restarts", "1", SCRIPT, checkpoints, "--notice-ranks", "1"],
        tmp_path,
        timeout=JOB_TIMEOUT_S,
        script_name=SCRIPT.name,
    )
    assert job.returncode == 0 and not job.timed_out, job.describe()
    # Rank 1 signals itself at the end of batch 1 of epoch 2, before that batch's agreement.
    assert _last_batch_of_each_rank(job) == {0: (2, 1), 1: (2, 1)}, job.describe()
    assert f"notice received on rank 1, host {socket.gethostname()}" in job.output, job.describe()
    assert "the job stopped on notice (SIGUSR1)" in job.output, job.describe()
    assert "a notice does not count against --restarts" in job.output, job.describe()
    with zipfile.ZipFile(checkpoints / "epoch0003-batch2.keras") as archive:
        metadata = json.loads(archive.read(METADATA_ENTRY))
    assert (metadata["epoch"], metadata["batches_of_all_ranks"], metadata["ranks"]) == (2, 4, 2)
    assert sorted(job.lines_with("ATTEMPT=")) == [
        "0 SIZE=2 RESUMED_FROM=0/0",
        "0 SIZE=2 RESUMED_FROM=0/0",
        "1 SIZE=2 RESUMED_FROM=2/2",
        "1 SIZE=2 RESUMED_FROM=2/2",
    ], job.describe()
    assert job.lines_with("ITERATIONS=") == [str(UPDATES)], job.describe()  # no update lost or repeated
    assert float(job.lines_with("MAX_DIFFERENCE=")[0]) < 1e-5, job.describe()


def test_a_notice_under_min_np_restarts_without_the_noticed_host_on_the_planned_global_batch(tmp_path):
    # Two names for this machine: rank 0 on localhost, rank 1 on the host that calls itself so.
    discover = tmp_path / "find-hosts"
    discover.write_text(f"#!/bin/sh\necho localhost:1\necho {socket.gethostname()}:1\n")
    discover.chmod(0o755)
    job = run_job(
        [*LAUNCHER, "-np", "2", "--restarts", "1", "--min-np", "1", "--host-discovery-script", discover]
        + [SCRIPT, tmp_path / "checkpoints", "--notice-ranks", "1"],
        tmp_path,
        timeout=JOB_TIMEOUT_S,
        script_name=SCRIPT.name,
    )
    assert job.returncode == 0 and not job.timed_out, job.describe()
    assert f"starting it again without {socket.gethostname()}" in job.output, job.describe()
    assert "starting 1 of the planned 2 ranks on localhost:1" in job.output, job.describe()
    # One rank stands in for two and passes over the 2 batches each of the two had done.
    assert sorted(job.lines_with("ATTEMPT=")) == [
        "0 SIZE=2 RESUMED_FROM=0/0",
        "0 SIZE=2 RESUMED_FROM=0/0",
        "1 SIZE=1 RESUMED_FROM=2/4",
    ], job.describe()
    assert job.lines_with("ITERATIONS=") == [str(UPDATES)], job.describe()
    assert float(job.lines_with("MAX_DIFFERENCE=")[0]) < 1e-5, job.describe()


def test_a_job_below_its_planned_size_grows_at_a_step_boundary_when_hosts_come_and_ends_on_the_planned_weights(
    tmp_path,
):
    """Shrunk first (the discovery offers 1 slot of the planned 2), then grown back: the launcher
    finds 2 slots while the job trains, it stops at a step boundary with a checkpoint and starts
    again at 2 ranks, ending where an uninterrupted run at the planned size does."""
    listing = tmp_path / "hosts"
    listing.write_text("localhost:1\n")
    discover = tmp_path / "find-hosts"
    discover.write_text(f"#!/bin/sh\ncat {listing}\n")
    discover.chmod(0o755)
    job = run_job(
        [*LAUNCHER, "-np", "2", "--restarts", "1", "--min-np", "1", "--discovery-interval", "1"]
        + ["--host-discovery-script", discover, SCRIPT, tmp_path / "checkpoints", "--hosts-file", listing]
        + ["--offer", "localhost:2"],
        tmp_path,
        timeout=JOB_TIMEOUT_S,
        script_name=SCRIPT.name,
    )
    assert job.returncode == 0 and not job.timed_out, job.describe()
    assert "starting 1 of the planned 2 ranks on localhost:1" in job.output, job.describe()
    assert "2 of the planned 2 ranks fit now, on localhost:2; the job runs 1" in job.output, job.describe()
    assert "the job stopped at a step boundary to grow" in job.output, job.describe()
    first, *second = sorted(job.lines_with("ATTEMPT="))
    assert first == "0 SIZE=1 RESUMED_FROM=0/0", job.describe()
    # Both ranks of the second attempt resume at the same step, where the first one stopped
    # (in epoch 2, the slow one, unless the machine was slow enough to reach its end first).
    assert len(second) == 2 and second[0] == second[1], job.describe()
    assert second[0].startswith(("1 SIZE=2 RESUMED_FROM=2/", "1 SIZE=2 RESUMED_FROM=3/")), job.describe()
    assert job.lines_with("ITERATIONS=") == [str(UPDATES)], job.describe()
    assert float(job.lines_with("MAX_DIFFERENCE=")[0]) < 1e-5, job.describe()


def test_a_job_shrunk_on_notice_grows_back_when_the_host_returns_and_ends_on_the_planned_weights(tmp_path):
    """2 → 1 → 2 ranks on one host under two names: rank 1's host is given notice and goes (the
    discovery program stops listing it); the 1-rank job resumes in epoch 2, the host comes back
    as that epoch resumes, and the launcher grows the job back to 2 (often while the resume still
    passes over the batches trained before, where a stop once saved too early a position)."""
    here = socket.gethostname()
    listing = tmp_path / "hosts"
    listing.write_text(f"localhost:1\n{here}:1\n")
    discover = tmp_path / "find-hosts"
    discover.write_text(f"#!/bin/sh\ncat {listing}\n")
    discover.chmod(0o755)
    job = run_job(
        [*LAUNCHER, "-np", "2", "--restarts", "1", "--min-np", "1", "--discovery-interval", "1"]
        + ["--host-discovery-script", discover, SCRIPT, tmp_path / "checkpoints", "--notice-ranks", "1"]
        + ["--hosts-file", listing, "--after-notice", "localhost:1", "--offer", f"localhost:1,{here}:1"]
        + ["--offer-attempt", "1"],
        tmp_path,
        timeout=JOB_TIMEOUT_S,
        script_name=SCRIPT.name,
    )
    assert job.returncode == 0 and not job.timed_out, job.describe()
    assert f"starting it again without {here}" in job.output, job.describe()
    assert f"2 of the planned 2 ranks fit now, on localhost:1,{here}:1; the job runs 1" in job.output, job.describe()
    attempts = sorted(job.lines_with("ATTEMPT="))
    assert attempts[:3] == ["0 SIZE=2 RESUMED_FROM=0/0"] * 2 + ["1 SIZE=1 RESUMED_FROM=2/4"], job.describe()
    assert len(attempts) == 5 and attempts[3] == attempts[4], job.describe()
    assert attempts[3].startswith(("2 SIZE=2 RESUMED_FROM=2/", "2 SIZE=2 RESUMED_FROM=3/")), job.describe()
    assert job.lines_with("ITERATIONS=") == [str(UPDATES)], job.describe()
    assert float(job.lines_with("MAX_DIFFERENCE=")[0]) < 1e-5, job.describe()


NOTICE_THEN_EXIT_75 = (
    "import signal, sys, time; got = []; signal.signal(signal.SIGUSR1, lambda *_: got.append(1)); "
    "print('READY', flush=True); deadline = time.time() + 60\n"
    "while not got and time.time() < deadline: time.sleep(0.05)\n"
    "sys.exit(75 if got else 0)"
)


def test_the_launcher_passes_its_notice_on_and_reports_it_without_calling_it_a_stop():
    """The notice reaches the job, and the status is the job's own (75), not 128 + SIGUSR1."""
    script = (
        "import os, signal, sys, threading; from kerasdist.run import launcher\n"
        f"child, noticed = [sys.executable, '-c', {NOTICE_THEN_EXIT_75!r}], []\n"
        "threading.Timer(3, os.kill, (os.getpid(), signal.SIGUSR1)).start()\n"
        "print('STATUS', launcher.run_forwarding_signals(child, None, signal.SIGUSR1, noticed), noticed)\n"
    )
    finished = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert f"STATUS {knobs.NOTICE_EXIT_STATUS} [{int(signal.SIGUSR1)}]" in finished.stdout, (
        finished.stdout + finished.stderr
    )


def test_hosts_given_notice_are_left_out_of_the_next_placement(capsys):
    args = SimpleNamespace(host_discovery_script=None, hosts="a:2,b:2", num_processes=4, min_np=1)
    assert launcher._placement(args, {}, None, leaving={"b"}) == (2, "a:2")
    assert "host b is unavailable (it was given notice to leave and is still there); leaving it out" in (
        capsys.readouterr().err
    )


def test_a_host_given_notice_is_used_again_once_a_look_has_found_it_gone(tmp_path):
    """A noticed host still listed is about to go and stays out; once it has gone, it is an
    ordinary host again, used when it comes back (a preempted node that is given back)."""
    listing = tmp_path / "hosts"
    discover = tmp_path / "find-hosts"
    discover.write_text(f"#!/bin/sh\ncat {listing}\n")
    discover.chmod(0o755)
    args = SimpleNamespace(host_discovery_script=str(discover), hosts=None, num_processes=4, min_np=2)
    leaving = {"b"}
    listing.write_text("a:2\nb:2\n")
    assert launcher._placement(args, {}, None, leaving) == (2, "a:2")
    assert leaving == {"b"}
    listing.write_text("a:2\n")
    assert launcher._placement(args, {}, None, leaving) == (2, "a:2")
    assert leaving == set()
    listing.write_text("a:2\nb:2\n")
    assert launcher._placement(args, {}, None, leaving) == (4, "a:2,b:2")
