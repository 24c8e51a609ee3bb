"""Which algorithm MPI's allreduce runs: allreduce_algorithm_test.cc, compiled with the engine's
sources, reads MPICH's MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM inside every MPI_Allreduce the backend
makes (MPI's profiling interface). The value meaning ring comes from MPICH itself: the program run
once with the variable set to ring in its environment prints what MPICH made of it."""

import re

import pytest
from launch_utils import DEFAULT_JOB_TIMEOUT_S, LAUNCH_TEST_MARKS, MPIEXEC, REPO_ROOT, run_job
from test_c_api import BUILD_INFO, compiled_program

from kerasdist.run.launcher import read_build_info

pytestmark = LAUNCH_TEST_MARKS
TEST_PROGRAM = REPO_ROOT / "tests" / "engine" / "allreduce_algorithm_test.cc"


@pytest.fixture(scope="session")
def allreduce_algorithm_test(tmp_path_factory):
    return compiled_program(tmp_path_factory, TEST_PROGRAM)


@pytest.fixture(scope="session")
def ring_value(allreduce_algorithm_test, tmp_path_factory):
    """MPICH's number for ring, as MPICH parsed it from the environment; "none" under another MPI."""
    if read_build_info(BUILD_INFO)["mpi_flavour"] != "mpich":
        return "none"
    job = run_job(
        [
            MPIEXEC,
            "-n",
            1,
            "-genv",
            "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM",
            "ring",
            allreduce_algorithm_test,
            "--print-variable",
        ],
        cwd=tmp_path_factory.mktemp("ring_value"),
        timeout=DEFAULT_JOB_TIMEOUT_S,
        script_name=allreduce_algorithm_test.name,
    )
    printed = re.search(r"^VARIABLE (-?\d+)$", job.output, re.MULTILINE)
    assert job.returncode == 0 and printed, job.describe()
    assert printed.group(1) != "-1", f"MPICH has no MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM here: {job.describe()}"
    return printed.group(1)


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_ring_runs_exactly_the_allreduces_chosen_for_it_and_the_variable_is_restored(
    allreduce_algorithm_test, ring_value, ranks, tmp_path
):
    job = run_job(
        [MPIEXEC, "-n", ranks, allreduce_algorithm_test, ring_value, 1],
        cwd=tmp_path,
        timeout=DEFAULT_JOB_TIMEOUT_S,
        script_name=allreduce_algorithm_test.name,
    )
    assert not job.timed_out and job.returncode == 0, job.describe()
    passed = re.findall(r"^rank \d+: passed, 0 of [1-9]\d* checks failed$", job.output, re.MULTILINE)
    assert len(passed) == ranks, job.describe()


# MPICH's MPIR_CVAR_NUM_CLIQUES splits one host's ranks into that many emulated hosts in blocks
# (6 ranks in 2: ranks 0-2 and 3-5; 3 ranks in 2: ranks 0-1 and 2), which MPI_Comm_split_type
# then reports as hosts.
@pytest.mark.parametrize(
    "ranks, cliques, hosts",
    [(4, 2, 2), (6, 3, 3), (6, 2, 2), (3, 2, 0)],
    ids=["2 hosts x 2", "3 hosts x 2", "2 hosts x 3", "hosts of 2 and 1 ranks"],
)
def test_the_hierarchy_runs_where_every_host_holds_as_many_ranks(
    allreduce_algorithm_test, ring_value, ranks, cliques, hosts, tmp_path
):
    if read_build_info(BUILD_INFO)["mpi_flavour"] != "mpich":
        pytest.skip("emulates hosts with MPICH's MPIR_CVAR_NUM_CLIQUES")
    job = run_job(
        [MPIEXEC, "-n", ranks, "-genv", "MPIR_CVAR_NUM_CLIQUES", cliques, allreduce_algorithm_test, ring_value, hosts],
        cwd=tmp_path,
        timeout=DEFAULT_JOB_TIMEOUT_S,
        script_name=allreduce_algorithm_test.name,
    )
    assert not job.timed_out and job.returncode == 0, job.describe()
    passed = re.findall(r"^rank \d+: passed, 0 of [1-9]\d* checks failed$", job.output, re.MULTILINE)
    assert len(passed) == ranks, job.describe()
