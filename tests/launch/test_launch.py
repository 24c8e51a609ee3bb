"""Whole-job behaviour: failures end the job, stalls are reported, knobs work,
and a plain `python` run is a world of one. Each test launches its own job
(`mpiexec -n 2` from this Python's bin dir, or plain python) with a timeout."""

import json
import re

import numpy as np
import pytest
from launch_utils import DEFAULT_JOB_TIMEOUT_S, LAUNCH_TEST_MARKS, child_env, mpirun, python_run

pytestmark = LAUNCH_TEST_MARKS


def _assert_the_whole_job_ended_after_the_failure(job):
    # The job timeout bounds a hang; how fast the job ends is not asserted (the machine is shared).
    assert not job.timed_out, "job hung" + job.describe()
    assert job.marker("FAIL_AT") is not None, "the failing rank never got to its failure" + job.describe()
    assert job.returncode != 0, "job exited 0 despite a failed rank" + job.describe()
    assert "RANK0_FINISHED" not in job.output, job.describe()


@pytest.mark.parametrize("rank0_waits_in", ["allreduce", "barrier"])
def test_an_exception_on_one_rank_ends_the_job_and_prints_its_traceback(tmp_path, rank0_waits_in):
    job = mpirun("raise_on_rank.py", rank0_waits_in, cwd=tmp_path)
    _assert_the_whole_job_ended_after_the_failure(job)
    assert "Traceback" in job.output, job.describe()
    assert "RuntimeError: deliberate failure on rank 1" in job.output, job.describe()


def test_a_rank_killed_by_sigkill_ends_the_job(tmp_path):
    job = mpirun("sigkill_rank.py", cwd=tmp_path)
    _assert_the_whole_job_ended_after_the_failure(job)


@pytest.mark.parametrize("rank0_is", ["waiting", "moving"], ids=["rank0_waits_in_a_negotiation", "rank0_moves_data"])
def test_a_frozen_rank_ends_the_job_within_the_collective_timeout(tmp_path, rank0_is):
    """A rank that stops (SIGSTOP: a hung host, a dropped link) errs in nothing and exits never.
    Rank 0 ends the job, by the watchdog while data moves and by its unanswered questions while
    it waits, instead of after the 30-minute stall timeout."""
    timeout_s = 3
    job = mpirun("frozen_rank.py", rank0_is, cwd=tmp_path, env=child_env(KERASDIST_COLLECTIVE_TIMEOUT_S=timeout_s))
    assert not job.timed_out and job.returncode == 1, job.describe()
    detected_after = job.ended - job.marker("FROZEN_AT")
    # The timeout, plus (when rank 0 waits) the 5 s before its first question (kAskEveryS), plus slack.
    assert timeout_s <= detected_after < timeout_s + 5 + 5, job.describe()
    [line] = _library_lines(job, "ERROR")
    assert "KERASDIST_COLLECTIVE_TIMEOUT_S" in line and "so that the launcher ends the job" in line, job.describe()
    if rank0_is == "waiting":
        assert "rank(s) 1 (host " in line, job.describe()


def _stall_job(tmp_path, **knobs):
    return mpirun(
        "stall.py", cwd=tmp_path, env=child_env(KERASDIST_STALL_WARNING_S=1, KERASDIST_STALL_TIMEOUT_S=3, **knobs)
    )


def _library_lines(job, level):
    return [line for line in job.output.splitlines() if line.startswith("[kerasdist rank") and f" {level}: " in line]


def test_a_stalled_tensor_is_reported_then_fails_with_its_name(tmp_path):
    tensor = "stalled_tensor_7f3a"
    job = _stall_job(tmp_path)
    assert not job.timed_out, "job hung" + job.describe()

    result = job.lines_with("STALL_RESULT=")
    assert result in (["FailedPreconditionError"], ["DeadlineExceededError"]), job.describe()
    message = job.lines_with("STALL_MESSAGE=")
    assert message and tensor in message[0], job.describe()
    seconds = job.marker("STALL_SECONDS")
    # Failed by the 3 s stall timeout, not at once (the default of 1800 s would hit the job timeout).
    assert seconds is not None and seconds >= 2.0, job.describe()
    # The job ends after the error; its exit status is the library's call (ending the job
    # non-zero after a stall timeout is fine).
    assert job.marker("STALL_ERROR_AT") is not None, job.describe()

    # The warning (library output, not our own lines) names the tensor and, on that line or
    # the two around it, the missing rank 1.
    ours = ("STALL_", "LAUNCH_PID", "RANK_DONE")
    lines = [line for line in job.output.splitlines() if not line.startswith(ours)]
    near_warning = [" ".join(lines[max(0, i - 2) : i + 3]) for i, line in enumerate(lines) if tensor in line]
    assert near_warning, "no stall warning naming the tensor" + job.describe()
    # "rank 1", "ranks: 1", "ranks [0, 1]", "rank(s) 1", "missing ranks:<newline>1: ..."
    names_rank_1 = re.compile(r"\branks?(\(s\))?\s*[:=]?\s*\[?\s*(\d+\s*,\s*)*1\b", re.IGNORECASE)
    assert any(names_rank_1.search(text) for text in near_warning), (
        "stall warning does not name the missing rank 1" + job.describe()
    )
    warnings = _library_lines(job, "WARNING")
    assert warnings, job.describe()  # at the default level, warning
    # Rank 1 sleeps while its engine answers: no warning calls it silent (the first one did, when
    # a question to it had gone out just before the warning). The first may come before any
    # answer ("other ranks"); the others call it idle.
    for warning in warnings:
        assert "not answering" not in warning, job.describe()
    assert "rank(s) 1 (host " in warnings[-1] and "(not in any collective)" in warnings[-1], job.describe()


