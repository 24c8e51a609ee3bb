"""The collectives suite and model.fit across emulated hosts, over TCP on the emulated links."""

import re
import sys

import pytest
from launch_utils import REPO_ROOT
from multihost_utils import reports

SUITE_TIMEOUT_S = 600
# Assumes a float16 sum over ranks is exact whatever the reduction order; from 4 ranks on it is
# not (fails the same way in one host under `mpiexec -n 4`), so it says nothing about hosts.
SIZE_LIMITED_TESTS = ["tests/collectives/test_compression.py::test_float16_passes_through_bf16_compression"]


# Two ranks per host: each rank has a neighbour over shared memory and two across the link, and
# the suite runs at 4 ranks, a size no other run of it has. (auto would run allreduces of 4 MiB
# and more as the hierarchy here; the suite's are smaller, and test_hierarchical_allreduce_cluster.py
# runs it. One rank per host added 1 minute of CI and no code path of ours: with one rank per host
# on 2 hosts the engine runs as on one.)
# The job's own timeout must fire before pytest's per-test limit (tests/conftest.py), which ends
# the whole session.
@pytest.mark.timeout(SUITE_TIMEOUT_S + 60, method="thread")
def test_collectives_suite_passes_across_two_hosts(two_hosts, tmp_path):
    ranks_per_host = 2
    size = len(two_hosts.hosts) * ranks_per_host
    # Each rank its own pytest temp directory: ranks share one file system here, as hosts often do.
    deselect = " ".join(f"--deselect {test}" for test in SIZE_LIMITED_TESTS if size >= 4)
    command = [
        "sh",
        "-c",
        f"exec {sys.executable} -m pytest -q -p no:cacheprovider --rootdir {REPO_ROOT} "
        f'{deselect} --basetemp="{tmp_path}/rank$PMI_RANK" {REPO_ROOT / "tests" / "collectives"}',
    ]
    job = two_hosts.launch(
        size,
        command,
        tmp_path,
        hosts=two_hosts.hosts_option(ranks_per_host),
        env={"TF_NUM_INTRAOP_THREADS": "1"},
        timeout=SUITE_TIMEOUT_S,
    )
    assert job.returncode == 0 and not job.timed_out, job.describe()
    passed = re.search(r"(\d+) passed", job.output)
    assert passed and int(passed.group(1)) > 100, job.describe()  # the suite ran, not an empty selection


def test_fit_across_hosts_equals_one_process_at_the_global_batch(two_hosts, tmp_path):
    ranks_per_host = 2  # both kinds of neighbour: one on the same host, two across the link
    size = len(two_hosts.hosts) * ranks_per_host
    job = two_hosts.run_script(
        "fit_equivalence.py",
        num_processes=size,
        cwd=tmp_path,
        hosts=two_hosts.hosts_option(ranks_per_host),
        env={"TF_NUM_INTRAOP_THREADS": "1"},
    )
    found = reports(job, "FIT", size)
    assert len({r["weights_digest"] for r in found}) == 1, found  # every rank ends with the same weights
    rank0 = found[0]
    assert rank0["size"] == size
    assert rank0["largest_update"] > 1e-2, rank0  # training moved the weights
    assert rank0["max_weight_difference"] < 1e-5, rank0
    assert rank0["loss"] == pytest.approx(rank0["reference_loss"], rel=1e-5)
