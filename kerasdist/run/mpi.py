"""Which mpiexec to run, which MPI it belongs to, and the command line it understands.

Standard library only and no imports from kerasdist: ``setup.py`` loads this file by path to
record the build's mpiexec and flavour before the package is installed.
"""

import dataclasses
import os
import re
import shutil
import subprocess
import sys

MPIEXEC_VARIABLE = "KERASDIST_MPIEXEC"
FLAVOUR_VARIABLE = "KERASDIST_MPI_FLAVOUR"
VERSION_QUERY_TIMEOUT_S = 30


@dataclasses.dataclass(frozen=True)
class Flavour:
    """How one MPI family's mpiexec spells the options the launcher uses."""

    name: str  # what KERASDIST_MPI_FLAVOUR and build_info.json call it
    title: str  # for people
    # MPIs whose mpiexec starts each other's ranks: the MPICH ABI's (MPICH, Intel MPI, MVAPICH,
    # Cray MPICH) wire ranks up through hydra's PMI, Open MPI's through its own runtime (PMIx).
    family: str
    hosts_option: str
    hostfile_option: str
    sets_variables_with_x: bool  # Open MPI's `-x K=V`; hydra's `-genv K V` otherwise
    # Options that start remote processes through a program called as ssh is ("{program}").
    launcher_exec_template: tuple
    # Options that keep the launcher's and MPI's TCP traffic on one interface ("{interface}").
    interface_template: tuple
    # Variables that point the network libraries this MPI may use at that interface.
    interface_variables: tuple
    # Options that make this mpiexec put a tag naming the rank before each piece of a rank's
    # output it forwards, and the pattern (bytes, group 1 the rank) that finds the tags, so that
    # the launcher can put each rank's lines back together; rank_tag None: the tags are for people,
    # and only --prepend-rank asks for them.
    rank_tag_options: tuple = ()
    rank_tag: re.Pattern = None
    # Options on every command: what makes this mpiexec place ranks as hydra does by default.
    default_options: tuple = ()
    # Options for a job on this host alone (no hosts or host file given): run it whatever the
    # number of cores, as hydra does.
    local_job_options: tuple = ()

    def launcher_exec_options(self, program):
        """Options that make mpiexec start the processes on other hosts with ``program``."""
        return [part.format(program=program) for part in self.launcher_exec_template]

    def interface_options(self, interface):
        """Options that make mpiexec and MPI's TCP transport use ``interface`` only."""
        return [part.format(interface=interface) for part in self.interface_template]

    def environment_options(self, environment):
        """Options that set each ``name: value`` of ``environment`` on every rank."""
        options = []
        for name, value in environment.items():
            options += ["-x", f"{name}={value}"] if self.sets_variables_with_x else ["-genv", name, value]
        return options


# PyPI's MPICH is built with UCX and libfabric (ofi); its tcp provider reads FI_TCP_IFACE. Intel MPI
# runs over libfabric. Open MPI's TCP byte transfer layer (btl) and its runtime's out-of-band
# channel (oob) each take an interface list, and its UCX layer reads UCX_NET_DEVICES.
# Open MPI 5's runtime (PRRTE) calls the agent plm_ssh_agent and translates plm_rsh_*.
# Open MPI binds each rank to one core when there are at most 2 ranks (a TensorFlow rank's
# threads would then share that core) and refuses more ranks than cores on one host, where hydra
# binds nothing and runs them all; `--bind-to none` and, for a job on this host, `--oversubscribe`
# make it do as hydra does. An option the user passes in --mpi-args comes later and wins.
# Hydra and Open MPI 4 forward a rank's output in the pieces they read and tag every piece when
# asked (hydra's -prepend-pattern, Open MPI's --tag-output), also the end of a line written apart;
# Intel MPI's hydra is not known to take a pattern, so its own -prepend-rank is used as it is.
MPICH = Flavour(
    "mpich",
    "MPICH (hydra)",
    "MPICH",
    "-hosts",
    "-f",
    sets_variables_with_x=False,
    launcher_exec_template=("-launcher", "ssh", "-launcher-exec", "{program}"),
    interface_template=("-iface", "{interface}"),
    interface_variables=("UCX_NET_DEVICES", "FI_TCP_IFACE"),
    rank_tag_options=("-prepend-pattern", "[%r]<kerasdist>:"),
    rank_tag=re.compile(rb"\[(\d+)\]<kerasdist>:"),
)
INTEL_MPI = Flavour(
    "intel",
    "Intel MPI (hydra)",
    "MPICH",
    "-hosts",
    "-f",
    sets_variables_with_x=False,
    launcher_exec_template=("-bootstrap", "ssh", "-bootstrap-exec", "{program}"),
    interface_template=("-iface", "{interface}"),
    interface_variables=("FI_TCP_IFACE",),
    rank_tag_options=("-prepend-rank",),
)
OPEN_MPI = Flavour(
    "openmpi",
    "Open MPI",
    "Open MPI",
    "-H",
    "--hostfile",
    sets_variables_with_x=True,
    launcher_exec_template=("--mca", "plm_rsh_agent", "{program}"),
    interface_template=("--mca", "btl_tcp_if_include", "{interface}", "--mca", "oob_tcp_if_include", "{interface}"),
    interface_variables=("UCX_NET_DEVICES",),
    rank_tag_options=("--tag-output",),
    rank_tag=re.compile(rb"\[\d+,(\d+)\]<std(?:out|err|diag)>:"),
    default_options=("--bind-to", "none"),
    local_job_options=("--oversubscribe",),
)
FLAVOURS = {flavour.name: flavour for flavour in (MPICH, INTEL_MPI, OPEN_MPI)}