def test_log_level_error_drops_the_stall_warnings_and_keeps_the_error(tmp_path):
    job = _stall_job(tmp_path, KERASDIST_LOG_LEVEL="error")
    assert not job.timed_out, "job hung" + job.describe()
    assert job.lines_with("STALL_RESULT=") == ["DeadlineExceededError"], job.describe()
    assert _library_lines(job, "WARNING") == [], job.describe()
    assert any("stalled_tensor_7f3a" in line for line in _library_lines(job, "ERROR")), job.describe()


def test_stall_knobs_at_zero_never_warn_and_wait_for_the_late_rank(tmp_path):
    # The last rank comes 4 s late: with a limit of 0 read as "0 seconds" the collective would
    # fail at once, and a warning period of 0 would warn without pause.
    job = mpirun(
        "late_rank.py", "4", cwd=tmp_path, env=child_env(KERASDIST_STALL_WARNING_S=0, KERASDIST_STALL_TIMEOUT_S=0)
    )
    assert job.returncode == 0 and not job.timed_out, job.describe()
    # (ranks printing at once can share a line of the launcher's output)
    assert re.findall(r"LATE_RESULT=(\S+)", job.output) == ["2.0", "2.0"], job.describe()
    assert max(map(float, re.findall(r"LATE_SECONDS=([0-9.]+)", job.output))) >= 3.0, job.describe()  # rank 0 waited
    assert "stall" not in job.output.lower() and not _library_lines(job, "WARNING"), job.describe()


def test_cycle_time_gathers_requests_that_arrive_apart_into_one_fused_cycle(tmp_path):
    # Two allreduces submitted ~50 ms apart on each rank. With a 1 s cycle time the engine,
    # woken by the first, waits for company: both are negotiated in one cycle and fused.
    cycle_ms = 1000
    path = tmp_path / "timeline.json"
    # Two threads of a rank make eager collectives: the mismatch check must be off (its knob's advice).
    job = mpirun(
        "cycle_time.py",
        cwd=tmp_path,
        env=child_env(KERASDIST_CYCLE_TIME_MS=cycle_ms, KERASDIST_TIMELINE=path, KERASDIST_MISMATCH_TIMEOUT_S=0),
    )
    assert job.returncode == 0 and not job.timed_out, job.describe()
    events = json.loads(path.read_text())
    phases = {}
    for event in events:
        if event["ph"] == "X" and event["args"]["tensor"].startswith("cycle_"):
            phases.setdefault(event["args"]["tensor"], {}).setdefault(event["name"], event)
    assert sorted(phases) == ["cycle_first", "cycle_second"], events
    queued_until = {round(p["queued"]["ts"] + p["queued"]["dur"]) for p in phases.values()}
    assert len(queued_until) == 1, phases  # negotiated together
    assert all("copy_in" in p for p in phases.values()), phases  # fused into one reduction
    # The earlier one waited out the cycle time (a lower bound: load only makes it longer).
    assert max(p["queued"]["dur"] for p in phases.values()) >= 0.9 * cycle_ms * 1000, phases


def _fusion_run(tmp_path, label, threshold):
    out_dir = tmp_path / label
    out_dir.mkdir()
    extra = {} if threshold is None else {"KERASDIST_FUSION_THRESHOLD": threshold}
    job = mpirun("fusion.py", out_dir, cwd=tmp_path, env=child_env(**extra))
    assert job.returncode == 0 and not job.timed_out, f"{label}:" + job.describe()
    return [dict(np.load(out_dir / f"rank{r}.npz")) for r in range(2)]


@pytest.mark.timeout(3 * DEFAULT_JOB_TIMEOUT_S + 60, method="thread")  # three jobs
def test_fusion_threshold_does_not_change_results(tmp_path):
    runs = {
        label: _fusion_run(tmp_path, label, threshold)
        for label, threshold in (("default", None), ("off", 0), ("4KiB", 4096))
    }

    reference = runs["default"]
    for label, ranks in runs.items():
        for rank, arrays in enumerate(ranks):
            assert arrays.keys() == reference[rank].keys()
            for key, value in arrays.items():
                expected = reference[rank][key]
                assert value.dtype == expected.dtype, (label, rank, key)
                assert np.array_equal(value, expected), f"threshold {label} differs from default on rank {rank}, {key}"

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
        np.testing.assert_allclose(
            value.astype(np.float64),
            expected,
            rtol=1e-3 if value.dtype == np.float16 else 1e-6,
            atol=1e-2 if value.dtype == np.float16 else 1e-6,
            err_msg=key,
        )
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
