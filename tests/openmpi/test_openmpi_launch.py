"""kerasdist built against Open MPI, launched by `kerasdist-run` as a user would: the build
names Open MPI, a job on one host runs with more ranks than cores, as under MPICH, and a notice
to the launcher reaches every rank through Open MPI's mpirun."""

import json
import os
import re
import signal
import subprocess
import time

from openmpi_utils import KERASDIST_RUN, LAUNCH_SCRIPTS, PYTHON, SCRIPTS, kerasdist_run, openmpi_env


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


def test_a_notice_to_kerasdist_run_reaches_every_rank_through_mpirun_and_a_rerun_resumes_exactly(open_mpi, tmp_path):
    """SIGUSR1 to the launcher (its own host is leaving): Open MPI's mpirun passes it on to every
    rank, every rank stops at one step with a checkpoint, the launcher exits 75 without starting
    anything again, and the same command, run again, resumes there and ends on the weights of one
    process trained on the global batch."""
    script = LAUNCH_SCRIPTS / "notice_training.py"
    argv = [KERASDIST_RUN, "-np", "2", PYTHON, "-P", script, tmp_path / "checkpoints", "--slow"]
    log = tmp_path / "first.log"
    with open(log, "w") as output:
        launcher = subprocess.Popen(
            argv, cwd=tmp_path, env=openmpi_env(PYTHONUNBUFFERED="1"), stdout=output, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 180
            while "BATCH_END=0 2 0" not in log.read_text() and launcher.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "BATCH_END=0 2 0" in log.read_text(), log.read_text()
            launcher.send_signal(signal.SIGUSR1)
            status = launcher.wait(timeout=120)
        finally:
            if launcher.poll() is None:
                launcher.kill()
    first = log.read_text()
    assert status == 75, first
    assert "every rank stopped on notice" in first and "Rank0Checkpoint saved this step" in first, first
    assert "not starting it again (kerasdist-run itself was given notice)" in first, first
    assert list((tmp_path / "checkpoints").glob("epoch0003-batch*.keras")), first
    again = kerasdist_run(2, script, tmp_path / "checkpoints", cwd=tmp_path, timeout=180)
    assert again.returncode == 0 and not again.timed_out, again.describe()
    assert again.lines_with("ITERATIONS=") == ["24"], again.describe()
    assert float(again.lines_with("MAX_DIFFERENCE=")[0]) < 1e-5, again.describe()
