"""Which hosts can take ranks now, and how many ranks to start on them (``kerasdist-run --min-np``).

Before each attempt of a job started with ``--min-np``, the launcher finds the hosts that are
available (a discovery program's list, or each ``-H`` host probed through mpiexec itself) and
starts the largest number of ranks that fits in their slots, is at least ``--min-np`` and divides
the planned number: each rank can then stand in for a whole number of planned ranks, and the
global batch stays the planned one. Standard library only, like the rest of the launcher.
"""

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import time

from kerasdist.run.mpi import LaunchError

# A host that answers needs a fraction of a second (hydra starts its proxy there and runs `true`);
# ssh to a host that is down, or a proxy that cannot reach back, waits far longer.
HOST_PROBE_TIMEOUT_S = 10
DISCOVERY_TIMEOUT_S = 30
SSH_CONFIG_TIMEOUT_S = 10
HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_HOST_LINE = re.compile(rf"({HOST_NAME.pattern})(?::(\d+))?")


@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    slots: int


def parse_host_list(text):
    """``host[:slots],...`` (as ``-H`` takes it) as Hosts; a host without slots has one."""
    hosts = []
    for entry in text.split(","):
        name, _, slots = entry.strip().partition(":")
        hosts.append(Host(name, int(slots) if slots else 1))
    return hosts


def resolves(name, environ):
    """True when ``name`` resolves to an address here, directly or as ssh resolves it (a ``Host``
    alias in ssh's configuration names its ``HostName``), or when ssh cannot be asked."""
    try:
        socket.getaddrinfo(name, None)
        return True
    except (socket.gaierror, UnicodeError):
        pass
    ssh = shutil.which("ssh", path=environ.get("PATH"))
    if ssh is None:
        return False
    try:  # -G prints the configuration ssh would use for the host, without connecting
        printed = subprocess.run(
            [ssh, "-G", name], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=SSH_CONFIG_TIMEOUT_S
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return True
    real_names = [line.split()[1] for line in printed.splitlines() if line.startswith("hostname ")]
    if not real_names or real_names[0] == name:
        return False
    try:
        socket.getaddrinfo(real_names[0], None)
        return True
    except (socket.gaierror, UnicodeError):
        return False


def host_list_text(hosts):
    return ",".join(f"{host.name}:{host.slots}" for host in hosts)


def parse_discovery_output(text, program):
    """The hosts a discovery program printed, one ``host[:slots]`` a line (blank lines ignored).

    Raises:
        LaunchError: a line is not ``host[:slots]`` with slots >= 1, or a host comes twice;
            the message names the program, the line and its number.
    """
    hosts, seen = [], set()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _HOST_LINE.fullmatch(line.strip())
        if not match or (match.group(2) is not None and int(match.group(2)) < 1):
            raise LaunchError(
                f"host discovery program {program} printed {line.strip()!r} on line {number}; "
                "expected one host a line as host or host:slots (slots >= 1)"
            )
        name = match.group(1)
        if name in seen:
            raise LaunchError(f"host discovery program {program} listed {name} twice (line {number})")
        seen.add(name)
        hosts.append(Host(name, int(match.group(2) or 1)))
    return hosts


def discover_hosts(program, environ, timeout=DISCOVERY_TIMEOUT_S):
    """Runs the discovery ``program`` and returns the hosts it lists.

    Raises:
        LaunchError: it cannot be run, exits non-zero, takes longer than ``timeout`` or prints
            something other than host lines.
    """
    try:
        with _stops_held():
            discovery = _start_in_own_session([program], env=environ, stdout=subprocess.PIPE)
    except OSError as error:
        raise LaunchError(f"cannot run host discovery program {program}: {error}") from None
    try:
        stdout, stderr = discovery.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"host discovery program {program} printed no host list within {timeout} s") from None
    finally:  # also when the launcher is stopped meanwhile
        if discovery.poll() is None:
            _stop_session(discovery)
    if discovery.returncode != 0:
        last_line = (stderr.strip().splitlines() or [""])[-1]
        raise LaunchError(f"host discovery program {program} exited with status {discovery.returncode}: {last_line}")
    return parse_discovery_output(stdout, program)


def probe_hosts(hosts, probe_command, timeout=HOST_PROBE_TIMEOUT_S):
    """The hosts that run ``probe_command(host_name)`` (an argv) successfully within ``timeout``,
    all probed at once, and ``{host name: why not}`` for the others."""
    started = {}
    available, missing = [], {}
    try:
        with _stops_held():
            for host in hosts:
                started[host] = _start_in_own_session(probe_command(host.name), stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        for host, probe in started.items():
            try:
                _, stderr = probe.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                missing[host.name] = f"no answer within {timeout} s"
                continue
            if probe.returncode == 0:
                available.append(host)
            else:
                last_line = (stderr.strip().splitlines() or [""])[-1]
                reason = f": {last_line}" if last_line else ""
                missing[host.name] = f"probe exited with status {probe.returncode}{reason}"
    finally:  # also when the launcher is stopped meanwhile: hydra may wait for ever on a lost host
        for probe in started.values():
            if probe.poll() is None:
                _stop_session(probe)
    return available, missing


def _start_in_own_session(argv, **popen_args):
    """``argv`` started in a session of its own, so that if it hangs `_stop_session` stops it with
    everything it started; its stderr is kept as text for the error message."""
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
        **popen_args,
    )


@contextlib.contextmanager
def _stops_held():
    """Ctrl-C and SIGTERM wait for the end of the block, then go to the handlers they had. A stop
    raised inside Popen, after the child started but before its process object is returned,
    would leave that child running with nothing to stop it."""
    arrived = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.signal(signum, lambda signum, _frame: arrived.append(signum)) for signum in held}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if arrived:
            signal.raise_signal(arrived[0])


def _stop_session(process):
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.communicate()


def choose_ranks(planned, available_slots, min_ranks):
    """The ranks to start: the largest n <= ``available_slots`` with n >= ``min_ranks`` that
    divides ``planned``, so that each rank stands in for planned / n ranks.

    Raises:
        LaunchError: there is no such n; the message names the numbers.
    """
    fitting = [n for n in range(min(planned, available_slots), min_ranks - 1, -1) if planned % n == 0]
    if fitting:
        return fitting[0]
    if available_slots < min_ranks:
        raise LaunchError(f"only {available_slots} slot(s) are available, fewer than --min-np {min_ranks}")
    divisors = [n for n in range(1, planned + 1) if planned % n == 0]
    enough = min(n for n in divisors if n >= min_ranks)
    raise LaunchError(
        f"{available_slots} slot(s) are available, but no number of ranks from {min_ranks} to {available_slots} "
        f"divides the planned {planned} (its divisors: {', '.join(map(str, divisors))}), so the ranks could not "
        f"keep the planned global batch; lower --min-np, or make {enough} slots available"
    )


def place(hosts, ranks):
    """The first hosts' slots, in order, filled with ``ranks`` ranks."""
    placed, left = [], ranks
    for host in hosts:
        if left == 0:
            break
        placed.append(Host(host.name, min(host.slots, left)))
        left -= placed[-1].slots
    return placed
