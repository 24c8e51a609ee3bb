"""Jobs of kerasdist built against Debian's Open MPI (`make build-openmpi`: the .venv-openmpi
venv), started from plain pytest in .venv, and why they cannot run where they cannot.

The ranks run .venv-openmpi's Python with `-P` and without this tree on PYTHONPATH, so that
kerasdist (and its op library, linked to Open MPI) comes from that venv, not from the tree.
"""

import os
import shutil
import subprocess
from pathlib import Path

from launch_utils import REPO_ROOT, child_env, run_job, under_a_launcher  # tests/launch, on the path by conftest

VENV = REPO_ROOT / ".venv-openmpi"
PYTHON = VENV / "bin" / "python"
KERASDIST_RUN = VENV / "bin" / "kerasdist-run"
MPIRUN = "mpirun.openmpi"  # Debian's name; /usr/bin/mpirun may point at another MPI
PACKAGES_SCRIPT = REPO_ROOT / "scripts" / "cluster_packages.sh"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
LAUNCH_SCRIPTS = REPO_ROOT / "tests" / "launch" / "scripts"


def why_no_open_mpi_jobs():
    """Why this machine cannot run the Open MPI jobs, or None when it can."""
    if under_a_launcher():
        return "the Open MPI tests start their own jobs; run them from plain pytest"
    missing = subprocess.run([PACKAGES_SCRIPT, "missing"], capture_output=True, text=True, timeout=60).stdout.split()
    missing = [package for package in missing if "openmpi" in package]
    if missing or not shutil.which(MPIRUN):
        return (
            f"Open MPI is not installed (missing: {' '.join(missing) or MPIRUN}); "
            "`make cluster-packages` installs it as root on Debian"
        )
    if not (VENV / ".built").exists():
        return f"{VENV} is not built: run `make build-openmpi`"
    return None


def openmpi_env(**extra):
    """The environment of an Open MPI job: the launch tests' child environment without this tree
    on the path, and, as root, Open MPI's consent to run as root (it refuses otherwise)."""
    env = child_env(**extra)
    env.pop("PYTHONPATH", None)
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def kerasdist_run(num_processes, script, *args, cwd, flags=(), env=None, timeout=120):
    """`.venv-openmpi/bin/kerasdist-run -np N FLAGS python -P SCRIPT ARGS...`: the user's path."""
    argv = [KERASDIST_RUN, "-np", str(num_processes), *flags, PYTHON, "-P", script, *args]
    return run_job(argv, cwd, env=env or openmpi_env(), timeout=timeout, script_name=Path(script).name)
