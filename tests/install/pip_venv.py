"""What the pip-install tests share: fresh venvs, the commands they run, requirements.txt's pins."""

import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout under test
REQUIREMENTS = (ROOT / "requirements.txt").read_text(encoding="utf-8")
NEWEST = re.search(r"^tensorflow-cpu==(\d+)\.(\d+)\.\*$", REQUIREMENTS, re.M)
NEWEST_SPEC = f"tensorflow-cpu=={NEWEST[1]}.{NEWEST[2]}.*"
SECOND_SPEC = f"tensorflow-cpu=={NEWEST[1]}.{int(NEWEST[2]) - 1}.*"
# What a checkout holds that an install must not see: other environments' builds and venvs.
NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "*.so", "build_info.json", "bench-results"
)


def requirement(name):
    """requirements.txt's line for `name` (with its pin), so the venvs test what the project pins."""
    return re.search(rf"^{re.escape(name)}[<>=].*$", REQUIREMENTS, re.M)[0]


def environment():
    """This process's variables less those of the venv running it: every command below runs from
    its own venv. One math thread per rank, as `make test` runs."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    return env


def run(argv, timeout, cwd=None, expect_ok=True):
    finished = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, env=environment(), cwd=cwd, timeout=timeout
    )
    if expect_ok:
        assert finished.returncode == 0, f"{shlex.join(map(str, argv))} exited {finished.returncode}:\n" + (
            finished.stdout[-3000:] + finished.stderr[-5000:]
        )
    return finished


def run_in_terminal(argv, timeout):
    """Runs `argv` as from a user's terminal: in a pseudo-terminal that is its controlling
    terminal, so what it or its children write to /dev/tty shows too. Returns (exit status, what
    the terminal showed)."""
    pid, terminal = os.forkpty()
    if pid == 0:  # the child: nothing but exec
        try:
            os.execve(str(argv[0]), [str(a) for a in argv], environment())
        finally:
            os._exit(127)
    shown, deadline = bytearray(), time.monotonic() + timeout
    try:
        while True:
            ready, _, _ = select.select([terminal], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError(f"{shlex.join(map(str, argv))} ran over {timeout} s:\n{shown[-5000:].decode()}")
            try:
                chunk = os.read(terminal, 65536)
            except OSError:  # EIO: every process that had the terminal open has exited
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(terminal)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), shown.decode(errors="replace")


class Venv:
    def __init__(self, path):
        self.path = path
        run([sys.executable, "-m", "venv", path], timeout=120)
        self.python = path / "bin" / "python"

    def pip_install(self, *args, timeout=900):
        return run([self.python, "-m", "pip", "install", "-q", *args], timeout=timeout)

    def installed(self):
        listed = run([self.python, "-m", "pip", "list", "--format", "json"], timeout=120).stdout
        return {entry["name"].lower().replace("_", "-"): entry["version"] for entry in json.loads(listed)}

    def build_info(self):
        found = list(self.path.glob("lib/python*/site-packages/kerasdist/build_info.json"))
        assert len(found) == 1, f"kerasdist's build_info.json in {self.path}: {found}"
        return json.loads(found[0].read_text())

    def check_build(self, expect_ok=True):
        return run([self.path / "bin" / "kerasdist-run", "--check-build"], timeout=120, expect_ok=expect_ok)

    def init(self, expect_ok=True):
        code = "import kerasdist; kerasdist.init(); print('size', kerasdist.size())"
        # cwd: the venv, so no checkout shadows the installed package.
        return run([self.python, "-c", code], timeout=300, cwd=self.path, expect_ok=expect_ok)
