"""`benchmarks/batch_growth.py --quick` runs end to end, reports every configuration, and every
configuration learns (not the science)."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "batch_growth.py")
CONFIGS = ("fixed_small", "noise_scale", "curvature", "fixed_large")
WORLD_SIZE = int(os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE") or 1)

pytestmark = pytest.mark.skipif(WORLD_SIZE > 1, reason="the benchmark runs as one process; run this test at size 1")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("batch_growth")
    # The child must not think it is one rank of this (single) MPI job.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_", "HYDRA_"))}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    # timeout: a hang bound (below the per-test limit), not a speed limit
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--out_dir", str(out_dir)],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out_dir / "batch_growth.json") as f:
        return proc.stdout, json.load(f), out_dir


def epochs_of(report, config):
    return [row for run in report["results"][config]["runs"] for row in run["epochs"]]


def test_quick_run_reports_every_configuration(quick_run):
    _, report, _ = quick_run
    assert set(report["results"]) == set(CONFIGS)
    epochs = report["config"]["epochs"]
    for config in CONFIGS:
        for run in report["results"][config]["runs"]:
            assert [row["epoch"] for row in run["epochs"]] == list(range(1, epochs + 1)), config


def test_quick_run_accuracies_are_fractions(quick_run):
    _, report, _ = quick_run
    for config in CONFIGS:
        summary = report["results"][config]["summary"]
        values = [summary["test_acc_median"], summary["test_acc_min"], summary["test_acc_max"]]
        values += [row[key] for row in epochs_of(report, config) for key in ("test_acc", "val_acc")]
        assert all(0.0 <= v <= 1.0 for v in values), (config, values)


def test_quick_run_every_configuration_learns_beyond_chance(quick_run):
    # 10 classes of 7-13 % each: a model that learned nothing scores at most ~0.13. The quick
    # run reached 0.47-0.49 here.
    _, report, _ = quick_run
    for config in CONFIGS:
        assert report["results"][config]["summary"]["test_acc_median"] >= 0.35, config
        for run in report["results"][config]["runs"]:
            accuracies = [row["test_acc"] for row in run["epochs"]]
            assert accuracies[-1] > accuracies[0], (config, accuracies)


def test_quick_run_counts_steps_as_micro_batches_over_the_batch(quick_run):
    _, report, _ = quick_run
    config = report["config"]
    micro_batches_per_epoch = config["epoch_rows"] // config["micro_batch"]
    for name in CONFIGS:
        for run in report["results"][name]["runs"]:
            steps = 0
            for row in run["epochs"]:
                passes = row["batch_size"] // config["micro_batch"]
                steps += micro_batches_per_epoch // passes
                assert row["steps"] == steps, (name, row)
                assert row["seconds"] > 0


def test_quick_run_keeps_fixed_batches_and_grows_within_the_cap(quick_run):
    _, report, _ = quick_run
    config = report["config"]
    start = config["micro_batch"] * config["start_passes"]
    assert {row["batch_size"] for row in epochs_of(report, "fixed_small")} == {start}
    assert {row["batch_size"] for row in epochs_of(report, "fixed_large")} == {config["large_batch"]}
    for name in ("noise_scale", "curvature"):
        for run in report["results"][name]["runs"]:
            batches = [row["batch_size"] for row in run["epochs"]]
            assert batches[0] == start and batches == sorted(batches) and batches[-1] <= config["max_batch"]
            assert batches[-1] > start, "--quick forces growth after one check"
            rates = [row["learning_rate"] for row in run["epochs"]]
            # linear scaling: rate / batch stays at the base rate / start batch
            assert all(math.isclose(r / b, rates[0] / start, rel_tol=1e-5) for r, b in zip(rates, batches))


def test_quick_run_records_the_signals(quick_run):
    _, report, _ = quick_run
    for config in CONFIGS:
        assert all(row["noise_scale"] is not None and row["noise_scale"] > 0 for row in epochs_of(report, config))
    assert all(
        row["hessian_top_eigenvalue"] is not None and math.isfinite(row["hessian_top_eigenvalue"])
        for row in epochs_of(report, "curvature")
    )
    for config in ("noise_scale", "curvature"):
        for run in report["results"][config]["runs"]:
            assert len(run["decisions"]) == report["config"]["epochs"]


def test_quick_run_prints_a_table_row_per_configuration(quick_run):
    stdout, report, _ = quick_run
    table = stdout[stdout.index("| configuration | final batch |") :]
    rows = report["tables"]["results"]["rows"]  # named as the page names them (batch, rate, safeguard)
    assert len(rows) == len(report["results"]), rows
    for row in rows:
        assert f"| {row[0]} |" in table


def test_quick_run_saves_the_plot_when_matplotlib_is_installed(quick_run):
    pytest.importorskip("matplotlib")
    _, _, out_dir = quick_run
    assert (out_dir / "batch_growth.png").stat().st_size > 0


def test_the_digits_task_is_all_of_scikit_learns_digits_in_three_disjoint_splits():
    from sklearn.datasets import load_digits

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import batch_growth

    args = batch_growth.parse_args(["--task", "digits"])
    data = batch_growth.load_task(args, "digits")
    assert [len(data[s][0]) for s in ("train", "val", "test")] == [1077, 360, 360]
    assert args.epoch_rows == args.pool == 1077
    digits = load_digits()
    pooled = np.concatenate([data[s][0] for s in ("train", "val", "test")])
    labels = np.concatenate([data[s][1] for s in ("train", "val", "test")])

    def as_rows(x, y):  # images with their labels, as a sorted multiset
        return sorted(map(tuple, np.column_stack([x, y]).tolist()))

    # every image once, scaled to [0, 1]
    assert as_rows(pooled * 16.0, labels) == as_rows(digits.data, digits.target)
    assert pooled.min() == 0.0 and pooled.max() == 1.0
    assert set(np.unique(data["test"][1])) == set(range(10))