class LaunchError(Exception):
    """The launcher cannot go on; the message says why and what to do."""


def flavour_from_version_text(text):
    """The flavour that printed ``text`` as its ``mpiexec --version`` output, or None.

    Intel MPI and MVAPICH ship hydra too, so Intel's own banner is checked before hydra's.
    """
    if "Intel(R) MPI" in text or "Intel MPI" in text:
        return INTEL_MPI
    if "Open MPI" in text or "OpenRTE" in text:
        return OPEN_MPI
    if "HYDRA" in text or "MPICH" in text:
        return MPICH
    return None


def run_version_query(mpiexec):
    """Output (stdout and stderr) of ``mpiexec --version``."""
    finished = subprocess.run(
        [mpiexec, "--version"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        timeout=VERSION_QUERY_TIMEOUT_S,
    )
    return finished.stdout


def detect_flavour(mpiexec, run_version=run_version_query):
    """Asks ``mpiexec --version`` which MPI it belongs to; None when it does not say.

    ``run_version`` maps an mpiexec path to its version output (tests pass a fake).
    """
    try:
        text = run_version(mpiexec)
    except (OSError, subprocess.SubprocessError):
        return None
    return flavour_from_version_text(text)


def _is_executable(path):
    return os.path.isfile(path) and os.access(path, os.X_OK)


def mpiexec_of_install(bin_dir, suffix=""):
    """``bin_dir``'s mpiexec (or mpirun) when it has one, else None. With ``suffix``, the ones
    that carry it come first: Debian's mpicc.openmpi goes with mpiexec.openmpi, whatever
    /usr/bin/mpiexec points to."""
    names = [f"mpiexec{suffix}", f"mpirun{suffix}"] if suffix else []
    for name in names + ["mpiexec", "mpirun"]:
        path = os.path.join(bin_dir, name)
        if _is_executable(path):
            return path
    return None


def find_mpiexec(environ, recorded_at_build=None):
    """The mpiexec to launch with, and where that choice came from.

    In order: ``KERASDIST_MPIEXEC`` (a path or a name on PATH); the one recorded when the op
    library was built; the one beside this Python (PyPI's ``mpich`` installs it there); the
    first ``mpiexec`` or ``mpirun`` on PATH.

    Raises:
        LaunchError: ``KERASDIST_MPIEXEC`` names nothing runnable, or no mpiexec was found.
    """
    override = environ.get(MPIEXEC_VARIABLE, "").strip()
    if override:
        found = shutil.which(override)
        if not found:
            raise LaunchError(f"{MPIEXEC_VARIABLE}={override!r} is not an executable file or a command on PATH")
        return found, MPIEXEC_VARIABLE
    if recorded_at_build and _is_executable(recorded_at_build):
        return recorded_at_build, "build_info.json"
    beside_python = mpiexec_of_install(os.path.dirname(sys.executable))
    if beside_python:
        return beside_python, "beside this Python"
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name, path=environ.get("PATH"))
        if found:
            return found, "PATH"
    raise LaunchError(
        f"no mpiexec found: `pip install mpich` into this Python's environment, put your "
        f"MPI's mpiexec on PATH, or set {MPIEXEC_VARIABLE}=/path/to/mpiexec"
    )


def choose_flavour(mpiexec, environ, run_version=run_version_query):
    """The flavour from ``KERASDIST_MPI_FLAVOUR`` if set, else as ``mpiexec --version`` tells.

    Raises:
        LaunchError: the override names no known flavour, or mpiexec's output is not recognised.
    """
    override = environ.get(FLAVOUR_VARIABLE, "").strip().lower()
    if override:
        if override not in FLAVOURS:
            raise LaunchError(f"{FLAVOUR_VARIABLE}={override!r} must be one of {', '.join(FLAVOURS)}")
        return FLAVOURS[override]
    flavour = detect_flavour(mpiexec, run_version)
    if flavour is None:
        raise LaunchError(
            f"cannot tell which MPI {mpiexec} belongs to from its --version output; set "
            f"{FLAVOUR_VARIABLE} to one of {', '.join(FLAVOURS)}"
        )
    return flavour


