"""The rank side of benchmarks/slow_links_cluster.py across two emulated hosts, one rank each:
one job trains every configuration for two short epochs (--quick), and each must record every
epoch, make the updates and averages its method makes, and send what its method sends. (It keeps
the script working; the measurement itself is `make bench-net`.)"""

import json
import math
import sys

from launch_utils import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "slow_links_cluster.py"
CONFIGS = ("synchronous", "fp16", "delayed", "one_bit", "average_4", "average_16")
JOB_TIMEOUT_S = 150
# --quick: 2 epochs of 4,096 rows, 64 rows per rank per step, 2 ranks; the student is 32 inputs ->
# 3 x [Dense(64, no bias) -> BatchNorm] -> Dense(10).
EPOCHS, STEPS_PER_EPOCH, INPUTS, WIDTH, DEPTH, CLASSES = 2, 4096 // (64 * 2), 32, 64, 3, 10


def student_tensors():
    """Sizes of the student's trainable tensors, and its non-trainable (BatchNorm moving) floats."""
    kernels = [INPUTS * WIDTH] + [WIDTH * WIDTH] * (DEPTH - 1) + [WIDTH * CLASSES]
    trainable = kernels + [CLASSES] + [WIDTH] * (2 * DEPTH)  # last bias; BatchNorm gamma and beta
    return trainable, 2 * WIDTH * DEPTH


def payload_per_epoch(config, averages_per_epoch):
    """Bytes one rank must send per epoch for its method, at 2 ranks: an allreduce of n values
    sends n of them (half in the reduce-scatter, half in the allgather); the 1-bit allgather
    sends this rank's signs, 8 to a byte per tensor, and a float32 scale per tensor; an average
    reduces the weights, BatchNorm's moving statistics and the momenta (SGD's rate rides along)."""
    trainable, moving = student_tensors()
    n = sum(trainable)
    if config in ("synchronous", "delayed"):  # the delayed allreduce runs at every step
        return STEPS_PER_EPOCH * 4 * n
    if config == "fp16":
        return STEPS_PER_EPOCH * 2 * n
    if config == "one_bit":
        return STEPS_PER_EPOCH * sum(math.ceil(size / 8) + 4 for size in trainable)
    return averages_per_epoch * 4 * (2 * n + moving + 1)


def test_quick_runs_record_every_epoch_and_make_their_updates_averages_and_bytes(two_hosts, tmp_path):
    out = tmp_path / "runs.json"
    command = [sys.executable, SCRIPT, "--rank_side", "--quick", "--config", *CONFIGS, "--seed", "0", "--out", out]
    job = two_hosts.launch(2, command, tmp_path, hosts=two_hosts.hosts_option(1), timeout=JOB_TIMEOUT_S)
    assert job.returncode == 0 and not job.timed_out, job.describe()
    runs = {run["config"]: run for run in json.loads(out.read_text())}
    assert list(runs) == list(CONFIGS)
    final = {config: run["epochs"][-1]["test_acc"] for config, run in runs.items()}
    for config, run in runs.items():
        rows = run["epochs"]
        assert run["ranks"] == 2 and not run["diverged"], run
        assert run["parameters"] == sum(student_tensors()[0]), run
        assert [r["epoch"] for r in rows] == list(range(1, EPOCHS + 1)), config
        assert all(0 < r["test_acc"] <= 1 and r["off_clock_seconds"] > 0 for r in rows), rows
        seconds = [r["seconds"] for r in rows]
        assert 0 < seconds[0] < seconds[1], (config, seconds)
        # Every method learns: none ends far below synchronous training (a method that applied
        # nothing would stay where the first epoch left it, or at chance).
        assert final[config] >= 0.8 * final["synchronous"], final

        # One optimizer update per step, local SGD included; delayed gradients apply nothing at
        # the run's first step.
        updates = [r["steps"] for r in rows]
        per_epoch = [b - a for a, b in zip([0, *updates], updates)]
        expected = [STEPS_PER_EPOCH] * EPOCHS
        if config == "delayed":
            expected[0] -= 1
        assert per_epoch == expected, (config, per_epoch)

        # Averages: one per window, and one at each epoch's last step.
        window = run["averaging_window"]
        averages_per_epoch = math.ceil(STEPS_PER_EPOCH / window) if window else None
        if window:
            assert config == f"average_{window}"
            assert [r["averages"] for r in rows] == [averages_per_epoch * (e + 1) for e in range(EPOCHS)], rows
        else:
            assert all(r["averages"] is None for r in rows), rows

        # What rank 0's host sent: at least its method's payload, and not much more (TCP/IP
        # headers, negotiation, the metric averaging at each epoch's end). The 1-bit payload is
        # 1.5 KB a step here, so a few hundred bytes of headers and negotiation weigh more.
        payload = EPOCHS * payload_per_epoch(config, averages_per_epoch)
        slack = 1.6 if config == "one_bit" else 1.1
        assert payload <= rows[-1]["sent_bytes"] <= slack * payload, (config, rows[-1]["sent_bytes"], payload)
