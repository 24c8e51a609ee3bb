"""The hierarchical allgather on emulated hosts whose ranks MPI places out of host order.

`-H h0:1,h1:2` with 4 processes puts ranks 0 and 3 on h0 and ranks 1 and 2 on h1 (hydra fills the
slots in order, then starts again from the first host), so the ranks of local rank 1 meet the
hosts in the opposite order to those of local rank 0. MPICH's emulated hosts of `make test`
(MPIR_CVAR_NUM_CLIQUES) deal ranks out round-robin, where the two orders agree, so only a job like
this one shows that the hierarchy's pieces go back to their ranks whatever order each
communicator across hosts holds the hosts in: tests/collectives/test_allgather_algorithm.py runs
there as the hierarchy, every allgather compared bit for bit with NumPy and counted as the
hierarchy by engine_times()."""

import re
import sys

import pytest
from launch_utils import REPO_ROOT
from multihost_utils import reports

SUITE_TIMEOUT_S = 300
HIERARCHICAL = {"KERASDIST_ALLREDUCE_ALGORITHM": "hierarchical", "TF_NUM_INTRAOP_THREADS": "1"}
PLACEMENT_PROBE = (
    "import json, socket, kerasdist as kd; kd.init(); "
    "print('PLACEMENT', json.dumps({'rank': kd.rank(), 'host': socket.gethostname()}), flush=True)"
)


@pytest.mark.timeout(2 * SUITE_TIMEOUT_S + 60, method="thread")  # the jobs' own timeouts fire first
def test_allgather_hierarchy_keeps_rank_order_when_ranks_interleave_hosts(two_hosts, tmp_path):
    first, second = two_hosts.hosts
    interleaved = f"{first}:1,{second}:2"
    probe = two_hosts.launch(4, [sys.executable, "-c", PLACEMENT_PROBE], tmp_path, hosts=interleaved, env=HIERARCHICAL)
    placed = [report["host"] for report in reports(probe, "PLACEMENT", 4)]
    assert placed == [first, second, second, first], f"hydra placed the ranks otherwise: {placed}"

    suite = REPO_ROOT / "tests" / "collectives" / "test_allgather_algorithm.py"
    command = [
        "sh",
        "-c",
        f"exec {sys.executable} -m pytest -q -p no:cacheprovider --rootdir {REPO_ROOT} "
        f'--basetemp="{tmp_path}/rank$PMI_RANK" {suite}',
    ]
    job = two_hosts.launch(4, command, tmp_path, hosts=interleaved, env=HIERARCHICAL, timeout=SUITE_TIMEOUT_S)
    assert job.returncode == 0 and not job.timed_out, job.describe()
    passed = re.search(r"(\d+) passed", job.output)
    assert passed and int(passed.group(1)) > 100, job.describe()  # the file ran, not an empty selection
