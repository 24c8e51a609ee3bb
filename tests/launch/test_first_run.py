"""A user's first run: `make demo` without any logging variable set says only what the example
says, and a `python` on PATH that cannot run kerasdist is refused before any rank starts, with
the command that works."""

import os
import re
import subprocess
import sys
import threading
import time
import venv

import pytest
from launch_utils import LAUNCH_TEST_MARKS, REPO_ROOT, child_env, run_job

from kerasdist.run import launcher, output

pytestmark = LAUNCH_TEST_MARKS
LAUNCHER = [sys.executable, "-m", "kerasdist.run"]
DEMO_TIMEOUT_S = 240
QUICK_TIMEOUT_S = 60
ONEDNN_NOTICE = (
    "I0000 00:00:1796111508.473692    {thread} port.cc:153] oneDNN custom operations are on. "
    "You may see slightly different numerical results.\n"
)
ABSL_NOTICE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"


@pytest.fixture
def python_without_kerasdist(tmp_path):
    """The bin directory of a fresh venv of this Python: its `python` has none of our packages."""
    env_dir = tmp_path / "other-env"
    venv.create(env_dir, with_pip=False, symlinks=True)
    return env_dir / "bin"


def _user_env(path_first=None):
    """A user's environment: no TF_CPP_MIN_LOG_LEVEL; optionally another bin directory first on PATH."""
    env = child_env()
    env.pop("TF_CPP_MIN_LOG_LEVEL")
    if path_first:
        env["PATH"] = f"{path_first}{os.pathsep}{env['PATH']}"
    return env


def _copied(text, tmp_path):
    """What the launcher shows of ``text`` written to the job's stderr."""
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "wb") as writer:
        writer.write(text.encode())
    with open(tmp_path / "shown", "wb") as destination:
        output.JobStream(destination, startup_notices_once=True).copy(read_end)
    os.close(read_end)
    return (tmp_path / "shown").read_text()


# ---- the job's stderr --------------------------------------------------------------------


def test_startup_notices_of_every_rank_are_shown_once_and_everything_else_in_order(tmp_path):
    error = "E0000 00:00:1796111508.5 5579 port.cc:153] something went wrong on this rank\n"
    ranks_output = (
        ABSL_NOTICE
        + ONEDNN_NOTICE.format(thread=11)
        + "rank 0 says hello\n"
        + ABSL_NOTICE
        + ONEDNN_NOTICE.format(thread=22)
        + error
        + "rank 1 says hello\n"
        + ONEDNN_NOTICE.format(thread=11)
        + error
        + "a last line without its newline"
    )
    shown_once = ABSL_NOTICE + ONEDNN_NOTICE.format(thread=11)
    assert _copied(ranks_output, tmp_path) == (
        shown_once + "rank 0 says hello\n" + error + "rank 1 says hello\n" + error + "a last line without its newline"
    )


def test_a_partial_line_goes_out_without_waiting_for_its_end(tmp_path):
    prompt = b"Overwrite the checkpoint? [y/n] "  # its newline comes when someone answers
    shown = tmp_path / "shown"
    read_end, write_end = os.pipe()
    with open(shown, "wb") as destination:
        copier = threading.Thread(target=output.JobStream(destination).copy, args=(read_end,))
        copier.start()
        os.write(write_end, prompt)
        deadline = time.monotonic() + 10 + output.PARTIAL_LINE_WAIT_S
        while shown.stat().st_size < len(prompt) and time.monotonic() < deadline:
            time.sleep(0.05)
        shown_before_the_end = shown.read_bytes()
        os.close(write_end)
        copier.join(10)
    os.close(read_end)
    assert shown_before_the_end == prompt