def other_family_problem(mpiexec, source, flavour, build_info):
    """Why ``mpiexec``, a ``flavour`` one chosen from ``source``, cannot start the ranks of the op
    library ``build_info`` (build_info.json) describes, or None: it can, or the build's MPI is not
    known. An mpiexec of another MPI family cannot wire those ranks up (MPICH's MPI_Init refuses
    Open MPI's PMIx, for one).

    Example:

    ```python
    from kerasdist.run.mpi import OPEN_MPI, other_family_problem
    build = {"mpi": "PyPI mpich", "mpi_flavour": "mpich", "mpiexec": None}
    problem = other_family_problem("/usr/bin/mpiexec", "PATH", OPEN_MPI, build)
    print(problem)  # the op library was built against PyPI mpich (MPICH family), ... is Open MPI's, ...
    ```
    """
    built = FLAVOURS.get((build_info or {}).get("mpi_flavour"))
    if built is None or built.family == flavour.family:
        return None
    built_with = build_info.get("mpi") or built.title
    recorded = build_info.get("mpiexec")
    gone = ""
    if recorded and not _is_executable(recorded):
        again = " (`pip install mpich` installs it again)" if built_with == "PyPI mpich" else ""
        gone = f"; {recorded}, its mpiexec when it was built, is gone{again}"
    return (
        f"the op library was built against {built_with} ({built.family} family), but the mpiexec found "
        f"(from {source}), {mpiexec}, is {flavour.title}'s, which cannot start ranks of the {built.family} "
        f"family{gone}. Set {MPIEXEC_VARIABLE} to an {built.family} mpiexec, or rebuild kerasdist against "
        f"{flavour.title} (docs/deployment.md, Building against a system MPI)"
    )


def interface_environment(flavour, interface, caller_environment):
    """``{variable: interface}`` for the flavour's interface variables; one the caller has set
    keeps the caller's value (e.g. ``UCX_NET_DEVICES=mlx5_0:1``, so that UCX stays on RDMA)."""
    return {name: caller_environment.get(name) or interface for name in flavour.interface_variables}


def build_command(
    mpiexec,
    flavour,
    num_processes,
    command,
    hosts=None,
    hostfile=None,
    environment=None,
    mpi_args=(),
    launcher_exec=None,
    network_interface=None,
    tag_ranks=False,
):
    """The argv that starts ``command`` as ``num_processes`` ranks.

    Args:
        mpiexec: path of the launcher binary.
        flavour: a ``Flavour``; decides how hosts, host files and variables are spelled.
        num_processes: number of ranks.
        command: the program and its arguments, run on every rank.
        hosts: ``"host1:2,host2:2"`` (slots optional), or None for the local host.
        hostfile: path of a host file in the MPI's own format, or None.
        environment: variables to set on every rank, ``{name: value}``.
        mpi_args: extra mpiexec options, placed after ours so that they win.
        launcher_exec: a program that mpiexec calls as it would call ssh
            (``PROGRAM [options] HOST COMMAND...``) to start processes on other hosts, or None.
        network_interface: the network interface for mpiexec's own and MPI's TCP traffic, or
            None. Its variables (``interface_environment``) belong in ``environment``.
        tag_ranks: put the flavour's tag naming the rank before each piece of output.

    Example:

    ```python
    from kerasdist.run.mpi import OPEN_MPI, build_command
    command = build_command("/usr/bin/mpirun", OPEN_MPI, 2, ["python", "train.py"],
                            hosts="a:1,b:1", environment={"KERASDIST_LOG_LEVEL": "info"})
    print(" ".join(command))
    # /usr/bin/mpirun -np 2 --bind-to none -H a:1,b:1 -x KERASDIST_LOG_LEVEL=info python train.py
    ```
    """
    argv = [mpiexec, "-np", str(num_processes), *flavour.default_options]
    if tag_ranks:
        argv += flavour.rank_tag_options
    if hosts:
        argv += [flavour.hosts_option, hosts]
    if hostfile:
        argv += [flavour.hostfile_option, hostfile]
    if not (hosts or hostfile):
        argv += flavour.local_job_options
    if launcher_exec:
        argv += flavour.launcher_exec_options(launcher_exec)
    if network_interface:
        argv += flavour.interface_options(network_interface)
    argv += flavour.environment_options(environment or {})
    return argv + list(mpi_args) + list(command)
