"""An evaluation on rank 0 alone after fit: with local_metrics it runs; without, rank 0 fails at
once with an error naming local_metrics instead of waiting for ranks that have finished."""

from launch_utils import LAUNCH_TEST_MARKS, mpirun

pytestmark = LAUNCH_TEST_MARKS
FAILURE_DEADLINE_S = 30


def test_rank_0_evaluates_alone_inside_local_metrics(tmp_path):
    job = mpirun("rank0_evaluate.py", "local", cwd=tmp_path)
    assert job.returncode == 0 and not job.timed_out, job.describe()
    assert len(job.lines_with("EVALUATED=")) == 1 and len(job.lines_with("RANK_DONE=")) == 2, job.describe()


def test_rank_0_evaluating_alone_without_it_fails_at_once_naming_the_fix(tmp_path):
    job = mpirun("rank0_evaluate.py", "plain", cwd=tmp_path)
    assert job.returncode != 0 and not job.timed_out, job.describe()
    assert "with kerasdist.callbacks.local_metrics(model): model.evaluate(...)" in job.output, job.describe()
    assert job.lines_with("RANK_DONE=") == ["1"], job.describe()
    assert job.ended - job.started < FAILURE_DEADLINE_S + 30, job.describe()  # + start-up of two TF processes
