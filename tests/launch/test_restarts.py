"""kerasdist-run --restarts: a job that fails is started again, and with Rank0Checkpoint(resume=True)
it finishes with the weights an uninterrupted run reaches."""

import sys

from launch_utils import LAUNCH_TEST_MARKS, SCRIPTS, run_job

LAUNCHER = [sys.executable, "-m", "kerasdist.run"]
JOB_TIMEOUT_S = 240

pytestmark = LAUNCH_TEST_MARKS


def test_a_job_that_keeps_failing_is_started_n_more_times_then_exits_with_its_status(tmp_path):
    attempts = "import os, sys; print('ATTEMPT', os.environ['KERASDIST_RESTART'], flush=True); sys.exit(3)"
    job = run_job([*LAUNCHER, "-np", "2", "--restarts", "2", sys.executable, "-c", attempts], tmp_path)
    assert job.returncode == 3 and not job.timed_out, job.describe()
    assert sorted(job.lines_with("ATTEMPT ")) == ["0", "0", "1", "1", "2", "2"], job.describe()
    assert job.output.count("the job ended with status 3; starting it again") == 2, job.describe()


def test_a_job_that_succeeds_is_not_started_again(tmp_path):
    job = run_job([*LAUNCHER, "-np", "2", "--restarts", "3", sys.executable, "-c", "print('RAN')"], tmp_path)
    assert job.returncode == 0 and job.output.count("RAN") == 2, job.describe()


def test_training_killed_mid_epoch_resumes_and_ends_with_the_uninterrupted_weights(tmp_path):
    script = SCRIPTS / "restart_training.py"
    uninterrupted = run_job(
        [*LAUNCHER, "-np", "2", script, tmp_path / "plain", "-1"],
        tmp_path,
        timeout=JOB_TIMEOUT_S,
        script_name=script.name,
    )
    assert uninterrupted.returncode == 0, uninterrupted.describe()
    restarted = run_job(
        [*LAUNCHER, "-np", "2", "--restarts", "1", script, tmp_path / "faulty", "2"],
        tmp_path,
        timeout=JOB_TIMEOUT_S,
        script_name=script.name,
    )
    assert restarted.returncode == 0, restarted.describe()
    assert "injected fault in epoch 2" in restarted.output, restarted.describe()
    # The second attempt started after the last complete epoch, 1 (epochs count from 0).
    assert restarted.lines_with("RESUMED_FROM=") == ["0", "0", "2", "2"], restarted.describe()
    assert restarted.lines_with("WEIGHTS=") == uninterrupted.lines_with("WEIGHTS="), restarted.describe()
