"""kerasdist built against Open MPI, launched by `kerasdist-run` as a user would: the build
names Open MPI, and a job on one host runs with more ranks than cores, as under MPICH."""

import json
import os
import re
import subprocess

from openmpi_utils import KERASDIST_RUN, SCRIPTS, kerasdist_run, openmpi_env


def test_check_build_names_open_mpi_and_its_mpirun(open_mpi):
    checked = subprocess.run(
        [KERASDIST_RUN, "--check-build"], capture_output=True, text=True, env=openmpi_env(), timeout=120
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert re.search(r"^MPI: .*mpicc\.openmpi; Open MPI; mpiexec /usr/bin/mpiexec\.openmpi$", checked.stdout, re.M), (
        checked.stdout
    )
    assert "launch mpiexec: /usr/bin/mpiexec.openmpi (Open MPI; chosen from build_info.json)" in checked.stdout, (
        checked.stdout
    )


def test_a_local_job_of_more_ranks_than_cores_runs_as_under_mpich(open_mpi, tmp_path):
    """Open MPI alone refuses this ("not enough slots"); kerasdist-run asks it to oversubscribe."""
    ranks = os.cpu_count() + 1
    job = kerasdist_run(ranks, SCRIPTS / "placement.py", cwd=tmp_path, timeout=180)
    assert job.returncode == 0 and not job.timed_out, job.describe()
    placed = sorted((json.loads(line) for line in job.lines_with("PLACED ")), key=lambda report: report["rank"])
    assert [(r["rank"], r["size"], r["local_rank"]) for r in placed] == [(i, ranks, i) for i in range(ranks)], placed
    assert all(r["sum"] == ranks * (ranks + 1) / 2 for r in placed), placed
