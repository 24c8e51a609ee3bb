"""A real Slurm on emulated hosts for the tests of this directory (scripts/slurm_cluster.sh).

Usage: a test takes the session fixture ``slurm_cluster``, a ``slurm_utils.SlurmCluster`` made once
per session: two hosts (``cluster.hosts``, kd-ID-h0 and kd-ID-h1, Slurm's node names) of 2 slots,
16 CPUs each in Slurm's view (whatever the machine has), one partition "kd" (the default),
slurmctld here and a slurmd in each host's namespace, all removed at the end of the session, on
Ctrl-C and SIGTERM (and, if pytest is killed outright, by the next `up`). Run jobs as users would:
``cluster.run(["srun", "--mpi=pmi2", "-N2", "-n4", sys.executable, script], tmp_path)`` or
``["salloc", "-N2", "-n2", ...]``, and ``cluster.sbatch(script_path, tmp_path, "--requeue")``
(``sbatch --wait``; output is sbatch's then the job's slurm-JOBID.out). They get ``job_env()``:
SLURM_CONF, the venv's bin first on PATH, MPICH's ofi netmod over TCP (see slurm_utils), the repo on
PYTHONPATH; ``env={...}`` adds variables. Each returns launch_utils.JobResult (output in a file,
timeout, leftovers killed); afterwards every job left in the queue is cancelled.
``cluster.command(["squeue", ...])`` runs a client command; ``cluster.directory`` holds
slurm/log/ (slurmctld.log, slurmd-HOST.log), and ``SLURM_SCRIPT down`` removes it all.
The tests skip, naming the reason, where the cluster cannot be made (not root, no namespaces,
slurm-wlm or munge missing: scripts/cluster_packages.sh install); one that can be made but fails
to come up is an error.
"""

import signal
import subprocess
import sys
from pathlib import Path

import pytest

# The launch tests' job runner and the multihost tests' cluster helpers.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "launch"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "multihost"))

from launch_utils import under_a_launcher  # noqa: E402
from slurm_utils import SLURM_SCRIPT, SlurmCluster  # noqa: E402

CLUSTER_SETUP_TIMEOUT_S = 120
NODE_CPUS = 16  # Slurm's view: enough for the README's job script as written


def _why_no_slurm():
    if under_a_launcher():
        return "Slurm tests start their own jobs; run them from plain pytest"
    try:
        checked = subprocess.run([SLURM_SCRIPT, "check"], capture_output=True, text=True, timeout=60)
    except OSError as error:
        return f"cannot run {SLURM_SCRIPT}: {error}"
    if checked.returncode != 0:
        return f"no Slurm test cluster on this machine: {(checked.stdout + checked.stderr).strip()}"
    return None


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def slurm_cluster():
    """Two emulated hosts running Slurm (see the module's docstring)."""
    reason = _why_no_slurm()
    if reason:
        pytest.skip(reason)
    previous_sigterm = signal.signal(signal.SIGTERM, _interrupt)
    cluster = None
    try:
        cluster = SlurmCluster.up(hosts=2, slots=2, cpus=NODE_CPUS, timeout=CLUSTER_SETUP_TIMEOUT_S)
        yield cluster
    finally:
        if cluster is not None:
            cluster.down()
        signal.signal(signal.SIGTERM, previous_sigterm)
