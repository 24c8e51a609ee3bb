"""The hierarchical allreduce (KERASDIST_ALLREDUCE_ALGORITHM=hierarchical) on emulated hosts of two
ranks each: results right and the same bits on every rank, the engine saying it runs the
hierarchy, and on three hosts the bytes on the links those of the hierarchy. There each host's two
ranks reduce among themselves first and each carries half the buffer across the hosts as a ring:
2 x 2/3 x S sent and received per host for S bytes. The job with KERASDIST_ALLREDUCE_ALGORITHM=mpi
shows that the bytes tell it apart from MPI's own choice. (MPICH's ring over all 6 ranks moves the
hierarchy's bytes too, measured here: across hosts MPICH reduces each host to one rank first.)"""

import pytest
from multihost_utils import DEFAULT_JOB_TIMEOUT_S, reports

RANKS_PER_HOST = 2
CALL_BYTES, CALLS = 16 << 20, 3  # what scripts/allreduce_algorithm.py reduces
SLACK = 1.1  # beyond the algorithm's bytes: the launch, the negotiation, TCP's headers (~3 %)


def run(cluster, cwd, hosts, algorithm):
    """The busiest link's bytes of one job of scripts/allreduce_algorithm.py, and its output."""
    before = cluster.link_bytes()
    job = cluster.run_script(
        "allreduce_algorithm.py",
        num_processes=hosts * RANKS_PER_HOST,
        cwd=cwd,
        hosts=cluster.hosts_option(RANKS_PER_HOST, hosts),
        env={"KERASDIST_ALLREDUCE_ALGORITHM": algorithm, "KERASDIST_LOG_LEVEL": "info"},
    )
    after = cluster.link_bytes()
    found = reports(job, "ALGORITHM", hosts * RANKS_PER_HOST)
    assert all(r["digests"] == found[0]["digests"] for r in found), f"ranks hold different bits: {found}"
    assert all(r["worst_error_of_bound"] <= 1.0 for r in found), found
    return max(b - a for a, b in zip(before, after)), job.output


@pytest.mark.timeout(3 * DEFAULT_JOB_TIMEOUT_S + 60, method="thread")  # the jobs' own timeouts fire first
def test_hierarchy_reduces_right_with_the_same_bits_on_every_rank_and_its_bytes_on_the_links(clusters, tmp_path):
    cluster = clusters.get(hosts=3, slots=RANKS_PER_HOST)

    _, output = run(cluster, tmp_path, 2, "hierarchical")
    assert "allreduce algorithm hierarchical on 2 hosts x 2 ranks: the hierarchy for every allreduce" in output, output

    busiest, output = run(cluster, tmp_path, 3, "hierarchical")
    assert "allreduce algorithm hierarchical on 3 hosts x 2 ranks: the hierarchy for every allreduce" in output, output
    hierarchy_bytes = CALLS * 2 * 2 * 2 / 3 * CALL_BYTES
    assert busiest <= SLACK * hierarchy_bytes, (
        f"the busiest link carried {busiest / 2**20:.0f} MiB, the hierarchy {hierarchy_bytes / 2**20:.0f}"
    )
    flat, _ = run(cluster, tmp_path, 3, "mpi")
    assert flat > SLACK * hierarchy_bytes, (
        f"MPI's own choice put only {flat / 2**20:.0f} MiB on the busiest link, no more than the hierarchy: "
        "the bytes no longer tell the two apart"
    )
