"""A rank that leaves with os._exit (skipping every exit handler) while the others still train is
a failure of the job: under plain mpiexec hydra used to kill the other ranks without a word and
end the job with status 0, so `kerasdist-run --restarts` did not start it again."""

import sys

import pytest
from launch_utils import LAUNCH_TEST_MARKS, SCRIPTS, mpirun, run_job

pytestmark = LAUNCH_TEST_MARKS
FAILURE_DEADLINE_S = 30
LAUNCHER = [sys.executable, "-m", "kerasdist.run"]


@pytest.mark.parametrize("status", [0, 3])
def test_os_exit_on_one_rank_mid_fit_fails_the_job_and_names_that_rank(tmp_path, status):
    job = mpirun("quiet_exit.py", str(status), "mid_fit", cwd=tmp_path)
    assert not job.timed_out, "job hung" + job.describe()
    assert "FIT_FINISHED" not in job.output, job.describe()
    assert job.ended - job.marker("FAIL_AT") < FAILURE_DEADLINE_S, job.describe()
    assert f"rank 1 left with os._exit({status})" in job.output, job.describe()
    assert job.returncode == (status or 1), job.describe()


def test_os_exit_on_every_rank_after_fit_ends_the_job_with_that_status(tmp_path):
    job = mpirun("quiet_exit.py", "0", "after_fit", cwd=tmp_path)
    assert not job.timed_out, "job hung" + job.describe()
    assert len(job.lines_with("FIT_FINISHED")) == 2, job.describe()
    assert job.returncode == 0, job.describe()


def test_kerasdist_run_restarts_a_job_a_rank_left_with_os_exit_0(tmp_path):
    script = SCRIPTS / "quiet_exit.py"
    job = run_job(
        [*LAUNCHER, "-np", "2", "--restarts", "1", sys.executable, script, "0", "mid_fit", "--once"], tmp_path
    )
    assert not job.timed_out, "job hung" + job.describe()
    assert "the job ended with status 1; starting it again" in job.output, job.describe()
    assert len(job.lines_with("FIT_FINISHED")) == 2, job.describe()
    assert job.returncode == 0, job.describe()
