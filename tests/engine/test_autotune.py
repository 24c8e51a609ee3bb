"""The tuner under a real MPI: 3 ranks on 3 hosts that MPICH emulates on this one
(MPIR_CVAR_NUM_CLIQUES), where auto may run MPICH's ring or its own choice. Rank 0 times both and
keeps one; every rank's sums are right and the same bits; the choice is saved to the tuning file,
and a second job of the same layout runs it without timing anything. Which algorithm wins is the
machine's business: the tests assert what was logged, saved and reused, never which won."""

import re

import pytest
from launch_utils import LAUNCH_TEST_MARKS, child_env, mpirun
from test_c_api import BUILD_INFO

from kerasdist.run.launcher import read_build_info

pytestmark = [
    *LAUNCH_TEST_MARKS,
    pytest.mark.skipif(
        read_build_info(BUILD_INFO)["mpi_flavour"] != "mpich", reason="emulates hosts with MPICH's cliques"
    ),
]
TIMED = re.compile(
    r"tuning: allreduce algorithms timed over 8 cycles each: auto [\d.]+ GB/s \(1\.00 of the time\), "
    r"mpi [\d.]+ GB/s \([\d.]+ of the time\); keeping (auto|mpi)"
)


def run(tmp_path, **knobs):
    env = child_env(MPIR_CVAR_NUM_CLIQUES=3, KERASDIST_LOG_LEVEL="info", **knobs)
    job = mpirun("tuned_allreduces.py", n=3, cwd=tmp_path, env=env)
    assert job.returncode == 0, job.describe()
    results = re.findall(r"^RANK (\d) WORST (\S+) SUMS (\w+)$", job.output, re.MULTILINE)
    assert sorted(rank for rank, _, _ in results) == ["0", "1", "2"], job.describe()
    assert all(float(worst) <= 1e-5 for _, worst, _ in results), job.describe()
    assert len({sums for _, _, sums in results}) == 1, f"ranks hold different sums: {job.describe()}"
    return job


def test_rank_0_times_each_algorithm_and_a_later_job_reuses_the_saved_choice(tmp_path):
    tuning_file = tmp_path / "tuning.tsv"
    first = run(tmp_path, KERASDIST_AUTOTUNE_FILE=tuning_file)
    kept = TIMED.search(first.output)
    assert kept, first.describe()
    lines = [line for line in tuning_file.read_text().splitlines() if not line.startswith("#")]
    assert lines == [f"3 hosts x 1 rank\t{kept.group(1)}\t{16 * 2**20}"], tuning_file.read_text()

    second = run(tmp_path, KERASDIST_AUTOTUNE_FILE=tuning_file)
    assert f"tuning: allreduce algorithm {kept.group(1)}, fused calls of up to 16777216 bytes, read from" in (
        second.output
    ), second.describe()
    assert "timed over" not in second.output, second.describe()


def test_a_saved_line_naming_no_choice_of_this_job_is_named_and_tuned_again(tmp_path):
    tuning_file = tmp_path / "tuning.tsv"
    tuning_file.write_text("2 hosts x 4 ranks\thierarchical\t1048576\n3 hosts x 1 rank\tbinomial\t16777216\n")
    job = run(tmp_path, KERASDIST_AUTOTUNE_FILE=tuning_file)
    assert "holds a line for this layout that names no choice it has (binomial, 16777216); tuning again" in (
        job.output
    ), job.describe()
    kept = TIMED.search(job.output)
    assert kept, job.describe()
    # The other layout's line stays; this layout's is replaced.
    lines = [line for line in tuning_file.read_text().splitlines() if not line.startswith("#")]
    assert lines == ["2 hosts x 4 ranks\thierarchical\t1048576", f"3 hosts x 1 rank\t{kept.group(1)}\t16777216"]


def test_autotune_off_times_nothing(tmp_path):
    job = run(tmp_path, KERASDIST_AUTOTUNE="off")
    assert "tuning:" not in job.output, job.describe()
