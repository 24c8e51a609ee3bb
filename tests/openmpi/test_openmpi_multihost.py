"""The launcher's Open MPI spelling across 2 emulated hosts (scripts/netns_cluster.sh): `-H` and
an Open MPI host file place the ranks on the hosts asked, `-x` carries the variables to the
other host (Open MPI, unlike hydra, passes on none by itself), `--launcher-exec` becomes
plm_rsh_agent and `--network-interface` btl/oob_tcp_if_include, and kerasdist's allreduce sums
right across the link."""

import json

from openmpi_utils import SCRIPTS, kerasdist_run, openmpi_env

LINK_BYTES_OF_4_MIB = 4 << 20


def _reports(job, tag, count):
    assert job.returncode == 0 and not job.timed_out, job.describe()
    found = sorted((json.loads(line) for line in job.lines_with(f"{tag} ")), key=lambda report: report["rank"])
    assert len(found) == count, job.describe()
    return found


def _cluster_flags(cluster):
    return ["--launcher-exec", cluster.launcher, "--network-interface", cluster.interface]


def test_hosts_option_places_ranks_forwards_variables_and_sums_across_the_link(two_hosts, tmp_path):
    before = two_hosts.link_bytes()
    job = kerasdist_run(
        4,
        SCRIPTS / "placement.py",
        *["KERASDIST_FUSION_THRESHOLD", "KERASDIST_STALL_WARNING_S", "UCX_NET_DEVICES", "UCX_TLS", "NOT_FORWARDED"],
        cwd=tmp_path,
        # A knob given as a flag and one set in the caller's environment; a variable of the
        # user's own passed with Open MPI's -x; one that nobody asked to pass on.
        flags=[*_cluster_flags(two_hosts), "-H", two_hosts.hosts_option(2), "--fusion-threshold-mb", "1"]
        + ["--mpi-args", "-x UCX_TLS"],
        env=openmpi_env(KERASDIST_STALL_WARNING_S=7, UCX_TLS="tcp", NOT_FORWARDED="here only"),
        timeout=180,
    )
    after = two_hosts.link_bytes()
    placed = _reports(job, "PLACED", 4)
    first, second = two_hosts.hosts
    assert [(r["host"], r["local_rank"], r["size"]) for r in placed] == [
        (first, 0, 4),
        (first, 1, 4),
        (second, 0, 4),
        (second, 1, 4),
    ], job.describe()
    assert all(r["sum"] == 1 + 2 + 3 + 4 for r in placed), placed
    expected_variables = {
        "KERASDIST_FUSION_THRESHOLD": str(1 << 20),
        "KERASDIST_STALL_WARNING_S": "7",
        "UCX_NET_DEVICES": two_hosts.interface,
        "UCX_TLS": "tcp",
        "NOT_FORWARDED": None,
    }
    # Every host, the first too, is reached through the launcher program, as a remote host is.
    assert all(r["variables"] == expected_variables for r in placed), placed
    # Each host sends and receives at least its share of a 4 MiB allreduce over its link.
    assert all(b - a >= LINK_BYTES_OF_4_MIB for a, b in zip(before, after)), (before, after)


def test_an_open_mpi_host_file_places_the_ranks_by_its_slots(two_hosts, tmp_path):
    first, second = two_hosts.hosts
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{first} slots=1\n{second} slots=3\n")  # Open MPI's own format
    job = kerasdist_run(
        4,
        SCRIPTS / "hosts_of_ranks.py",
        cwd=tmp_path,
        flags=[*_cluster_flags(two_hosts), "--hostfile", str(hostfile)],
        timeout=120,
    )
    assert [r["host"] for r in _reports(job, "HOST", 4)] == [first, second, second, second], job.describe()
