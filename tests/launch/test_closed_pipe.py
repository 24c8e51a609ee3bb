"""kerasdist-run whose output's reader has gone (`kerasdist-run --check-build | head -3`) stops
quietly with the status of a program ended by SIGPIPE, as `seq` or `cat` do: no traceback, nothing
on stderr. Python writes stdout at once under PYTHONUNBUFFERED (the error comes from a print) and
at exit otherwise (from the final flush); both are run.
"""

import os
import signal
import subprocess
import sys

import pytest
from launch_utils import LAUNCH_TEST_MARKS, child_env

pytestmark = LAUNCH_TEST_MARKS
LAUNCHER = [sys.executable, "-m", "kerasdist.run"]
CLOSED_PIPE_STATUS = 128 + signal.SIGPIPE
PRINTING_PATHS = {
    "check-build": ["--check-build"],
    "help": ["--help"],
    "dry-run": ["-np", "2", "--dry-run", "python", "t.py"],
    "job": ["-np", "2", sys.executable, "-c", "for i in range(100000): print(i, flush=i % 7 == 0)"],
}


def _run_with_stdout_closed(argv, tmp_path, **extra_env):
    """Runs the launcher with stdout a pipe whose reader closed it before the first byte."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [*LAUNCHER, *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=child_env(**extra_env),
            cwd=tmp_path,
            timeout=120,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize("unbuffered", [True, False], ids=["PYTHONUNBUFFERED", "buffered"])
@pytest.mark.parametrize("argv", PRINTING_PATHS.values(), ids=PRINTING_PATHS.keys())
def test_a_closed_stdout_ends_the_launcher_quietly_with_sigpipe_s_status(argv, unbuffered, tmp_path):
    finished = _run_with_stdout_closed(argv, tmp_path, **({"PYTHONUNBUFFERED": "1"} if unbuffered else {}))
    assert (finished.returncode, finished.stderr) == (CLOSED_PIPE_STATUS, "")


def test_head_reads_the_first_lines_of_check_build_and_nothing_else_is_said(tmp_path):
    pipeline = f'{" ".join(LAUNCHER)} --check-build | head -1; echo "status ${{PIPESTATUS[0]}}"'
    finished = subprocess.run(
        ["bash", "-c", pipeline],
        capture_output=True,
        text=True,
        env=child_env(PYTHONUNBUFFERED="1"),
        cwd=tmp_path,
        timeout=120,
    )
    lines = finished.stdout.splitlines()
    assert lines[0].startswith("op library:") and lines[1] in ("status 0", f"status {CLOSED_PIPE_STATUS}")
    assert finished.stderr == ""
