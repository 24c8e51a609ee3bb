"""Whole-job behaviour: failures end the job, stalls are reported, knobs work,
and a plain `python` run is a world of one. Each test launches its own job
(`mpiexec -n 2` from this Python's bin dir, or plain python) with a timeout."""

import json
import re

import numpy as np
import pytest

from launch_utils import DEFAULT_JOB_TIMEOUT_S, LAUNCH_TEST_MARKS, child_env, mpirun, python_run

FAILURE_DEADLINE_S = 30  # from the failure to the end of the whole job


pytestmark = LAUNCH_TEST_MARKS


def _assert_ended_soon_after_failure(job):
    assert not job.timed_out, "job hung" + job.describe()
    fail_at = job.marker("FAIL_AT")
    assert fail_at is not None, "the failing rank never got to its failure" + job.describe()
    took = job.ended - fail_at
    assert took < FAILURE_DEADLINE_S, f"job ended {took:.1f}s after the failure" + job.describe()
    assert job.returncode != 0, "job exited 0 despite a failed rank" + job.describe()
    assert "RANK0_FINISHED" not in job.output, job.describe()


@pytest.mark.parametrize("rank0_waits_in", ["allreduce", "barrier"])
def test_an_exception_on_one_rank_ends_the_job_and_prints_its_traceback(tmp_path, rank0_waits_in):
    job = mpirun("raise_on_rank.py", rank0_waits_in, cwd=tmp_path)
    _assert_ended_soon_after_failure(job)
    assert "Traceback" in job.output, job.describe()
    assert "RuntimeError: deliberate failure on rank 1" in job.output, job.describe()


def test_a_rank_killed_by_sigkill_ends_the_job(tmp_path):
    job = mpirun("sigkill_rank.py", cwd=tmp_path)
    _assert_ended_soon_after_failure(job)


def test_a_stalled_tensor_is_reported_then_fails_with_its_name(tmp_path):
    tensor = "stalled_tensor_7f3a"
    job = mpirun("stall.py", cwd=tmp_path,
                 env=child_env(KERASDIST_STALL_WARNING_S=1, KERASDIST_STALL_TIMEOUT_S=3))
    assert not job.timed_out, "job hung" + job.describe()
    assert job.ended - job.started < 60, job.describe()

    result = job.lines_with("STALL_RESULT=")
    assert result in (["FailedPreconditionError"], ["DeadlineExceededError"]), job.describe()
    message = job.lines_with("STALL_MESSAGE=")
    assert message and tensor in message[0], job.describe()
    seconds = job.marker("STALL_SECONDS")
    # Failed by the 3 s stall timeout: not instantly, and well before 30 s.
    assert seconds is not None and 2.0 <= seconds < FAILURE_DEADLINE_S, job.describe()

    # The job ends soon after the error; its exit status is the library's call
    # (ending the job non-zero after a stall timeout is fine).
    error_at = job.marker("STALL_ERROR_AT")
    assert error_at is not None and job.ended - error_at < FAILURE_DEADLINE_S, job.describe()

    # The warning (library output, not our own lines) names the tensor and, on
    # that line or the two around it, the missing rank 1.
    ours = ("STALL_", "LAUNCH_PID", "RANK_DONE")
    lines = [line for line in job.output.splitlines() if not line.startswith(ours)]
    near_warning = [" ".join(lines[max(0, i - 2):i + 3])
                    for i, line in enumerate(lines) if tensor in line]
    assert near_warning, "no stall warning naming the tensor" + job.describe()
    # "rank 1", "ranks: 1", "ranks [0, 1]", "rank(s) 1", "missing ranks:<newline>1: ..."
    names_rank_1 = re.compile(r"\branks?(\(s\))?\s*[:=]?\s*\[?\s*(\d+\s*,\s*)*1\b",
                              re.IGNORECASE)
    assert any(names_rank_1.search(text) for text in near_warning), (
        "stall warning does not name the missing rank 1" + job.describe())


def _fusion_run(tmp_path, label, threshold):
    out_dir = tmp_path / label
    out_dir.mkdir()
    extra = {} if threshold is None else {"KERASDIST_FUSION_THRESHOLD": threshold}
    job = mpirun("fusion.py", out_dir, cwd=tmp_path, env=child_env(**extra))
    assert job.returncode == 0 and not job.timed_out, f"{label}:" + job.describe()
    return [dict(np.load(out_dir / f"rank{r}.npz")) for r in range(2)]


@pytest.mark.timeout(3 * DEFAULT_JOB_TIMEOUT_S + 60, method="thread")  # three jobs
def test_fusion_threshold_does_not_change_results(tmp_path):
    runs = {label: _fusion_run(tmp_path, label, threshold)
            for label, threshold in (("default", None), ("off", 0), ("4KiB", 4096))}

    reference = runs["default"]
    for label, ranks in runs.items():
        for rank, arrays in enumerate(ranks):
            assert arrays.keys() == reference[rank].keys()
            for key, value in arrays.items():
                expected = reference[rank][key]
                assert value.dtype == expected.dtype, (label, rank, key)
                assert np.array_equal(value, expected), (
                    f"threshold {label} differs from default on rank {rank}, {key}")

    # And the default run is right (2 ranks: sums are exact up to one rounding).
    ranks = reference
    for key, value in ranks[0].items():
        if key.startswith("input_"):
            continue
        i = int(key.split("_")[1])
        a, b = (ranks[r][f"input_{i}"].astype(np.float64) for r in range(2))
        average = key.startswith("function_") and i % 3 == 0
        expected = (a + b) / 2 if average else a + b
        if value.dtype.kind in "iu" and average:
            expected = np.trunc(expected)
        np.testing.assert_allclose(value.astype(np.float64), expected,
                                   rtol=1e-3 if value.dtype == np.float16 else 1e-6,
                                   atol=1e-2 if value.dtype == np.float16 else 1e-6,
                                   err_msg=key)
        np.testing.assert_array_equal(ranks[1][key], value, err_msg=f"ranks differ: {key}")


def test_plain_python_run_is_a_world_of_one(tmp_path):
    job = python_run("singleton.py", cwd=tmp_path)
    assert job.returncode == 0 and not job.timed_out, job.describe()
    assert "SINGLETON_OK" in job.output, job.describe()


def test_first_collective_inside_a_tf_function(tmp_path):
    # AutoGraph used to convert the collectives and init(), warning once per mpi4py method.
    job = mpirun("first_call_traced.py", cwd=tmp_path)
    assert job.returncode == 0 and not job.timed_out, job.describe()
    assert job.output.count("TRACED_OK") == 2, job.describe()
    assert "AutoGraph could not transform" not in job.output, job.describe()


def test_results_stay_right_while_a_tiny_cache_churns(tmp_path):
    job = mpirun("cache_churn.py", cwd=tmp_path, env=child_env(KERASDIST_CACHE_CAPACITY=2))
    assert not job.timed_out, "job hung" + job.describe()
    assert job.returncode == 0, job.describe()
    assert job.output.count("CHURN_OK") == 2, job.describe()
