"""kerasdist-run refuses what cannot start before mpiexec runs (one line, status 2), and one
Ctrl-C ends a job whose ranks are blocked in a collective."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_utils import LAUNCH_TEST_MARKS, SCRIPTS, announced_rank_pids, child_env, run_job

pytestmark = LAUNCH_TEST_MARKS
LAUNCHER = [sys.executable, "-m", "kerasdist.run"]
STARTUP_TIMEOUT_S = 180
# The launcher's 2 s grace for the ranks, then hydra's second to end them, with room for a busy machine.
INTERRUPT_DEADLINE_S = 10


def _refused(tmp_path, *argv):
    job = run_job([*LAUNCHER, "-np", "2", *argv], tmp_path, timeout=60)
    assert not job.timed_out and job.returncode == 2, job.describe()
    assert job.output.count("\n") == 1 and job.output.startswith("kerasdist-run: error: "), job.describe()
    return job.output


def test_a_missing_script_is_refused_in_one_line_with_status_2(tmp_path):
    assert "no such script: 'trian.py'" in _refused(tmp_path, "trian.py")


def test_a_missing_script_after_python_is_refused_in_one_line(tmp_path):
    assert "no such script: 'trian.py'" in _refused(tmp_path, sys.executable, "trian.py")


def test_a_missing_program_is_refused_in_one_line(tmp_path):
    assert "'no-such-program' is not an executable file" in _refused(tmp_path, "no-such-program")


def test_a_host_that_does_not_resolve_is_refused_in_one_line(tmp_path):
    # .invalid never resolves (RFC 2606)
    output = _refused(tmp_path, "-H", "nosuchhost.invalid:2", sys.executable, "-c", "pass")
    assert "nosuchhost.invalid" in output and "resolve" in output


def test_a_host_name_with_a_space_is_a_usage_error(tmp_path):
    assert "-H" in _refused(tmp_path, "-H", "a b:2", sys.executable, "-c", "pass")


def test_one_sigint_ends_a_job_blocked_in_a_collective(tmp_path):
    log_path = tmp_path / "job.log"
    never = dict(
        KERASDIST_MISMATCH_TIMEOUT_S=0,
        KERASDIST_STALL_WARNING_S=0,
        KERASDIST_STALL_TIMEOUT_S=0,
        KERASDIST_COLLECTIVE_TIMEOUT_S=0,
    )
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*LAUNCHER, "-np", "2", str(SCRIPTS / "hung_collective.py")],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=tmp_path,
            env=child_env(**never),
            start_new_session=True,
        )
    rank_pids = []
    try:
        rank_pids = announced_rank_pids(log_path, 2, STARTUP_TIMEOUT_S, proc)
        assert len(rank_pids) == 2, log_path.read_text()
        time.sleep(1)  # both ranks are in their collectives
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        try:
            status = proc.wait(timeout=INTERRUPT_DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"one SIGINT did not end the job within {INTERRUPT_DEADLINE_S} s\n{log_path.read_text()}")
        assert status == 128 + signal.SIGINT, log_path.read_text()
        while any(Path(f"/proc/{pid}").exists() for pid in rank_pids) and time.monotonic() < sent + 10:
            time.sleep(0.2)
        assert not [pid for pid in rank_pids if Path(f"/proc/{pid}").exists()], "ranks outlived the job"
        assert "UNREACHABLE" not in log_path.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for pid in rank_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
