"""The rank side of benchmarks/batch_growth_cluster.py across two emulated hosts, one rank each:
a quick growth run records every epoch, grows, and makes one update per global batch. (It keeps
the script working; the measurement itself is `make bench-net`.)"""

import json
import sys

from launch_utils import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "batch_growth_cluster.py"
JOB_TIMEOUT_S = 150
QUICK_EPOCH_ROWS = 8192  # --quick: 3 epochs of 8,192 rows, 64 rows per rank per micro-batch, cap 512


def test_quick_growth_run_records_every_epoch_and_one_update_per_global_batch(two_hosts, tmp_path):
    out = tmp_path / "run.json"
    command = [sys.executable, SCRIPT, "--rank_side", "--quick", "--config", "noise_scale", "--seed", "0", "--out", out]
    job = two_hosts.launch(
        2,
        command,
        tmp_path,
        hosts=two_hosts.hosts_option(1),
        env={"TF_NUM_INTRAOP_THREADS": "1"},
        timeout=JOB_TIMEOUT_S,
    )
    assert job.returncode == 0 and not job.timed_out, job.describe()
    run = json.loads(out.read_text())
    rows = run["epochs"]
    assert run["ranks"] == 2 and not run["diverged"], run
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    # --quick grows after every check without growth: 64 x 2 ranks, then k = 2, then 4 (the cap).
    assert [r["batch_size"] for r in rows] == [128, 256, 512]
    assert [d["grew"] for d in run["decisions"]] == [True, True, False]
    updates = [r["steps"] for r in rows]
    assert [b - a for a, b in zip([0, *updates], updates)] == [QUICK_EPOCH_ROWS // r["batch_size"] for r in rows]
    seconds = [r["seconds"] for r in rows]
    assert 0 < seconds[0] < seconds[1] < seconds[2], seconds
    assert all(r["off_clock_seconds"] > 0 and 0 < r["test_acc"] <= 1 for r in rows), rows
