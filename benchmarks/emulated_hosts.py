"""Two emulated hosts for the benchmarks: a cluster of scripts/netns_cluster.sh (needs root).

Shared by benchmarks/network.py, batch_growth_cluster.py and slow_links_cluster.py: the cluster
(`two_hosts()` for the length of a run), its link
shaping (tc htb in both directions of each host's link), a TCP stream measurement of the link,
and jobs started across the hosts through kerasdist-run with the cluster's launcher program and
interface and UCX_TLS=tcp (between namespaces of one kernel UCX would otherwise use shared
memory), each under `timeout` so that a hang fails instead of waiting.
"""

import contextlib
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
CLUSTER_SCRIPT = REPO / "scripts" / "netns_cluster.sh"
UNSHAPED = "none"
# One math thread per rank (a host here has one CPU of its own); two inter-op threads, as
# kerasdist.init() gives a rank with one CPU: with one, no gradient bucket could leave during backprop.
THREADS = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2"}


class Cluster:
    """A 2-host cluster of scripts/netns_cluster.sh, removed by down(); jobs time out after
    ``job_timeout_s``."""

    def __init__(self, job_timeout_s=900):
        self.job_timeout_s = job_timeout_s
        made = subprocess.run(
            # A CPU each: a host's communication then costs its own compute, as on real hosts,
            # and never the other host's.
            [str(CLUSTER_SCRIPT), "up", "--hosts", "2", "--cpus-per-host", "1", "--owner", str(os.getpid())],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if made.returncode != 0:
            raise SystemExit(f"cannot make the test cluster: {made.stderr.strip()}")
        directory = pathlib.Path(made.stdout.strip().splitlines()[-1])
        self.env = dict(line.split("=", 1) for line in (directory / "env").read_text().splitlines())
        self.hosts = self.env["NETNS_CLUSTER_HOSTS"].split(",")

    def shape(self, rate):
        subprocess.run(
            [str(CLUSTER_SCRIPT), "shape", self.env["NETNS_CLUSTER_DIR"], rate],
            check=True,
            capture_output=True,
            timeout=60,
        )

    def down(self):
        subprocess.run([str(CLUSTER_SCRIPT), "down", self.env["NETNS_CLUSTER_DIR"]], capture_output=True, timeout=120)

    def on_host(self, host, command, **kwargs):
        return subprocess.Popen([self.env["NETNS_CLUSTER_LAUNCHER"], host, command], **kwargs)

    def launch(self, command, extra_flags=(), env=None, with_stderr=False):
        """Runs ``command`` as 2 ranks, one per host; returns its stdout, then its stderr when
        ``with_stderr`` (fails loudly)."""
        argv = [
            sys.executable,
            "-m",
            "kerasdist.run",
            "-np",
            "2",
            "-H",
            ",".join(f"{h}:1" for h in self.hosts),
            "--launcher-exec",
            self.env["NETNS_CLUSTER_LAUNCHER"],
            "--network-interface",
            self.env["NETNS_CLUSTER_IFACE"],
            *extra_flags,
            *command,
        ]
        return run(argv, {**job_environment(), "UCX_TLS": "tcp", **(env or {})}, self.job_timeout_s, with_stderr)


def job_environment():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERASDIST_")}
    env.update(THREADS, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO))
    return env


def run(argv, env, timeout_s, with_stderr=False):
    """Runs ``argv`` under ``timeout`` and returns its stdout (then its stderr, when
    ``with_stderr``); on failure prints the tails of its output and exits."""
    done = subprocess.run(
        ["timeout", "--kill-after=10", str(timeout_s), *map(str, argv)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        sys.stderr.write(
            f"\nfailed ({done.returncode}): {' '.join(map(str, argv))}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n"
        )
        raise SystemExit(1)
    return done.stdout + done.stderr if with_stderr else done.stdout


STREAM_RECEIVER = (
    "import socket, time; s = socket.create_server(('', 5301)); c, _ = s.accept(); "
    "b = bytearray(1 << 20); n = 0; t = time.perf_counter()\n"
    "while (k := c.recv_into(b)): n += k\n"
    "print(n * 8 / (time.perf_counter() - t) / 1e9)"
)


def tcp_stream_gbits(cluster, megabytes):
    """One TCP stream from host 0 to host 1: Gbit/s as the receiver saw it."""
    receiver = cluster.on_host(cluster.hosts[1], f'python3 -c "{STREAM_RECEIVER}"', stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    sender = (
        f"import socket; c = socket.create_connection(('{cluster.hosts[1]}', 5301)); d = bytes(1 << 20)\n"
        f"for _ in range({megabytes}): c.sendall(d)\nc.close()"
    )
    cluster.on_host(cluster.hosts[0], f'python3 -c "{sender}"').wait(timeout=120)
    return float(receiver.communicate(timeout=120)[0])


def measure_link(cluster, rate):
    """The median of 3 TCP streams over the link as shaped to ``rate`` (64 MiB each, 512 unshaped)."""
    megabytes = 64 if rate != UNSHAPED else 512
    return statistics.median(tcp_stream_gbits(cluster, megabytes) for _ in range(3))


def interrupt(signum, _frame):
    """A SIGTERM handler that raises KeyboardInterrupt, so that `finally` removes the cluster."""
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def two_hosts(job_timeout_s):
    """A `Cluster` for the length of a `with` block, removed at its end, on Ctrl-C and on SIGTERM
    (raised inside the block as KeyboardInterrupt)."""
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        cluster = Cluster(job_timeout_s)
        try:
            yield cluster
        finally:
            cluster.down()
    finally:
        signal.signal(signal.SIGTERM, previous)
