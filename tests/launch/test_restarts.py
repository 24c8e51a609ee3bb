"""kerasdist-run --restarts: a job that fails is started again, and with Rank0Checkpoint(resume=True)
it finishes with the weights an uninterrupted run reaches."""

import json
import random
import sys

import pytest
from launch_utils import LAUNCH_TEST_MARKS, SCRIPTS, run_job

LAUNCHER = [sys.executable, "-m", "kerasdist.run"]
JOB_TIMEOUT_S = 240
SCRIPT = SCRIPTS / "restart_training.py"

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


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory):
    """The job run without faults, once per set of options in this file (a 2-rank job each)."""
    runs = {}

    def run(options=()):
        options = tuple(options)
        if options not in runs:
            directory = tmp_path_factory.mktemp("uninterrupted")
            job = run_job(
                [*LAUNCHER, "-np", "2", SCRIPT, directory / "checkpoints", "-1", *options],
                directory,
                timeout=JOB_TIMEOUT_S,
                script_name=SCRIPT.name,
            )
            assert job.returncode == 0, job.describe()
            runs[options] = job
        return runs[options]

    return run


def test_training_killed_mid_epoch_resumes_and_ends_with_the_uninterrupted_weights(tmp_path, uninterrupted_run):
    uninterrupted = uninterrupted_run()
    restarted = run_job(
        [*LAUNCHER, "-np", "2", "--restarts", "1", SCRIPT, tmp_path / "faulty", "2"],
        tmp_path,
        timeout=JOB_TIMEOUT_S,
        script_name=SCRIPT.name,
    )
    assert restarted.returncode == 0, restarted.describe()
    assert "injected fault in epoch 2" in restarted.output, restarted.describe()
    # The second attempt started after the last complete epoch, 1 (epochs count from 0).
    assert restarted.lines_with("RESUMED_FROM=") == ["0", "0", "2", "2"], restarted.describe()
    assert restarted.lines_with("WEIGHTS=") == uninterrupted.lines_with("WEIGHTS="), restarted.describe()


def test_training_killed_at_random_points_and_in_a_save_ends_with_the_uninterrupted_weights(
    tmp_path, uninterrupted_run
):
    """Four SIGKILLs, one per attempt, at random batches on random ranks and once in the middle of
    rank 0's checkpoint save (the archive written, not yet renamed into place). Each fault lies at
    or after the epoch its attempt resumes from, so every one of them happens."""
    rng = random.Random(2026)
    in_save_at = rng.randrange(4)
    faults, epoch = [], 0
    for attempt in range(4):
        epoch = rng.randrange(epoch, 4)
        if attempt == in_save_at:
            faults.append({"attempt": attempt, "rank": 0, "epoch": epoch, "in_save": True})
        else:
            faults.append({"attempt": attempt, "rank": rng.randrange(2), "epoch": epoch, "batch": rng.randrange(8)})
    uninterrupted = uninterrupted_run()
    restarted = run_job(
        [*LAUNCHER, "-np", "2", "--restarts", "4", SCRIPT, tmp_path / "faulty", "-1", json.dumps(faults)],
        tmp_path,
        timeout=2 * JOB_TIMEOUT_S,
        script_name=SCRIPT.name,
    )
    assert restarted.returncode == 0, restarted.describe()
    assert len(restarted.lines_with("KILLED attempt ")) == len(faults), f"faults {faults}" + restarted.describe()
    # Each attempt resumed where the fault before it left the last complete checkpoint.
    resumed = restarted.lines_with("RESUMED_FROM=")
    assert resumed == [str(e) for e in [0] + [f["epoch"] for f in faults] for _ in range(2)], (
        f"faults {faults}" + restarted.describe()
    )
    # Every attempt after a fault loaded every checkpoint the fault left on disk.
    assert len(restarted.lines_with("READABLE=")) >= len(faults), restarted.describe()
    assert restarted.lines_with("WEIGHTS=") == uninterrupted.lines_with("WEIGHTS="), restarted.describe()


@pytest.mark.parametrize("mode", ["delay_gradients", "one_bit_gradients", "accumulation"])
def test_a_restart_with_per_rank_optimizer_state_ends_with_the_uninterrupted_weights(tmp_path, uninterrupted_run, mode):
    """Held gradients, 1-bit residuals and a window of 3 micro-batches that spans the end of each
    8-step epoch differ between the ranks; each rank must get its own back when the job resumes."""
    options = ["--per-rank-state", mode]
    uninterrupted = uninterrupted_run(options)
    restarted = run_job(
        [*LAUNCHER, "-np", "2", "--restarts", "1", SCRIPT, tmp_path / "faulty", "2", *options],
        tmp_path,
        timeout=JOB_TIMEOUT_S,
        script_name=SCRIPT.name,
    )
    assert restarted.returncode == 0, restarted.describe()
    assert restarted.lines_with("RESUMED_FROM=") == ["0", "0", "2", "2"], restarted.describe()
    assert restarted.lines_with("WEIGHTS=") == uninterrupted.lines_with("WEIGHTS="), restarted.describe()


def test_a_resume_on_another_number_of_ranks_starts_the_per_rank_state_afresh_and_says_so(tmp_path):
    """As after a restart under --min-np: the 2 ranks' parts of the state belong to no rank of 1."""
    options = ["--per-rank-state", "accumulation", "--epochs"]
    saved = run_job(
        [*LAUNCHER, "-np", "2", SCRIPT, tmp_path / "checkpoints", "-1", *options, "1"],
        tmp_path,
        timeout=JOB_TIMEOUT_S,
        script_name=SCRIPT.name,
    )
    assert saved.returncode == 0, saved.describe()
    resumed = run_job(
        [*LAUNCHER, "-np", "1", SCRIPT, tmp_path / "checkpoints", "-1", *options, "2"],
        tmp_path,
        timeout=JOB_TIMEOUT_S,
        script_name=SCRIPT.name,
    )
    assert resumed.returncode == 0, resumed.describe()
    assert resumed.lines_with("RESUMED_FROM=") == ["1"], resumed.describe()
    assert "was saved by 2 rank(s) and this job runs 1, so each rank's own optimizer state" in resumed.output, (
        resumed.describe()
    )
    assert "the partial gradient sums of backward_passes_per_step) starts afresh" in resumed.output, resumed.describe()
