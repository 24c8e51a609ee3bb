"""Run small kerasdist scripts as separate jobs (mpiexec or plain python).

Output goes to a file, not a pipe, so a rank that outlives mpiexec cannot block
the reader. On timeout mpiexec gets SIGTERM (hydra forwards it to the ranks and
cleans up), then SIGKILL; any rank a script announced ("LAUNCH_PID rank=R
pid=P") that is still alive afterwards is killed by its pid.
"""

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
import unittest.mock
from pathlib import Path

import pytest

from kerasdist.run import launcher, mpi

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
# The mpiexec that belongs to this Python's environment (pip `mpich` puts it there).
MPIEXEC = Path(sys.executable).parent / "mpiexec"
DEFAULT_JOB_TIMEOUT_S = 120


def under_a_launcher():
    """True inside an mpiexec job: launch tests start their own jobs and must not run there."""
    return int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))) > 1


SKIP_UNDER_A_LAUNCHER = pytest.mark.skipif(
    under_a_launcher(), reason="launch tests start their own mpiexec; run them from plain pytest"
)
LAUNCH_TEST_MARKS = [
    SKIP_UNDER_A_LAUNCHER,
    pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec next to the Python: {MPIEXEC}"),
]

# Variables a launcher sets for its children: a child must not think it is a
# rank of the job this pytest itself may be part of.
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "MPI_LOCAL", "OMPI_", "HYDRA_", "I_MPI_", "KERASDIST_")


def child_env(**extra):
    # Not PYTHONUNBUFFERED: unbuffered, print() writes its text and its newline apart, and lines
    # that two ranks print at once interleave mid-line (CI saw 'X=2.0X=2.0'). The scripts print
    # with flush=True instead: each line leaves in one write, and before a kill can lose it.
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env.pop("PYTHONUNBUFFERED", None)
    env.update(OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env.update({k: str(v) for k, v in extra.items()})
    return env


@dataclasses.dataclass
class JobResult:
    argv: list
    returncode: int
    output: str
    started: float  # time.time() at start
    ended: float  # time.time() when the job had exited (or was killed)
    timed_out: bool

    def marker(self, key):
        """The float after the last 'KEY=' at a line start, or None."""
        found = re.findall(rf"^{re.escape(key)}=([0-9.eE+-]+)\s*$", self.output, re.MULTILINE)
        return float(found[-1]) if found else None

    def lines_with(self, prefix):
        return [line[len(prefix) :] for line in self.output.splitlines() if line.startswith(prefix)]

    def describe(self, tail_chars=6000):
        return (
            f"\n$ {' '.join(self.argv)}\nreturncode={self.returncode} "
            f"timed_out={self.timed_out} took={self.ended - self.started:.1f}s\n"
            f"--- output (last {tail_chars} chars) ---\n{self.output[-tail_chars:]}"
        )


def _kill_announced_leftovers(output, script_name):
    for pid in {int(p) for p in re.findall(r"^LAUNCH_PID rank=\d+ pid=(\d+)", output, re.M)}:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # already gone
        if script_name.encode() in cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@contextlib.contextmanager
def op_library_built_against(flavour_name):
    """Within it, kerasdist-run in this process takes the op library as built against the MPI
    ``flavour_name`` names ("mpich", "intel", "openmpi"), so that it accepts that family's
    mpiexec: the command-line tests spell every flavour's options with one build."""
    build_info = {"mpi": mpi.FLAVOURS[flavour_name].title, "mpi_flavour": flavour_name, "mpiexec": None}
    with unittest.mock.patch.object(launcher, "read_build_info", lambda: build_info):
        yield


def run_job(argv, cwd, env=None, timeout=DEFAULT_JOB_TIMEOUT_S, script_name=""):
    cwd = Path(cwd)
    log_path = cwd / f"job-{time.monotonic_ns()}.log"
    timed_out = False
    with open(log_path, "w") as log:
        started = time.time()
        proc = subprocess.Popen(
            [str(a) for a in argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env=env if env is not None else child_env(),
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        ended = time.time()
    output = log_path.read_text(errors="replace")
    _kill_announced_leftovers(output, script_name)
    return JobResult([str(a) for a in argv], proc.returncode, output, started, ended, timed_out)


def announced_rank_pids(log_path, count, timeout, proc):
    """The pids the ranks announced ("LAUNCH_PID rank=R pid=P") in the job's log, once `count`
    have, or whatever is there after `timeout` s or once `proc` (the launcher) has ended. Read
    from the whole text, not line by line: the launcher may forward two ranks' lines run together."""
    deadline = time.monotonic() + timeout
    pids = []
    while len(pids) < count and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
        pids = [int(pid) for pid in re.findall(r"LAUNCH_PID rank=\d+ pid=(\d+)", Path(log_path).read_text())]
    return pids


def mpirun(script, *args, n=2, cwd, env=None, timeout=DEFAULT_JOB_TIMEOUT_S):
    """mpiexec -n N python tests/launch/scripts/SCRIPT ARGS..."""
    argv = [MPIEXEC, "-n", str(n), sys.executable, SCRIPTS / script, *args]
    return run_job(argv, cwd, env, timeout, script_name=script)


def python_run(script, *args, cwd, env=None, timeout=DEFAULT_JOB_TIMEOUT_S):
    """A plain `python SCRIPT`: an MPI singleton, no launcher."""
    argv = [sys.executable, SCRIPTS / script, *args]
    return run_job(argv, cwd, env, timeout, script_name=script)
