"""The engine's routing of GPU collectives, without a GPU: device_hooks_test.cc registers a
stand-in device (MPI over host memory) through DeviceHooks and checks, at 2 and 3 ranks, that the
device is negotiated, GPU requests reach the executor and CPU ones do not, and refusals fail
every rank. The NCCL executor itself needs a GPU: benchmarks/gpu_check.py is its check."""

import re

import pytest
from launch_utils import DEFAULT_JOB_TIMEOUT_S, LAUNCH_TEST_MARKS, MPIEXEC, REPO_ROOT, run_job
from test_c_api import compiled_program

pytestmark = LAUNCH_TEST_MARKS
TEST_PROGRAM = REPO_ROOT / "tests" / "engine" / "device_hooks_test.cc"


@pytest.fixture(scope="session")
def device_hooks_test(tmp_path_factory):
    return compiled_program(tmp_path_factory, TEST_PROGRAM)


@pytest.mark.parametrize("ranks", [2, 3])
def test_gpu_collectives_are_negotiated_with_their_device_and_run_by_the_executor(device_hooks_test, ranks, tmp_path):
    job = run_job(
        [MPIEXEC, "-n", ranks, device_hooks_test],
        cwd=tmp_path,
        timeout=DEFAULT_JOB_TIMEOUT_S,
        script_name=device_hooks_test.name,
    )
    assert not job.timed_out and job.returncode == 0, job.describe()
    passed = re.findall(r"^rank \d+: passed, 0 of [1-9]\d* checks failed$", job.output, re.MULTILINE)
    assert len(passed) == ranks, job.describe()
