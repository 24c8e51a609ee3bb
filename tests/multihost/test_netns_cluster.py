"""scripts/netns_cluster.sh: hosts that look separate, links that can be shaped, and nothing left
behind after down, after SIGTERM / SIGINT, or after two clusters lived side by side."""

import os
import signal
import subprocess
import sys
import time

import pytest
from multihost_utils import CLUSTER_SCRIPT, Cluster

SETUP_TIMEOUT_S = 120
pytestmark = pytest.mark.usefixtures("clusters")  # skips, naming why, where clusters cannot be made


def namespaces_and_links():
    """Names of every network namespace and every interface of this (the root) namespace."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return (
        {line.split()[0] for line in namespaces.splitlines() if line.strip()},
        {line.split(": ")[1].split("@")[0] for line in links.splitlines()},
    )


def left_behind(cluster_id):
    namespaces, links = namespaces_and_links()
    return sorted(name for name in namespaces | links if cluster_id in name)


def test_hosts_have_their_own_names_addresses_and_a_clean_environment(two_hosts):
    seen = [two_hosts.on_host(host, "hostname; ip -o -4 addr show; env") for host in two_hosts.hosts]
    for host, shell in zip(two_hosts.hosts, seen):
        assert shell.returncode == 0, shell.stderr
        lines = shell.stdout.splitlines()
        assert lines[0] == host
        assert f" {two_hosts.interface} " in shell.stdout
        assert "NETNS_CLUSTER_DIR" not in shell.stdout  # like ssh, the launcher passes no environment
    addresses = [
        line.split()[3]
        for shell in seen
        for line in shell.stdout.splitlines()
        if " inet " in line and "127.0.0.1" not in line
    ]
    assert len(set(addresses)) == len(two_hosts.hosts)


def test_hosts_reach_each_other_by_name(two_hosts):
    first, second = two_hosts.hosts[:2]
    probe = f"import socket; s = socket.create_connection(('{second}', 9), timeout=5)"
    reached = two_hosts.on_host(first, f'python3 -c "{probe}" 2>&1 || true')
    # Nothing listens on port 9 there: "refused" proves the name resolved and the host answered.
    assert "Connection refused" in reached.stdout, reached.stdout + reached.stderr


def test_launcher_refuses_an_unknown_host(two_hosts):
    refused = two_hosts.on_host("no-such-host", "true")
    assert refused.returncode == 255 and "no host no-such-host" in refused.stderr


def test_a_shaped_link_is_no_faster_than_its_rate(tmp_path):
    """1 MiB over a 20 Mbit/s link takes at least 0.42 s (8.4 Mbit / 20 Mbit/s) less the burst."""
    cluster = Cluster.up(hosts=2, slots=1, timeout=SETUP_TIMEOUT_S, rate="20mbit")
    try:
        receiver, sender = cluster.hosts
        server = subprocess.Popen(
            [
                cluster.launcher,
                receiver,
                "python3 -c \"import socket, time; s = socket.create_server(('', 5301)); "
                "c, _ = s.accept(); t = time.perf_counter(); n = 0\n"
                "while (b := c.recv(65536)): n += len(b)\n"
                'print(n, time.perf_counter() - t)"',
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(1)
        sent = cluster.on_host(
            sender,
            f"python3 -c \"import socket; c = socket.create_connection(('{receiver}', "
            '5301)); c.sendall(bytes(1 << 20)); c.close()"',
        )
        assert sent.returncode == 0, sent.stderr
        received, seconds = server.communicate(timeout=60)[0].split()
        assert int(received) == 1 << 20
        assert float(seconds) > 0.3, f"1 MiB took {seconds} s on a 20 Mbit/s link"
    finally:
        cluster.down()
    assert left_behind(cluster.env["NETNS_CLUSTER_ID"]) == []


def cpus_on(cluster, host):
    """The CPUs a process started on `host` may run on."""
    shell = cluster.on_host(host, 'python3 -c "import os; print(sorted(os.sched_getaffinity(0)))"')
    assert shell.returncode == 0, shell.stderr
    return shell.stdout.strip()


def test_each_host_runs_on_cpus_of_its_own():
    """--cpus-per-host 1: host i on the i-th CPU this process may use, wrapping round past the
    last; without it, every host may use them all."""
    mine = sorted(os.sched_getaffinity(0))
    pinned = Cluster.up(hosts=3, slots=1, timeout=SETUP_TIMEOUT_S, cpus_per_host=1)
    shared = Cluster.up(hosts=2, slots=1, timeout=SETUP_TIMEOUT_S)
    try:
        for i, host in enumerate(pinned.hosts):
            assert cpus_on(pinned, host) == str([mine[i % len(mine)]]), host
        for host in shared.hosts:
            assert cpus_on(shared, host) == str(mine)
    finally:
        pinned.down()
        shared.down()


def test_a_bad_cpu_count_is_refused_by_name():
    made = subprocess.run(
        [CLUSTER_SCRIPT, "up", "--cpus-per-host", "one"], capture_output=True, text=True, timeout=SETUP_TIMEOUT_S
    )
    assert made.returncode != 0 and "--cpus-per-host must be a number" in made.stderr


def test_two_clusters_at_once_do_not_collide_and_down_removes_everything():
    first = Cluster.up(hosts=2, slots=1, timeout=SETUP_TIMEOUT_S)
    second = Cluster.up(hosts=3, slots=1, timeout=SETUP_TIMEOUT_S)
    try:
        assert first.env["NETNS_CLUSTER_ID"] != second.env["NETNS_CLUSTER_ID"]
        assert first.env["NETNS_CLUSTER_SUBNET"] != second.env["NETNS_CLUSTER_SUBNET"]
        assert not set(first.hosts) & set(second.hosts)
        assert len(left_behind(first.env["NETNS_CLUSTER_ID"])) == 2 + 1 + 2  # namespaces, bridge, outer veths
    finally:
        first.down()
        second.down()
    for cluster in (first, second):
        assert left_behind(cluster.env["NETNS_CLUSTER_ID"]) == []
        assert subprocess.run(["test", "-e", cluster.directory]).returncode != 0


WITH_DEFAULT_SIGINT = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])",
]


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_run_removes_the_cluster_when_signalled(signum, status):
    """`run` tears down on a signal while its command runs."""
    # Started with SIGINT at its default: a shell cannot trap a signal that was ignored when it
    # started, and make test's pytest workers may ignore SIGINT by the time this runs (here and in
    # CI it then timed out; with SIGINT ignored by hand, every time).
    proc = subprocess.Popen(
        [
            *WITH_DEFAULT_SIGINT,
            CLUSTER_SCRIPT,
            "run",
            "--hosts",
            "2",
            "--",
            "sh",
            "-c",
            "echo $NETNS_CLUSTER_ID; exec sleep 120",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    cluster_id = proc.stdout.readline().strip()
    assert len(left_behind(cluster_id)) == 2 + 1 + 2
    proc.send_signal(signum)
    assert proc.wait(timeout=60) == status
    assert left_behind(cluster_id) == []
