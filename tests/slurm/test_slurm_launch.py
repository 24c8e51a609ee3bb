"""The paths users take to run kerasdist under Slurm, on a real Slurm over 2 emulated hosts.

The job scripts come from the docs themselves (the README's sbatch script, docs/deployment.md's
Slurm section), so that doc and test cannot drift: a test changes only paths (`.venv` and
`train.py` are links in the job's directory) and the interface name.
"""

import json
import re
import sys
from pathlib import Path

from launch_utils import REPO_ROOT, SKIP_UNDER_A_LAUNCHER

pytestmark = SKIP_UNDER_A_LAUNCHER
SCRIPTS = Path(__file__).resolve().parent / "scripts"
WHERE_AM_I = REPO_ROOT / "tests" / "multihost" / "scripts" / "where_am_i.py"
KERAS_DIGITS_TIMEOUT_S = 240


def code_blocks(document, after):
    """The ```sh blocks of ``document`` (a path under the repo) after the text ``after``, in order."""
    text = (REPO_ROOT / document).read_text()
    start = text.index(after)
    return re.findall(r"```sh\n(.*?)```", text[start:], re.DOTALL)


def job_directory(tmp_path, train_script):
    """A directory as the docs assume: .venv and train.py in the directory the job starts in."""
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    (tmp_path / "train.py").symlink_to(train_script)
    return tmp_path


def json_reports(job, tag):
    assert job.returncode == 0 and not job.timed_out, job.describe()
    decoder = json.JSONDecoder()
    found = [decoder.raw_decode(job.output, match.end())[0] for match in re.finditer(rf"{tag} ", job.output)]
    return sorted(found, key=lambda report: report["rank"])


def test_srun_ranks_read_their_place_from_slurm(slurm_cluster, tmp_path):
    job = slurm_cluster.run(
        ["srun", "--mpi=pmi2", "-N2", "--ntasks-per-node=2", sys.executable, SCRIPTS / "slurm_ranks.py"], tmp_path
    )
    reports = json_reports(job, "SLURM_RANK")
    assert [report["rank"] for report in reports] == [0, 1, 2, 3], job.describe()
    for report in reports:
        slurm = report["slurm"]
        assert report["rank"] == int(slurm["SLURM_PROCID"]), job.describe()
        assert report["local_rank"] == int(slurm["SLURM_LOCALID"]), job.describe()
        assert report["host"] == slurm["SLURMD_NODENAME"], report
        on_this_host = sum(other["host"] == report["host"] for other in reports)
        assert (report["size"], report["local_size"]) == (4, on_this_host), job.describe()
        assert report["sums"] == [1 + 2 + 3 + 4], report
    # Two tasks on each node, as asked, in rank order (Slurm's block distribution).
    assert [report["host"] for report in reports] == [slurm_cluster.hosts[0]] * 2 + [slurm_cluster.hosts[1]] * 2


def test_readme_sbatch_script_trains_keras_digits(slurm_cluster, tmp_path):
    script = code_blocks("README.md", "**Slurm.**")[0]
    assert "#SBATCH" in script and "srun --mpi=pmi2" in script
    directory = job_directory(tmp_path, REPO_ROOT / "examples" / "keras_digits.py")
    (directory / "job.sh").write_text(script)
    job = slurm_cluster.sbatch("job.sh", directory, timeout=KERAS_DIGITS_TIMEOUT_S)
    assert job.returncode == 0 and not job.timed_out, job.describe()
    # 2 nodes x 2 tasks each, as the script asks.
    results = re.findall(r"^4 process\(es\): test accuracy ([0-9.]+)", job.output, re.MULTILINE)
    assert len(results) == 1, "expected one result line, from rank 0 only" + job.describe()
    assert float(results[0]) >= 0.95, job.describe()


def _kerasdist_run_reports(job):
    reports = json_reports(job, "WHERE")
    assert [report["rank"] for report in reports] == [0, 1], job.describe()
    assert all(report["sum_ok"] and report["size"] == 2 for report in reports), job.describe()
    return sorted(report["host"] for report in reports)


def test_kerasdist_run_in_a_batch_script(slurm_cluster, tmp_path):
    script = next(block for block in code_blocks("docs/deployment.md", "## Slurm") if "kerasdist-run" in block)
    directory = job_directory(tmp_path, WHERE_AM_I)
    (directory / "job.sh").write_text(script)
    job = slurm_cluster.sbatch("job.sh", directory)
    assert _kerasdist_run_reports(job) == slurm_cluster.hosts, job.describe()


def _salloc_line(slurm_cluster):
    block = next(block for block in code_blocks("docs/deployment.md", "## Slurm") if block.startswith("salloc"))
    assert "--network-interface eth1" in block
    return block.strip().replace("eth1", slurm_cluster.interface)


def test_kerasdist_run_from_salloc_with_the_network_interface(slurm_cluster, tmp_path):
    directory = job_directory(tmp_path, WHERE_AM_I)
    job = slurm_cluster.run(["sh", "-c", _salloc_line(slurm_cluster)], directory, timeout=60)
    assert _kerasdist_run_reports(job) == slurm_cluster.hosts, job.describe()


def test_kerasdist_run_from_salloc_names_a_head_the_nodes_cannot_reach(slurm_cluster, tmp_path):
    # Without --network-interface the proxies would connect to this machine's name, which the
    # emulated hosts do not resolve: hydra alone waited without end and said nothing.
    line = _salloc_line(slurm_cluster).replace(f"--network-interface {slurm_cluster.interface} ", "")
    directory = job_directory(tmp_path, WHERE_AM_I)
    job = slurm_cluster.run(["sh", "-c", line], directory, timeout=60)
    assert job.returncode != 0 and not job.timed_out, job.describe()
    assert "connect back to" in job.output and "Give --network-interface" in job.output, job.describe()
    assert "WHERE" not in job.output, job.describe()
    assert job.ended - job.started < 30, job.describe()


INIT_AND_SAY_SIZE = "import kerasdist; kerasdist.init(); print('WORLD', kerasdist.size(), flush=True)"


def test_srun_without_the_mpi_plugin_is_refused_on_every_task_instead_of_training_alone(slurm_cluster, tmp_path):
    # Without --mpi=pmi2 MPICH finds no process manager: each task would be rank 0 of a world of 1.
    job = slurm_cluster.run(["srun", "--mpi=none", "-N2", "-n2", sys.executable, "-c", INIT_AND_SAY_SIZE], tmp_path)
    assert job.returncode != 0 and "WORLD" not in job.output, job.describe()
    for rank in (0, 1):
        assert f"started by srun as rank {rank} of 2 (SLURM_STEP_NUM_TASKS=2)" in job.output, job.describe()
    assert "--mpi=pmi2" in job.output, job.describe()


def test_one_process_in_a_batch_script_of_several_tasks_runs_as_one_rank(slurm_cluster, tmp_path):
    # The batch script itself is not one of the job's tasks: a plain `python` there is a world of 1.
    (tmp_path / "job.sh").write_text(f'#!/bin/bash\n#SBATCH -N2 -n2\n{sys.executable} -c "{INIT_AND_SAY_SIZE}"\n')
    job = slurm_cluster.sbatch("job.sh", tmp_path)
    assert job.returncode == 0 and "WORLD 1" in job.output, job.describe()
