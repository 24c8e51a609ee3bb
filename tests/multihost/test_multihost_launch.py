"""kerasdist-run across emulated hosts, for real: -H and --hostfile place the ranks on the
hosts named, through --launcher-exec, and MPI's bytes between hosts cross the links."""

from multihost_utils import reports

LINK_BYTES_OF_4_MIB = 4 << 20


def expected_hosts(cluster, ranks_per_host, num_processes):
    """hydra fills each host's slots in order: rank r runs on host r // ranks_per_host."""
    return [cluster.hosts[rank // ranks_per_host] for rank in range(num_processes)]


def test_hosts_option_places_two_ranks_on_each_host_and_the_allreduce_crosses_the_links(two_hosts, tmp_path):
    before = two_hosts.link_bytes()
    job = two_hosts.run_script("where_am_i.py", num_processes=4, cwd=tmp_path, hosts=two_hosts.hosts_option(2))
    after = two_hosts.link_bytes()
    found = reports(job, "WHERE", 4)
    assert [r["host"] for r in found] == expected_hosts(two_hosts, 2, 4), job.describe()
    assert all(r["sum_ok"] and r["size"] == 4 for r in found), found
    # Each host sends and receives at least its share of a 4 MiB allreduce over its link.
    assert all(b - a >= LINK_BYTES_OF_4_MIB for a, b in zip(before, after)), (before, after)


def test_hostfile_places_the_ranks_by_its_slots(two_hosts, tmp_path):
    job = two_hosts.run_script("where_am_i.py", num_processes=4, cwd=tmp_path, hostfile=two_hosts.hostfile)
    assert [r["host"] for r in reports(job, "WHERE", 4)] == expected_hosts(two_hosts, 2, 4), job.describe()


def test_network_interface_reaches_the_ranks_as_the_transport_variables(two_hosts, tmp_path):
    job = two_hosts.run_script("where_am_i.py", num_processes=2, cwd=tmp_path, hosts=two_hosts.hosts_option(1))
    for report in reports(job, "WHERE", 2):
        assert report["launcher_variables"] == {
            "UCX_NET_DEVICES": two_hosts.interface,
            "FI_TCP_IFACE": two_hosts.interface,
        }
