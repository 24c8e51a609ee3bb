"""A job's exit status tells the truth: the status a rank asked for survives the end of the
job, and a stall timeout fails the job even where the program caught the error."""

import re

import pytest
from launch_utils import LAUNCH_TEST_MARKS, child_env, mpirun

pytestmark = LAUNCH_TEST_MARKS
FAILURE_DEADLINE_S = 30


@pytest.mark.parametrize("status", [3, 0])
def test_sys_exit_on_one_rank_mid_job_ends_the_job_with_that_status(tmp_path, status):
    job = mpirun("exit_mid_job.py", str(status), cwd=tmp_path)
    assert not job.timed_out, "job hung" + job.describe()
    assert "RANK0_FINISHED" not in job.output, job.describe()
    assert job.ended - job.marker("FAIL_AT") < FAILURE_DEADLINE_S, job.describe()
    if status:
        assert job.returncode == status, job.describe()
        assert f"rank 1 called sys.exit with status {status}" in job.output, job.describe()
    else:  # rank 0's collective can never complete: that is a failure of the job
        assert job.returncode != 0, job.describe()


def test_a_stall_timeout_caught_by_every_rank_still_ends_the_job_non_zero(tmp_path):
    job = mpirun(
        "caught_stall.py",
        cwd=tmp_path,
        env=child_env(KERASDIST_MISMATCH_TIMEOUT_S=0, KERASDIST_STALL_WARNING_S=1, KERASDIST_STALL_TIMEOUT_S=3),
    )
    assert not job.timed_out, "job hung" + job.describe()
    assert sorted(job.lines_with("RESULT ")) == ["rank=0 DeadlineExceededError", "rank=1 DeadlineExceededError"], (
        job.describe()
    )
    assert len(job.lines_with("RANK_DONE")) == 2, job.describe()
    assert job.returncode != 0, "a job whose collectives timed out exited 0" + job.describe()
    assert "a collective timed out on rank" in job.output, job.describe()


def test_stall_warnings_name_object_collectives_and_barriers_as_calls_ranks_wait_in(tmp_path):
    job = mpirun(
        "caught_stall.py",
        cwd=tmp_path,
        env=child_env(KERASDIST_MISMATCH_TIMEOUT_S=0, KERASDIST_STALL_WARNING_S=1, KERASDIST_STALL_TIMEOUT_S=3),
    )
    assert not job.timed_out, "job hung" + job.describe()
    warning = re.compile(
        r"stall: 'broadcast_object@caught_stall\.py:\d+#0' was submitted by rank\(s\) 0 "
        r"but not by rank\(s\) 1 .*rank 1 waits in 'barrier@caught_stall\.py:\d+#\d+'"
    )
    assert warning.search(job.output), job.describe()
    assert "not in any collective" not in job.output, job.describe()
