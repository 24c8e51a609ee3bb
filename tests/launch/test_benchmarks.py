"""`make bench`'s benchmarks run end to end at 2 ranks on tiny sizes and report every case:
the allreduce one with fused against unfused, the op floor one, the overlap one, the Keras one
in both its modes (not the speed: that is `make bench`'s job)."""

import json
import sys

from launch_utils import LAUNCH_TEST_MARKS, MPIEXEC, REPO_ROOT, child_env, run_job

pytestmark = LAUNCH_TEST_MARKS
SCRIPT = REPO_ROOT / "benchmarks" / "allreduce.py"
QUICK = ["--repeats=1", "--target_ms=5", "--min_iters=2", "--max_iters=8", "--many_tensors=6", "--many_tensor_kib=4"]


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


def test_op_floor_benchmark_compiles_its_kernels_and_reports_every_case(tmp_path):
    result_json = tmp_path / "op_floor.json"
    argv = [MPIEXEC, "-n", "2", sys.executable, REPO_ROOT / "benchmarks" / "op_floor.py"]
    argv += ["--sizes_kib", "4", "--repeats=1", "--target_ms=5", "--max_iters=8", "--json", result_json]
    job = run_job(argv, tmp_path, child_env(), timeout=240, script_name="op_floor.py")
    assert job.returncode == 0 and not job.timed_out, job.describe()
    results = json.loads(result_json.read_text())
    assert results["ranks"] == 2 and results["agreement"]["op_s"] > 0
    (row,) = results["sizes"]
    assert row["size_bytes"] == 4096
    assert set(row["cases"]) == {"raw", "TensorFlow, sync", "TensorFlow, async", "kerasdist"}
    assert all(case["op_s"] > 0 for case in row["cases"].values())
    assert row["floor_s"] == row["cases"]["TensorFlow, async"]["op_s"] + results["agreement"]["op_s"]


def test_overlap_benchmark_reports_the_buckets_spread_over_a_step(tmp_path):
    result_json = tmp_path / "overlap.json"
    argv = [MPIEXEC, "-n", "2", sys.executable, REPO_ROOT / "benchmarks" / "overlap.py", "--steps=6"]
    job = run_job([*argv, "--json", result_json], tmp_path, child_env(), timeout=240, script_name="overlap.py")
    assert job.returncode == 0 and not job.timed_out, job.describe()
    results = json.loads(result_json.read_text())
    assert (results["ranks"], results["steps"]) == (2, 4)
    assert results["spread_share"] == results["spread_ms"] / results["period_ms"] > 0


KERAS_SCRIPT = REPO_ROOT / "benchmarks" / "keras_scaling.py"
KERAS_QUICK = ["--model=mlp", "--rounds=1", "--num_iters=1", "--num_batches_per_iter=2", "--num_warmup_batches=1"]


def keras_bench(tmp_path, *flags):
    argv = [sys.executable, KERAS_SCRIPT, *KERAS_QUICK, "--json", tmp_path / "keras.json", *flags]
    job = run_job(argv, tmp_path, child_env(), timeout=240, script_name="keras_scaling.py")
    assert job.returncode == 0 and not job.timed_out, job.describe()
    return json.loads((tmp_path / "keras.json").read_text())


def test_keras_scaling_benchmark_reports_every_configuration(tmp_path):
    results = keras_bench(tmp_path)
    assert {run["configuration"] for run in results["runs"]} == {"plain", "kerasdist-1", "kerasdist-N", "independent-N"}
    assert all(run["images_per_second"] > 0 for run in results["runs"])
    assert set(results["summary"]["ratios"]["median"]) >= {"size1_overhead", "efficiency_vs_kerasdist_1"}
    split = results["summary"]["cpu_ms_per_step_by_thread"]
    assert all(set(split[name]) == {"python", "tensorflow", "kerasdist", "other"} for name in split), split
    # The engine's threads are named kd_*, so their CPU is told apart; plain Keras has none.
    assert split["kerasdist-N"]["kerasdist"] > 0 and split["plain"]["kerasdist"] == 0, split


def test_keras_thread_pool_comparison_starts_ranks_without_thread_settings(tmp_path):
    results = keras_bench(tmp_path, "--thread_pools")
    runs = {run["configuration"]: run for run in results["runs"]}
    assert set(runs) == {"plain", "kerasdist-N off", "kerasdist-N"}
    for run in runs.values():
        assert all(threads is None for threads in run["results"][0]["threads"].values()), run
    for estimate in ("median", "per round"):
        assert set(results["summary"]["ratios"][estimate]) == {
            "kerasdist-N / kerasdist-N off",
            "kerasdist-N off / plain",
            "kerasdist-N / plain",
        }


def test_replica_check_benchmark_times_the_check_and_the_epochs_it_is_compared_with(tmp_path):
    result_json = tmp_path / "replica_check.json"
    argv = [MPIEXEC, "-n", "2", sys.executable, REPO_ROOT / "benchmarks" / "replica_check.py"]
    argv += ["--models", "mlp", "--checks=3", "--epochs=2", "--batches=2", "--batch_size=8", "--json", result_json]
    job = run_job(argv, tmp_path, child_env(), timeout=240, script_name="replica_check.py")
    assert job.returncode == 0 and not job.timed_out, job.describe()
    (row,) = json.loads(result_json.read_text())["models"]
    assert row["model"] == "mlp" and row["variables_checked"] > 0
    assert len(row["check_samples_ms"]) == 3
    assert {when: len(samples) for when, samples in row["epoch_samples_ms"].items()} == {"off": 2, "epoch": 2}
    assert row["share"] == row["check_ms"] / row["epoch_ms"] > 0
