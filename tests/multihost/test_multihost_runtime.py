"""kerasdist.init() across emulated hosts: rank, local and cross ranks, and thread pools sized
per host. Expected values come from the layout the test asks for, not from kerasdist."""

import pytest
from multihost_utils import reports

# Thread-pool variables a test run may have set; init() must be free to size the pools here.
THREAD_VARIABLES = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "KERASDIST_TF_THREADS")


@pytest.fixture(scope="module", params=[1, 2], ids=lambda n: f"{n}_per_host")
def layout(request, two_hosts, tmp_path_factory):
    """(ranks per host, each rank's TOPOLOGY report) of one job of tests/multihost/scripts/topology.py."""
    ranks_per_host = request.param
    size = len(two_hosts.hosts) * ranks_per_host
    job = two_hosts.run_script(
        "topology.py",
        num_processes=size,
        cwd=tmp_path_factory.mktemp("topology"),
        hosts=two_hosts.hosts_option(ranks_per_host),
        unset=THREAD_VARIABLES,
    )
    return ranks_per_host, reports(job, "TOPOLOGY", size)


def test_each_rank_knows_its_host_and_its_place_on_it(two_hosts, layout):
    ranks_per_host, found = layout
    hosts = len(two_hosts.hosts)
    size = hosts * ranks_per_host
    for rank, report in enumerate(found):
        host_index = rank // ranks_per_host  # hydra fills a host's slots before the next host's
        assert report["host"] == two_hosts.hosts[host_index], report
        assert (report["rank"], report["size"]) == (rank, size)
        assert (report["local_rank"], report["local_size"]) == (rank % ranks_per_host, ranks_per_host), report
        assert (report["cross_rank"], report["cross_size"]) == (host_index, hosts), report
        assert report["allreduce"] == size * (size + 1) / 2
        assert not report["one_cpu_host"], report  # so automatic gradient buckets overlap the network


def test_thread_pools_are_sized_by_the_ranks_sharing_each_host(layout):
    """Ranks on other hosts do not count: one rank per host keeps TensorFlow's own pools."""
    ranks_per_host, found = layout
    for report in found:
        if ranks_per_host == 1:
            expected = (0, 0)  # 0: TensorFlow's default, all of the host's CPUs
        else:
            share = max(1, len(report["affinity"]) // ranks_per_host)
            expected = (share, max(2, share))  # two inter-op threads, so buckets can overlap
        assert (report["intra"], report["inter"]) == expected, report
