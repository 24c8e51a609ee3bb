"""A test cluster of emulated hosts (scripts/netns_cluster.sh) and jobs started across it.

Jobs go through ``kerasdist-run`` with the cluster's launcher program and interface, as a user
of a real cluster would start them, and with ``UCX_TLS=tcp`` so that bytes between hosts cross
the emulated links (UCX would take shared memory between namespaces of one kernel).
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from launch_utils import REPO_ROOT, child_env, run_job

CLUSTER_SCRIPT = str(REPO_ROOT / "scripts" / "netns_cluster.sh")
SCRIPTS = Path(__file__).resolve().parent / "scripts"
LAUNCHER = [sys.executable, "-m", "kerasdist.run"]
DEFAULT_JOB_TIMEOUT_S = 180


@dataclasses.dataclass
class Cluster:
    """One cluster made by ``netns_cluster.sh up``; ``env`` holds its NETNS_CLUSTER_* values."""

    env: dict

    @classmethod
    def up(cls, hosts, slots, timeout, rate=None, cpus_per_host=0):
        argv = [CLUSTER_SCRIPT, "up", "--hosts", str(hosts), "--slots", str(slots), "--owner", str(os.getpid())]
        if rate:
            argv += ["--rate", rate]
        if cpus_per_host:
            argv += ["--cpus-per-host", str(cpus_per_host)]
        made = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if made.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({made.returncode}):\n{made.stderr}")
        directory = Path(made.stdout.strip().splitlines()[-1])
        return cls(read_env_file(directory / "env"))

    def down(self):
        subprocess.run([CLUSTER_SCRIPT, "down", self.directory], check=True, capture_output=True, timeout=120)

    @property
    def directory(self):
        return self.env["NETNS_CLUSTER_DIR"]

    @property
    def hosts(self):
        return self.env["NETNS_CLUSTER_HOSTS"].split(",")

    @property
    def interface(self):
        return self.env["NETNS_CLUSTER_IFACE"]

    @property
    def launcher(self):
        return self.env["NETNS_CLUSTER_LAUNCHER"]

    @property
    def hostfile(self):
        return self.env["NETNS_CLUSTER_HOSTFILE"]

    def hosts_option(self, ranks_per_host, host_count=None):
        """``-H`` value placing ``ranks_per_host`` ranks on each of the first ``host_count`` hosts."""
        return ",".join(f"{host}:{ranks_per_host}" for host in self.hosts[:host_count])

    def link_bytes(self):
        """Bytes the bridge has sent to and received from each host so far, host by host."""
        counts = []
        for index in range(len(self.hosts)):
            statistics = Path("/sys/class/net") / f"kd{self.env['NETNS_CLUSTER_ID']}h{index}" / "statistics"
            counts.append(int((statistics / "rx_bytes").read_text()) + int((statistics / "tx_bytes").read_text()))
        return counts

    def on_host(self, host, command, timeout=60):
        """Runs a shell command on one host through the cluster's launcher program."""
        return subprocess.run([self.launcher, host, command], capture_output=True, text=True, timeout=timeout)

    def launch(
        self,
        num_processes,
        command,
        cwd,
        hosts=None,
        hostfile=None,
        env=None,
        unset=(),
        extra_flags=(),
        timeout=DEFAULT_JOB_TIMEOUT_S,
        script_name="",
    ):
        """``kerasdist-run -np N [-H HOSTS | --hostfile FILE] --launcher-exec ... --network-interface ...``
        with ``env`` added to and ``unset`` removed from the environment hydra passes to the ranks."""
        where = ["--hostfile", hostfile] if hostfile else ["-H", hosts] if hosts else []  # [] : a discovery program
        argv = [
            *LAUNCHER,
            "-np",
            str(num_processes),
            *where,
            "--launcher-exec",
            self.launcher,
            "--network-interface",
            self.interface,
            *extra_flags,
            *command,
        ]
        environment = tcp_env(**(env or {}))
        for name in unset:
            environment.pop(name, None)
        return run_job(argv, cwd, env=environment, timeout=timeout, script_name=script_name)

    def run_script(self, script, *args, num_processes, cwd, hosts=None, **kwargs):
        """A script of tests/multihost/scripts on every rank."""
        return self.launch(
            num_processes,
            [sys.executable, str(SCRIPTS / script), *args],
            cwd,
            hosts=hosts,
            script_name=script,
            **kwargs,
        )


def tcp_env(**extra):
    """The environment of a job whose ranks talk over TCP, with the repo on the path."""
    return child_env(UCX_TLS="tcp", **extra)


def read_env_file(path):
    values = {}
    for line in Path(path).read_text().splitlines():
        name, _, value = line.partition("=")
        values[name] = value
    return values


def reports(job, tag, count):
    """The JSON objects printed as ``TAG {...}`` lines, checking the job succeeded with ``count`` of them."""
    assert job.returncode == 0 and not job.timed_out, job.describe()
    # Ranks printing at once can share a line of the launcher's output: decode from each tag on.
    decoder = json.JSONDecoder()
    found = [decoder.raw_decode(job.output, match.end())[0] for match in re.finditer(rf"{tag} ", job.output)]
    assert len(found) == count, job.describe()
    return sorted(found, key=lambda report: report["rank"])
