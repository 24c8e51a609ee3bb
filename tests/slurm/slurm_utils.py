"""A real Slurm on emulated hosts (scripts/slurm_cluster.sh), and jobs run on it as users run them.

Jobs go through Slurm's own commands (srun, sbatch, salloc) with the cluster's SLURM_CONF, the
venv's bin first on PATH, and MPICH's ofi netmod over TCP (MPIR_CVAR_CH4_NETMOD=ofi
FI_PROVIDER=tcp): with UCX (UCX_TLS=tcp) Slurm 22.05's pmi2 now and then rejected a rank's
request at MPI start ("value not properly terminated", "request not begin with 'cmd='"), 2 jobs
in about 10 here (see docs/deployment.md's Slurm section). Each job's output goes to a file
(tests/launch/launch_utils.run_job); after each one, whatever is left in the queue is cancelled,
so a timed-out job cannot hold the nodes for the next test.
"""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from launch_utils import REPO_ROOT, JobResult, run_job
from multihost_utils import read_env_file, tcp_env

SLURM_SCRIPT = str(REPO_ROOT / "scripts" / "slurm_cluster.sh")
VENV_BIN = Path(sys.executable).parent
DEFAULT_JOB_TIMEOUT_S = 120
# Not UCX: see the module's docstring.
MPI_OVER_TCP = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}


@dataclasses.dataclass
class SlurmCluster:
    """One cluster made by ``slurm_cluster.sh up``; ``env`` holds its NETNS_CLUSTER_* and SLURM_CONF."""

    env: dict

    @classmethod
    def up(cls, hosts, slots, cpus, timeout):
        argv = [SLURM_SCRIPT, "up", "--hosts", str(hosts), "--slots", str(slots), "--cpus", str(cpus)]
        argv += ["--owner", str(os.getpid())]
        made = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if made.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({made.returncode}):\n{made.stderr}")
        return cls(read_env_file(Path(made.stdout.strip().splitlines()[-1]) / "env"))

    def down(self):
        subprocess.run([SLURM_SCRIPT, "down", self.directory], check=True, capture_output=True, timeout=120)

    @property
    def directory(self):
        return self.env["NETNS_CLUSTER_DIR"]

    @property
    def hosts(self):
        return self.env["NETNS_CLUSTER_HOSTS"].split(",")

    @property
    def interface(self):
        return self.env["NETNS_CLUSTER_IFACE"]

    def job_env(self, **extra):
        """The environment of a Slurm command: no Slurm variables of ours, this cluster's SLURM_CONF."""
        environment = {
            name: value for name, value in tcp_env(**{**MPI_OVER_TCP, **extra}).items() if not name.startswith("SLURM")
        }
        environment["SLURM_CONF"] = self.env["SLURM_CONF"]
        environment["PATH"] = f"{VENV_BIN}{os.pathsep}{environment.get('PATH', '')}"
        return environment

    def command(self, argv, timeout=30):
        """A Slurm client command (squeue, scontrol, scancel, sinfo) on this cluster, its output."""
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=self.job_env())

    def run(self, argv, cwd, timeout=DEFAULT_JOB_TIMEOUT_S, env=None, script_name=""):
        """``argv`` (srun ..., salloc ..., sbatch --wait ...) from ``cwd`` on this machine."""
        try:
            return run_job(argv, cwd, env=self.job_env(**(env or {})), timeout=timeout, script_name=script_name)
        finally:
            self.command(["scancel", "--full", "--user", "root"])

    def sbatch(self, script, cwd, *options, timeout=DEFAULT_JOB_TIMEOUT_S, env=None):
        """``sbatch --wait OPTIONS SCRIPT`` from ``cwd``; the result's output is sbatch's, then the job's
        (its slurm-JOBID.out, written by the batch script's node), and its status the job's."""
        job = self.run(
            ["sbatch", "--wait", f"--output={cwd}/slurm-%j.out", *options, script], cwd, timeout=timeout, env=env
        )
        outputs = "".join(path.read_text(errors="replace") for path in sorted(Path(cwd).glob("slurm-*.out")))
        return JobResult(job.argv, job.returncode, job.output + outputs, job.started, job.ended, job.timed_out)
