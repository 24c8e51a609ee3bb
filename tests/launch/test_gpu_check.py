"""benchmarks/gpu_check.py runs end to end at 2 ranks here with --device=CPU (there is no GPU):
this tests the script that GPU users run first, not NCCL."""

import sys

from launch_utils import LAUNCH_TEST_MARKS, MPIEXEC, REPO_ROOT, child_env, run_job

pytestmark = LAUNCH_TEST_MARKS
SCRIPT = REPO_ROOT / "benchmarks" / "gpu_check.py"


def test_gpu_check_passes_every_check_and_reports_bandwidth_on_cpus(tmp_path):
    argv = [MPIEXEC, "-n", "2", sys.executable, SCRIPT, "--device=CPU", "--sizes_kib", "4", "64", "--target_ms=5"]
    job = run_job(argv, tmp_path, child_env(), timeout=300, script_name="gpu_check.py")
    assert job.returncode == 0 and not job.timed_out, job.describe()
    assert "FAIL" not in job.output and "all checks passed" in job.output, job.describe()
    for check in ("allreduce Product bfloat16", "grouped_allreduce", "alltoall int32", "broadcast float32 from rank 1"):
        assert f"ok   {check}" in job.output, job.describe()
    assert "     4 KiB" in job.output and "    64 KiB" in job.output, job.describe()


def test_gpu_check_refuses_to_pass_without_a_gpu(tmp_path):
    job = run_job([sys.executable, SCRIPT], tmp_path, child_env(), timeout=120, script_name="gpu_check.py")
    assert job.returncode == 2, job.describe()
    assert "no GPU" in job.output, job.describe()
