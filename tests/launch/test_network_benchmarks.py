"""The rank sides of `make bench-net` run end to end at 2 ranks on one host, on tiny sizes, and
report every case (the speed over emulated links is `make bench-net`'s job)."""

import json
import sys

import pytest
from launch_utils import LAUNCH_TEST_MARKS, MPIEXEC, REPO_ROOT, child_env, run_job

pytestmark = LAUNCH_TEST_MARKS
BENCHMARKS = REPO_ROOT / "benchmarks"


def run_benchmark(tmp_path, script, *flags, **env):
    argv = [MPIEXEC, "-n", "2", sys.executable, BENCHMARKS / script, *flags]
    job = run_job(argv, tmp_path, child_env(**env), timeout=240, script_name=script)
    assert job.returncode == 0 and not job.timed_out, job.describe()
    return job


def test_network_allreduce_reports_both_ops_fusion_and_every_compression(tmp_path):
    results_path = tmp_path / "network_allreduce.json"
    run_benchmark(
        tmp_path,
        "network_allreduce.py",
        "--sizes_kib",
        "4",
        "64",
        "--compression_sizes_kib",
        "64",
        "--many_tensors",
        "4",
        "--many_tensor_kib",
        "4",
        "--repeats",
        "1",
        "--target_ms",
        "5",
        "--json",
        results_path,
    )
    results = json.loads(results_path.read_text())
    assert results["ranks"] == 2
    assert [(row["op"], row["bytes"]) for row in results["sizes"]] == [
        ("Sum", 4096),
        ("Sum", 65536),
        ("Average", 4096),
        ("Average", 65536),
    ]
    assert all(row["raw_s"] > 0 and row["ours_s"] > 0 for row in results["sizes"])
    # Where each op's time went, as the engine thread measured it around that case's runs: 4 KiB
    # rides with the negotiation (KERASDIST_PIGGYBACK_BYTES), so its data moves there.
    for row in results["sizes"]:
        phases = row["phases_s"]
        assert phases["negotiation"] > 0 and phases["cycles"] > 0, row
        assert (phases["rode"] > 0) == (row["bytes"] == 4096) and (phases["transfer"] > 0 or phases["rode"] > 0), row
    assert set(results["many"]["seconds"]) == {"raw per tensor", "raw flat", "grouped"}
    times = ["bf16", "bytes", "fp16", "none", "raw", "raw16"]
    ratios = [f"{name}_over_none{suffix}" for name in ("bf16", "fp16") for suffix in ("", "_range")]
    assert [sorted(row) for row in results["compression"]] == [sorted(times + ratios)]
    for row in results["compression"]:
        for name in ("fp16", "bf16"):  # the 16-bit time over float32's, and the per-repeat range around it
            assert row[f"{name}_over_none"] == pytest.approx(row[name] / row["none"])
            low, high = row[f"{name}_over_none_range"]
            assert 0 < low <= high, row


def test_fusion_tuning_decides_in_an_mpi_job_and_logs_what_it_kept_as_the_benchmark_reads_it(tmp_path):
    # 48 x 64 KiB (3 MiB) per step fuses more than 1 MiB, so every step counts for the tuner: the
    # warm-up and the timed runs make more than the 16 it needs.
    job = run_benchmark(
        tmp_path,
        "network_allreduce.py",
        "--only",
        "many",
        "--many_tensors",
        "48",
        "--many_tensor_kib",
        "64",
        "--repeats",
        "1",
        "--target_ms",
        "5",
        KERASDIST_LOG_LEVEL="info",
    )
    sys.path.insert(0, str(BENCHMARKS))
    from fusion_tuning import KEPT  # how benchmarks/fusion_tuning.py reads the choice

    kept = KEPT.findall(job.output)
    assert len(kept) == 1 and int(kept[0]) in (2**20, 16 * 2**20), job.describe()
    assert (
        "[kerasdist rank 0] INFO: tuning: fused allreduces timed over 8 cycles each: calls of up to 16777216 bytes"
        in (job.output)
    ), job.describe()


def test_negotiation_benchmark_reports_fast_and_slow_path_cycles(tmp_path):
    reports = []
    for capacity in ("1024", "1"):
        job = run_benchmark(
            tmp_path, "negotiation.py", "--iterations", "5", "--repeats", "2", KERASDIST_CACHE_CAPACITY=capacity
        )
        lines = job.lines_with("NEGOTIATION ")
        assert len(lines) == 1, job.describe()  # rank 0 only
        reports.append(json.loads(lines[0]))
    assert [(r["ranks"], r["cache_capacity"]) for r in reports] == [(2, 1024), (2, 1)]
    assert all(len(r["ours_samples"]) == 2 and r["ours_s"] > 0 and r["raw_s"] > 0 for r in reports)