def test_demo_prints_no_warning_and_each_tensorflow_notice_once(tmp_path):
    argv = [*LAUNCHER, "-np", "2", REPO_ROOT / "examples" / "keras_digits.py", "--epochs=2"]
    job = run_job(argv, tmp_path, _user_env(), timeout=DEMO_TIMEOUT_S, script_name="keras_digits.py")
    assert job.returncode == 0 and not job.timed_out, job.describe()
    assert not re.findall(r"\w*Warning\b", job.output), job.describe()
    assert job.output.count("All log messages before absl::InitializeLog") == 1, job.describe()
    # Whether TensorFlow prints these depends on the CPU (oneDNN is on by default only on some);
    # where it does, every rank prints them.
    for notice in ("oneDNN custom operations are on", "cpu_feature_guard.cc"):
        assert job.output.count(notice) <= 1, notice + job.describe()
    # What the example prints, from rank 0 alone.
    assert len(re.findall(r"^Epoch 2/2", job.output, re.MULTILINE)) == 1, job.describe()
    assert len(re.findall(r"^2 process\(es\): test accuracy", job.output, re.MULTILINE)) == 1, job.describe()


# ---- the Python the ranks run ------------------------------------------------------------

# Leaves a file behind as its very first act, so a rank that started at all shows.
_MARK_START = (
    "import os, sys; open('rank-started-%s' % os.environ['PMI_RANK'], 'w').close(); "
    "print('RANK_PYTHON', sys.executable, flush=True)"
)


def test_a_python_on_path_that_cannot_run_kerasdist_is_refused_before_any_rank_starts(
    tmp_path, python_without_kerasdist
):
    job = run_job(
        [*LAUNCHER, "-np", "2", "python", "-c", _MARK_START],
        tmp_path,
        _user_env(path_first=python_without_kerasdist),
        timeout=QUICK_TIMEOUT_S,
    )
    assert job.returncode == 2 and not job.timed_out, job.describe()
    assert not list(tmp_path.glob("rank-started-*")), "a rank started" + job.describe()
    assert f"{python_without_kerasdist / 'python'} (the first on PATH)" in job.output, job.describe()
    assert "No module named 'tensorflow'" in job.output, job.describe()
    assert f"kerasdist-run itself runs in {sys.executable}" in job.output, job.describe()
    assert f"kerasdist-run -np 2 {sys.executable} -c " in job.output, job.describe()


def test_the_check_names_kerasdist_when_that_is_what_is_missing(tmp_path, python_without_kerasdist):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    problem = launcher.interpreter_problem(["python", str(script)], {"PATH": str(python_without_kerasdist)})
    assert problem.endswith("cannot run kerasdist: ModuleNotFoundError: No module named 'kerasdist'"), problem


@pytest.mark.parametrize(
    "command", [[sys.executable, "-c", _MARK_START], ["script.py"]], ids=["launcher-python", "script-alone"]
)
def test_the_working_commands_run_with_that_python_still_first_on_path(tmp_path, python_without_kerasdist, command):
    (tmp_path / "script.py").write_text(_MARK_START + "\n")
    job = run_job(
        [*LAUNCHER, "-np", "2", *command],
        tmp_path,
        _user_env(path_first=python_without_kerasdist),
        timeout=QUICK_TIMEOUT_S,
    )
    assert job.returncode == 0 and not job.timed_out, job.describe()
    assert job.lines_with("RANK_PYTHON ") == [sys.executable] * 2, job.describe()


def test_a_job_on_named_hosts_is_not_checked_here(tmp_path, python_without_kerasdist, capsys):
    mpiexec = tmp_path / "fake-mpiexec"
    mpiexec.write_text("#!/bin/sh\nexit 99\n")
    mpiexec.chmod(0o755)
    environ = {
        "PATH": f"{python_without_kerasdist}{os.pathsep}{os.environ['PATH']}",
        "KERASDIST_MPIEXEC": str(mpiexec),
        "KERASDIST_MPI_FLAVOUR": "mpich",
    }
    local = launcher.main(["-np", "2", "python", "train.py"], environ=environ)
    # Names that resolve: kerasdist-run refuses a -H host that does not, before mpiexec runs.
    on_hosts = launcher.main(["-np", "2", "-H", "localhost:1,127.0.0.1:1", "python", "train.py"], environ=environ)
    assert (local, on_hosts) == (2, 99), capsys.readouterr().err


def test_a_script_alone_runs_under_the_launcher_s_python(tmp_path):
    (tmp_path / "train.py").write_text("")
    finished = subprocess.run(
        [*LAUNCHER, "-np", "2", "--dry-run", "train.py", "--epochs=1"],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=tmp_path,
        timeout=QUICK_TIMEOUT_S,
    )
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.split()[-3:] == [sys.executable, "train.py", "--epochs=1"]
