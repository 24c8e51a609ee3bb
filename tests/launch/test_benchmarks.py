"""`make bench`'s allreduce benchmark runs end to end at 2 ranks on tiny sizes and reports
every case, fused against unfused included (not the speed: that is `make bench`'s job)."""

import json
import sys

from launch_utils import LAUNCH_TEST_MARKS, MPIEXEC, REPO_ROOT, child_env, run_job

pytestmark = LAUNCH_TEST_MARKS
SCRIPT = REPO_ROOT / "benchmarks" / "allreduce.py"
QUICK = ["--repeats=1", "--target_ms=5", "--min_iters=2", "--max_iters=8",
         "--many_tensors=6", "--many_tensor_kib=4"]


def bench(tmp_path, *flags):
    argv = [MPIEXEC, "-n", "2", sys.executable, SCRIPT, *QUICK, *flags]
    job = run_job(argv, tmp_path, child_env(), timeout=240, script_name="allreduce.py")
    assert job.returncode == 0 and not job.timed_out, job.describe()
    return job


def test_allreduce_benchmark_reports_sizes_and_fused_against_unfused(tmp_path):
    fused_json = tmp_path / "fused.json"
    bench(tmp_path, "--sizes_kib", "4", "64", "--json", fused_json)
    results = json.loads(fused_json.read_text())
    assert results["ranks"] == 2
    assert [row["size_bytes"] for row in results["sizes"]] == [4096, 65536]
    assert all(row["ratio"] > 0 and row["ours_s"] > 0 for row in results["sizes"])
    assert len(results["many"]["step_seconds"]) == 4
    assert results["resnet50"]["tensors"] == 214 and len(results["resnet50"]["step_seconds"]) == 3

    unfused = bench(tmp_path, "--only", "many", "--fusion_threshold=0", "--compare_to", fused_json)
    assert "many: fused" in unfused.output, unfused.describe()
    assert "kerasdist: kd.grouped_allreduce" in unfused.output.split("many: fused")[1]
