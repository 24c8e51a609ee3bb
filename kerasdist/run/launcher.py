"""``kerasdist-run``: start a training script as N ranks through the MPI kerasdist was built with.

Turns the engine's knobs into flags, spells hosts, host files and variables the way the chosen
mpiexec expects, and passes mpiexec's exit status (and Ctrl-C / SIGTERM) through. Before it
starts the ranks it checks that the Python they would run finds kerasdist and what kerasdist
needs, and it shows TensorFlow's start-up notices, which every rank prints alike, once
(``output``). Imports neither TensorFlow nor MPI, so it starts at once.
"""

import argparse
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

from kerasdist import knobs, op_library, runtime
from kerasdist.run import hosts, mpi, output

PROG = "kerasdist-run"
BUILD_INFO_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build_info.json")
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
USAGE_ERROR = 2  # what argparse exits with
RESTART_VARIABLE = "KERASDIST_RESTART"
# Ctrl-C or SIGTERM, to the launcher or to the job (a scheduler's preemption): a stop, not a failure.
STOP_STATUSES = (128 + signal.SIGINT, 128 + signal.SIGTERM)
# What a shell reports for a program ended by SIGPIPE: the launcher's when its output's reader has gone.
CLOSED_PIPE_STATUS = 128 + signal.SIGPIPE
# Checking the ranks' interpreter starts it once; a site's wrapper script may take a moment.
INTERPRETER_CHECK_TIMEOUT_S = 30
# A rank that outlives mpiexec may hold its stderr open; the launcher waits this long for the rest.
STDERR_DRAIN_TIMEOUT_S = 5
# After a rank said it ends the job (output.RANK_ENDS_JOB: a rank or a link is gone), mpiexec
# gets this long to end it. Hydra does in about a second, but waits without end for a proxy on a
# host it can no longer reach; the ranks there end themselves by the same timeout.
LAUNCHER_GRACE_S = 10
# After Ctrl-C, the ranks get this long to end (a KeyboardInterrupt's traceback, a `finally`);
# then mpiexec gets SIGTERM. A rank blocked in a collective never sees the SIGINT, and hydra
# only asks for a second Ctrl-C; after SIGTERM it ends every rank within a second.
INTERRUPT_GRACE_S = 2
_PYTHON_NAME = re.compile(r"python(\d+(\.\d+)*)?")
# What a rank imports: kerasdist and its install_requires.
RANK_MODULES = ("kerasdist", "tensorflow", "keras", "mpi4py")


# Inside a Slurm allocation, MPICH's hydra starts one proxy per node with srun, and each proxy
# connects back to mpiexec's host by name (or by hydra's -localhost). From salloc on a host outside
# the allocation that connection may be impossible, and hydra then waits without end; the launcher
# tries it first from every node, in one srun step, within this time.
SLURM_CALLBACK_TIMEOUT_S = 30
_SIOCGIFADDR = 0x8915


class _Parser(argparse.ArgumentParser):
    """Reports a bad argument in one line instead of argparse's usage block."""

    def error(self, message):
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def print_help(self, file=None):
        # argparse drops a failed write; a closed pipe (`--help | head`) must reach main().
        (file or sys.stdout).write(self.format_help())


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _non_negative_int(text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def _knob_text(knob):
    """The flag's argument type: the text to set the knob's variable to, checked by the same
    rule `kerasdist.init()` applies on every rank."""

    def variable_text(text):
        value = (knob.flag_to_text(text) if knob.flag_to_text else text).strip()
        try:
            knob.parse(value)
        except ValueError as error:
            in_other_units = f" (= {knob.variable}={value})" if knob.flag_default is not None else ""
            raise argparse.ArgumentTypeError(f"{text!r}{in_other_units} {error}") from None
        return value

    return variable_text


def _host_list(text):
    """Checks ``host[:slots],...`` and returns it without spaces around the entries."""
    entries = [entry.strip() for entry in text.split(",")]
    for entry in entries:
        host, _, slots = entry.partition(":")
        if not hosts.HOST_NAME.fullmatch(host) or (":" in entry and not (slots.isdigit() and int(slots) > 0)):
            raise argparse.ArgumentTypeError(
                f"expected host[:slots],... (host names of letters, digits, '.', '_' and '-'; slots >= 1), got {text!r}"
            )
    return ",".join(entries)


def _existing_file(text):
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def _program(text):
    """An executable file or a command on PATH, as an absolute path (mpiexec may not search PATH)."""
    found = shutil.which(text)
    if not found:
        raise argparse.ArgumentTypeError(f"{text!r} is not an executable file or a command on PATH")
    return os.path.abspath(found)


def _interface_name(text):
    """A name Linux accepts for a network interface: 1-15 characters, no '/', ':' or space."""
    if not re.fullmatch(r"[^/:\s]{1,15}", text) or text in (".", ".."):
        raise argparse.ArgumentTypeError(f"not a network interface name (as `ip link` lists them): {text!r}")
    return text


def _mpi_args(text):
    try:
        return shlex.split(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"cannot split {text!r} like a shell would: {error}") from None


def make_parser():
    """The argument parser of ``kerasdist-run`` (also ``python -m kerasdist.run``)."""
    parser = _Parser(
        prog=PROG,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Runs command as NP kerasdist ranks with the mpiexec kerasdist was built with.\n"
        "KERASDIST_MPIEXEC=/path/to/mpiexec overrides that choice, and\n"
        "KERASDIST_MPI_FLAVOUR=mpich|intel|openmpi what its --version output says.\n\n"
        "Every rank runs command as written: name the Python kerasdist is installed in\n"
        "(a bare `python` is whichever comes first on PATH), or start command with a .py\n"
        "script, which then runs under kerasdist-run's own Python (at the same path on\n"
        f"every host):\n  {sys.executable}\n"
        "Without -H, --hostfile or --host-discovery-script, a Python that cannot import\n"
        "kerasdist is refused before any rank starts. TensorFlow's start-up notices, alike\n"
        "on every rank, are shown once.",
        epilog="examples:\n"
        "  kerasdist-run -np 2 train.py                 # train.py under this Python\n"
        f"  kerasdist-run -np 2 {sys.executable} train.py\n"
        "  kerasdist-run -np 4 -H node1:2,node2:2 --fusion-threshold-mb 32 /path/to/venv/bin/python train.py",
    )
    parser.add_argument(
        "-np",
        "-n",
        "--np",  # Open MPI's spelling
        dest="num_processes",
        type=_positive_int,
        metavar="NP",
        help="number of processes (ranks) to start; required",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "-H",
        "--hosts",
        type=_host_list,
        metavar="HOST:SLOTS,...",
        help="hosts to run on, e.g. node1:2,node2:2 (default: this host)",
    )
    where.add_argument("--hostfile", type=_existing_file, metavar="FILE", help="host file in your MPI's own format")
    where.add_argument(
        "--host-discovery-script",
        type=_program,
        metavar="PROGRAM",
        help="with --min-np: a program that prints the hosts available now, one host[:slots] a line; "
        "run before every attempt",
    )
    parser.add_argument(
        "--launcher-exec",
        type=_program,
        metavar="PROGRAM",
        help="start the processes on other hosts with PROGRAM, called as ssh is "
        "(PROGRAM [options] HOST COMMAND...): a site's ssh wrapper, or the test "
        "cluster's (hydra: -launcher-exec; Open MPI: plm_rsh_agent)",
    )
    parser.add_argument(
        "--network-interface",
        type=_interface_name,
        metavar="IFACE",
        help="keep mpiexec's and MPI's TCP traffic on this interface (hydra: -iface; "
        "Open MPI: btl/oob_tcp_if_include) and set UCX_NET_DEVICES / FI_TCP_IFACE "
        "to it on every rank, unless you set them",
    )
    engine = parser.add_argument_group("engine knobs (each sets its KERASDIST_* variable on every rank)")
    for knob in knobs.KNOBS:
        engine.add_argument(
            knob.flag,
            dest=knob.field,
            type=_knob_text(knob),
            metavar=knob.metavar,
            help=f"{knob.variable}: {knob.help} (default {knob.default_text()})",
        )
    parser.add_argument(
        "--mpi-args",
        type=_mpi_args,
        default=[],
        metavar='"ARGS"',
        help='extra mpiexec options, one quoted string, e.g. --mpi-args "-bind-to core"',
    )
    parser.add_argument(
        "--restarts",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="start the job again, up to N times, when it ends with a non-zero status (not after "
        "Ctrl-C or SIGTERM); each rank reads the attempt, 0 first, from KERASDIST_RESTART. With "
        "Rank0Checkpoint(resume=True) training continues from the last complete checkpoint. A job that "
        f"stopped on notice (status {knobs.NOTICE_EXIT_STATUS}: a rank got KERASDIST_NOTICE_SIGNAL, which the "
        "launcher passes on) starts again without counting as a failure, under --min-np without the noticed host",
    )
    parser.add_argument(
        "--min-np",
        type=_positive_int,
        metavar="M",
        help="with --restarts and -H or --host-discovery-script: before every attempt, find the hosts "
        "available (-H hosts are probed through mpiexec) and start the most ranks, at least M, that fit "
        "their slots and divide NP; each rank then accumulates NP / ranks times more micro-batches, so "
        f"the global batch stays NP's. Every rank finds NP in {runtime.PLANNED_SIZE_VARIABLE}",
    )
    parser.add_argument(
        "--discovery-interval",
        type=_non_negative_int,
        default=30,
        metavar="S",
        help="with --min-np, while the job runs fewer ranks than planned: look for hosts every S seconds "
        "(the discovery program, or -H probes); when more ranks fit, stop the job at the next step "
        "boundary with a checkpoint (the notice signal, KERASDIST_NOTICE_SIGNAL) and start it again at "
        "the larger size, not counting against --restarts. 0: never. Default 30",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the mpiexec command and exit (with --min-np, -H hosts are not probed)",
    )
    parser.add_argument(
        "--prepend-rank",
        action="store_true",
        help="start each line a rank prints with [RANK] (hydra: -prepend-pattern; Open MPI: --tag-output; "
        "Intel MPI: its own -prepend-rank)",
    )
    parser.add_argument("--verbose", action="store_true", help="print the mpiexec command to stderr, then run it")
    parser.add_argument(
        "--check-build",
        action="store_true",
        help="print how the op library was built and which mpiexec would run, then exit",
    )
    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="command ...",
        help="the program every rank runs, with its arguments; a .py script first runs under this Python",
    )
    return parser


def rank_environment(args, environ):
    """The ``KERASDIST_*`` variables to set on every rank: the caller's (Open MPI does not forward
    them to remote hosts by itself), then the flags'."""
    environment = {knob.variable: environ[knob.variable] for knob in knobs.KNOBS if knob.variable in environ}
    for knob in knobs.KNOBS:
        if getattr(args, knob.field) is not None:
            environment[knob.variable] = getattr(args, knob.field)
    return environment


def read_build_info(path=BUILD_INFO_PATH):
    """What ``setup.py`` recorded about the op library's build, or None if it was never built."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _op_library_path():
    try:
        return op_library.library_path()
    except ImportError:
        return None


def check_build(environ, run_version=mpi.run_version_query):
    """Prints how the op library was built and which mpiexec would launch; returns the exit status."""
    build_info = read_build_info()
    library = _op_library_path()
    mismatch = None
    print(f"op library:     {library or 'missing: run `make build` (or setup.py build_ext --inplace)'}")
    if build_info is None:
        print(f"build info:     missing: {BUILD_INFO_PATH}")
    else:
        flavour = mpi.FLAVOURS.get(build_info.get("mpi_flavour"))
        print(f"built against:  TensorFlow {build_info.get('tensorflow', '?')}")
        running = installed_tensorflow()
        print(f"running:        {f'TensorFlow {running[0]} ({running[1]})' if running else 'no TensorFlow found'}")
        mismatch = running and op_library.tensorflow_mismatch(build_info.get("tensorflow"), running[0])
        if mismatch:
            print(f"mismatch:       {mismatch}")
        print(
            f"MPI:            {build_info.get('mpi', '?')}; "
            f"{flavour.title if flavour else 'flavour unknown'}; "
            f"mpiexec {build_info.get('mpiexec') or 'not found at build time'}"
        )
        print(f"MPI link flags: {shlex.join(build_info.get('mpi_link_flags', []))}")
        nccl = f"yes (NCCL {build_info.get('nccl_version', '?')}; GPU kernels)" if build_info.get("nccl") else "no"
        print(f"NCCL:           {nccl}")
    try:
        mpiexec, flavour, source = launch_mpiexec(environ, build_info, run_version)
        print(f"launch mpiexec: {mpiexec} ({flavour.title}; chosen from {source})")
    except mpi.LaunchError as error:
        print(f"launch mpiexec: none: {error}")
        return 1
    return 0 if library and build_info and not mismatch else 1


def launch_mpiexec(environ, build_info, run_version=mpi.run_version_query):
    """(mpiexec, flavour, where it was found) for a launch of the op library ``build_info``
    describes (None when unknown).

    Raises:
        mpi.LaunchError: no mpiexec was found, its flavour is unknown, or it belongs to another MPI
            family than the op library's.
    """
    mpiexec, source = mpi.find_mpiexec(environ, build_info and build_info.get("mpiexec"))
    flavour = mpi.choose_flavour(mpiexec, environ, run_version)
    problem = mpi.other_family_problem(mpiexec, source, flavour, build_info)
    if problem:
        raise mpi.LaunchError(problem)
    return mpiexec, flavour, source


def installed_tensorflow():
    """(version, distribution name) of the TensorFlow this Python imports, read from its package
    metadata without importing it (which takes seconds); None when no installed distribution provides it."""
    import importlib.metadata

    for name in importlib.metadata.packages_distributions().get("tensorflow", []):
        distribution = importlib.metadata.distribution(name)
        if any(str(path) == "tensorflow/__init__.py" for path in distribution.files or []):
            return distribution.version, re.sub(r"[-_.]+", "-", distribution.metadata["Name"]).lower()
    return None


def run_forwarding_signals(argv, job_output=None, notice_signal=None, noticed=None, wants_to_grow=None):
    """Runs ``argv``, forwarding SIGINT and SIGTERM to it; returns a shell-style exit status.

    ``notice_signal`` (a signal number, or None) is forwarded too, as a notice to leave and not
    a stop: mpiexec passes it on to every rank, and the status is the job's own. ``noticed``, a
    list, then gets it when the launcher itself received it. ``wants_to_grow``, a callable the
    wait calls every half second, may return True once: the job is then sent ``notice_signal``
    (so that it stops at a step boundary with a checkpoint, to start again at a larger size).

    128 + N when the launcher was sent signal N (mpiexecs exit with codes of their own choosing
    then: hydra 15 after SIGTERM, 255 after SIGINT), or when the child died of signal N;
    otherwise the child's own status. A child still running ``INTERRUPT_GRACE_S`` after a
    SIGINT gets SIGTERM, so one Ctrl-C ends the job. With ``job_output`` (an
    ``output.JobOutput``), the child's stdout and stderr are pipes that it passes on. When a rank
    says it ends the job, the child then gets ``LAUNCHER_GRACE_S`` to exit before it is stopped,
    and the status is 1; when the reader of the launcher's output has gone, the child is stopped
    at once and the status is ``CLOSED_PIPE_STATUS``. Otherwise they are the launcher's own.
    """
    child = None
    received = []
    interrupted_at = []  # time.monotonic() of the first SIGINT

    def forward(signum, _frame):
        if signum == notice_signal:
            if noticed is not None:
                noticed.append(signum)
        else:
            received.append(signum)
        if signum == signal.SIGINT and not interrupted_at:
            interrupted_at.append(time.monotonic())
        if child is not None:
            child.send_signal(signum)

    # Handlers go in before the child starts so that no signal falls between the two.
    forwarded = FORWARDED_SIGNALS + ((notice_signal,) if notice_signal else ())
    previous = {signum: signal.signal(signum, forward) for signum in forwarded}
    piped = subprocess.PIPE if job_output else None
    try:
        child = subprocess.Popen(argv, stdout=piped, stderr=piped)
        if job_output:
            job_output.start(child.stdout.fileno(), child.stderr.fileno())
        for signum in received + (noticed or []):
            child.send_signal(signum)
        never = threading.Event()
        rank_ended_job, reader_gone = (
            (job_output.rank_ended_job, job_output.reader_gone) if job_output else (never, never)
        )
        returncode = _wait_unless_a_rank_ended_the_job(
            child, rank_ended_job, reader_gone, interrupted_at, notice_signal, wants_to_grow
        )
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if job_output:
        job_output.join(STDERR_DRAIN_TIMEOUT_S)
    if received:
        return 128 + received[0]
    if job_output and job_output.reader_gone.is_set():
        return CLOSED_PIPE_STATUS
    if returncode < 0:
        return 128 - returncode
    return returncode


def _wait_unless_a_rank_ended_the_job(
    child, rank_ended_job, reader_gone, interrupted_at, notice_signal=None, wants_to_grow=None
):
    terminated = False
    while True:
        try:
            return child.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if rank_ended_job.is_set():
                break
            if wants_to_grow is not None and notice_signal and not terminated and wants_to_grow():
                child.send_signal(notice_signal)
                wants_to_grow = None
            interrupt_is_over = interrupted_at and time.monotonic() - interrupted_at[0] >= INTERRUPT_GRACE_S
            if (interrupt_is_over or reader_gone.is_set()) and not terminated:
                child.terminate()
                terminated = True
    try:
        return child.wait(timeout=LAUNCHER_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    print(
        f"{PROG}: a rank ended the job (above), and {os.path.basename(child.args[0])} had not exited "
        f"{LAUNCHER_GRACE_S} s later, waiting for a host it cannot reach: stopping it. The ranks on that "
        "host end themselves after KERASDIST_COLLECTIVE_TIMEOUT_S.",
        file=sys.stderr,
        flush=True,
    )
    child.terminate()
    try:
        child.wait(timeout=5)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    return 1


def is_python(program):
    """True when ``program`` (a name or a path) is named like a Python interpreter: python,
    python3, python3.11."""
    return bool(_PYTHON_NAME.fullmatch(os.path.basename(program)))


def interpreter_problem(command, environ):
    """Why the Python interpreter that starts ``command`` cannot run kerasdist on this host, or None.

    Starts it once, in the environment the ranks get and with the ``sys.path[0]`` a rank gets
    (the script's directory; the current one for ``-c``, ``-m`` or an option), and asks it to
    find kerasdist and the packages kerasdist needs, without importing them. An interpreter that
    does not answer in time, or cannot be started here, gets the benefit of the doubt: the ranks
    will report what is wrong.
    """
    program, script = command[0], (command[1:] or [""])[0]
    found = shutil.which(program, path=environ.get("PATH"))
    if found is None:
        return f"{program}, which is not an executable file or a command on PATH"
    first_path = os.path.dirname(os.path.abspath(script)) if os.path.isfile(script) else ""
    find_modules = (
        f"import importlib.util, sys; sys.path[0] = {first_path!r}; "
        f"missing = [m for m in {RANK_MODULES!r} if importlib.util.find_spec(m) is None]; "
        "sys.exit(f'ModuleNotFoundError: No module named {missing[0]!r}' if missing else 0)"
    )
    try:
        finished = subprocess.run(
            [found, "-c", find_modules],
            env=environ,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            timeout=INTERPRETER_CHECK_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if finished.returncode == 0:
        return None
    last_line = (finished.stderr.strip().splitlines() or [f"exit status {finished.returncode}"])[-1]
    where = "the first on PATH" if os.sep not in program else "as given"
    return f"{program}, which is {found} ({where}) and cannot run kerasdist: {last_line}"


def _missing_program_or_script(command, local_job, environ):
    """Why ``command`` cannot start, or None: its program (in a local job; another host may have
    it), or a ``.py`` script, is missing here. mpiexec would print its own error once per rank."""
    program = command[0]
    if program.endswith(".py") and not os.path.exists(program):
        return f"no such script: {program!r}"
    if not local_job:
        return None
    if shutil.which(program, path=environ.get("PATH")) is None:
        return f"{program!r} is not an executable file or a command on PATH"
    script = command[1] if is_python(program) and len(command) > 1 else None
    if script and not script.startswith("-") and not os.path.exists(script):
        return f"no such script: {script!r}"
    return None


def _what_to_run_instead(argv, given_command, environ):
    """After ``given_command``'s Python failed the check: the launcher's own Python when that
    one can run it, as the whole command line to type."""
    if (
        given_command[0] != sys.executable
        and is_python(given_command[0])
        and not interpreter_problem([sys.executable, *given_command[1:]], environ)
    ):
        program_at = len(argv) - len(given_command)
        instead = [PROG, *argv[:program_at], sys.executable, *argv[program_at + 1 :]]
        return f"{PROG} itself runs in {sys.executable}, which can; run:\n  {shlex.join(instead)}"
    return (
        f"{PROG}'s own Python ({sys.executable}) cannot run it: install kerasdist and its requirements "
        f"({', '.join(RANK_MODULES[1:])}) into the Python you name, or name one that has them"
    )


def _stop_with_signal_status(signum, _frame):
    raise SystemExit(128 + signum)


def _placement_stopping_on_signals(args, environ, probe_command, leaving=None):
    """`_placement`, ended by Ctrl-C or SIGTERM with their status (a stop, as during a job),
    after the probes it started are stopped."""
    previous = {signum: signal.signal(signum, _stop_with_signal_status) for signum in FORWARDED_SIGNALS}
    try:
        return _placement(args, environ, probe_command, leaving)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _placement(args, environ, probe_command, leaving=None):
    """(ranks, -H text) for the next attempt of a --min-np job, saying on stderr which hosts are
    left out and how many planned ranks each rank stands in for. Without ``probe_command``, -H
    hosts are taken as available. Hosts named in ``leaving`` (given notice) are left out while
    they are still there (`_available_hosts`).

    Raises:
        mpi.LaunchError: the discovery program fails, or no number of ranks fits (the message
            names the numbers).
    """
    available, missing = _available_hosts(args, environ, probe_command, set() if leaving is None else leaving)
    for name, reason in missing.items():
        print(f"{PROG}: host {name} is unavailable ({reason}); leaving it out", file=sys.stderr, flush=True)
    planned = args.num_processes
    ranks = hosts.choose_ranks(planned, sum(host.slots for host in available), args.min_np)
    placed = hosts.host_list_text(hosts.place(available, ranks))
    if ranks < planned:
        print(
            f"{PROG}: starting {ranks} of the planned {planned} ranks on {placed}: each accumulates "
            f"{planned // ranks} times the micro-batches per update, so the global batch stays the planned one",
            file=sys.stderr,
            flush=True,
        )
    return ranks, placed


def _growth_check(args, environ, probe_command, leaving, ranks, growing):
    """For a --min-np job running ``ranks`` of its planned ranks: a callable that, every
    --discovery-interval seconds, finds the hosts available and returns True (saying why on
    stderr, and appending True to ``growing``) when more ranks fit than run; None when the job
    cannot grow."""
    if not args.discovery_interval or ranks >= args.num_processes:
        return None
    next_look = [time.monotonic() + args.discovery_interval]

    def wants_to_grow():
        if time.monotonic() < next_look[0]:
            return False
        try:
            available, _ = _available_hosts(args, environ, probe_command, leaving)
            more = hosts.choose_ranks(args.num_processes, sum(host.slots for host in available), args.min_np)
        except mpi.LaunchError:
            more = 0
        next_look[0] = time.monotonic() + args.discovery_interval
        if more <= ranks:
            return False
        print(
            f"{PROG}: {more} of the planned {args.num_processes} ranks fit now, on "
            f"{hosts.host_list_text(hosts.place(available, more))}; the job runs {ranks}: asking it to stop at "
            "the next step boundary with a checkpoint, to start it again at the larger size",
            file=sys.stderr,
            flush=True,
        )
        growing.append(True)
        return True

    return wants_to_grow


def _available_hosts(args, environ, probe_command, leaving):
    """(hosts available now, {host left out: why}) for a --min-np job.

    A host given notice (in ``leaving``) stays out while it is still there, as it is about to go;
    once a look finds it gone (not listed, or no answer to the probe) it is forgotten from
    ``leaving``, so that it is used again when it comes back, as any host that returns."""
    if args.host_discovery_script:
        found, missing = hosts.discover_hosts(args.host_discovery_script, environ), {}
    elif probe_command is None:
        found, missing = hosts.parse_host_list(args.hosts), {}
    else:
        found, missing = hosts.probe_hosts(hosts.parse_host_list(args.hosts), probe_command)
    leaving.intersection_update(host.name for host in found)
    missing.update({name: "it was given notice to leave and is still there" for name in sorted(leaving)})
    return [host for host in found if host.name not in leaving], missing


def _restart_after_notice(args, notice_name, noticed_launcher, job_output, leaving):
    """After the job stopped on notice (status `knobs.NOTICE_EXIT_STATUS`): says so on stderr and
    whether it starts again, adding the hosts given notice to ``leaving`` under --min-np. A notice
    to the launcher itself means its host leaves: nothing starts again there."""
    noticed = sorted(job_output.noticed_hosts) if job_output else []
    where = f" (notice on {', '.join(noticed)})" if noticed else ""
    stopped = f"{PROG}: the job stopped on notice (SIG{notice_name}){where} at a step boundary"
    if noticed_launcher or not args.restarts:
        why = f"{PROG} itself was given notice" if noticed_launcher else "no --restarts"
        print(
            f"{stopped}; not starting it again ({why}): run the same command to resume from its checkpoint",
            file=sys.stderr,
            flush=True,
        )
        return False
    without = ""
    if args.min_np:
        leaving.update(noticed)
        without = f" without {', '.join(noticed)}" if noticed else " (no rank named its host: none is left out)"
    print(
        f"{stopped}; starting it again{without}, from the checkpoint of that step (a notice does not count "
        "against --restarts)",
        file=sys.stderr,
        flush=True,
    )
    return True


def _interface_address(name):
    """The IPv4 address of this host's network interface ``name``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as any_socket:
        request = struct.pack("256s", name.encode()[:15])
        return socket.inet_ntoa(fcntl.ioctl(any_socket.fileno(), _SIOCGIFADDR, request)[20:24])


def _hydra_starts_proxies_with_srun_from_outside(args, flavour, environ):
    """True when hydra will start its proxies with srun on a Slurm allocation this host is not
    part of (salloc on a login node); in a batch script or a job step SLURMD_NODENAME is set."""
    return (
        flavour is mpi.MPICH
        and bool(environ.get("SLURM_JOB_ID"))
        and not environ.get("SLURMD_NODENAME")
        and not (args.hosts or args.hostfile or args.host_discovery_script or args.launcher_exec)
        and "-launcher" not in args.mpi_args
    )


def _slurm_callback_problem(address, environ):
    """Why the allocation's nodes cannot connect to ``address`` here, or None: one srun step
    opens a TCP connection from each node to a port this process listens on."""
    with socket.create_server(("", 0), backlog=256) as listener:  # the kernel accepts for us
        port = listener.getsockname()[1]
        argv = ["srun", f"--nodes={environ.get('SLURM_JOB_NUM_NODES', 1)}", "--ntasks-per-node=1", "--input=none"]
        argv += ["bash", "-c", f"exec 3<>/dev/tcp/{address}/{port}"]
        try:
            probe = subprocess.run(
                argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=SLURM_CALLBACK_TIMEOUT_S
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"{shlex.join(argv)} failed: {error}"
    if probe.returncode != 0:
        return f"{shlex.join(argv)} failed ({probe.returncode}): {(probe.stdout + probe.stderr).strip()}"
    return None


def main(argv=None, environ=None, run_version=mpi.run_version_query):
    """Entry point of ``kerasdist-run``; returns the exit status.

    ``environ`` and ``run_version`` (mpiexec path -> its ``--version`` output) are for tests.
    When the reader of its output has gone (``kerasdist-run --check-build | head -3``), it stops
    quietly with the status of a program ended by SIGPIPE, as ``cat`` would.
    """
    try:
        try:
            return _launch(argv, environ, run_version)
        finally:
            sys.stdout.flush()  # here, where a closed pipe can still be caught, not at exit
    except BrokenPipeError:
        output.point_at_devnull(sys.stdout)
        return CLOSED_PIPE_STATUS


def _launch(argv, environ, run_version):
    environ = os.environ if environ is None else environ
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.check_build:
        return check_build(environ, run_version)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.num_processes is None:
        parser.error("argument -np/-n is required: the number of processes to start")
    if not command:
        parser.error(f"no command to run: put it after the options, e.g. {PROG} -np 2 train.py")
    if args.host_discovery_script and not args.min_np:
        parser.error("--host-discovery-script needs --min-np: the hosts it lists are used to restart on fewer ranks")
    if args.min_np:
        if not args.restarts:
            parser.error("--min-np needs --restarts N: it chooses the hosts and ranks of each restart")
        if args.hostfile:
            parser.error(
                "--min-np does not read --hostfile (your MPI's own format): give the hosts as "
                "-H HOST:SLOTS,... or --host-discovery-script"
            )
        if not (args.hosts or args.host_discovery_script):
            parser.error("--min-np needs the hosts it may choose from: -H HOST:SLOTS,... or --host-discovery-script")
        if args.min_np > args.num_processes:
            parser.error(f"--min-np {args.min_np} is more than the {args.num_processes} ranks planned (-np)")
    given_command = command
    if command[0].endswith(".py") and os.path.isfile(command[0]):
        command = [sys.executable, *command]

    environment = rank_environment(args, environ)
    try:
        knobs.Knobs.from_environment(environment)  # the check every rank would make, once, here
    except ValueError as error:
        parser.error(f"{error} (from the environment)")
    try:
        mpiexec, flavour, _ = launch_mpiexec(environ, read_build_info(), run_version)
    except mpi.LaunchError as error:
        parser.error(str(error))

    if args.network_interface:
        environment.update(mpi.interface_environment(flavour, args.network_interface, environ))

    if args.min_np:
        environment[runtime.PLANNED_SIZE_VARIABLE] = str(args.num_processes)

    # The job's output passes through the launcher, which puts each rank's lines back together
    # from mpiexec's tags; not when sys.stdout or sys.stderr was replaced by a text-only stream.
    stdout, stderr = (getattr(stream, "buffer", None) for stream in (sys.stdout, sys.stderr))
    passes_output_on = stdout is not None and stderr is not None
    rank_tag = flavour.rank_tag if passes_output_on else None
    tag_ranks = rank_tag is not None or args.prepend_rank

    def launch_command(attempt, num_processes=args.num_processes, host_list=args.hosts):
        return mpi.build_command(
            mpiexec,
            flavour,
            num_processes,
            command,
            hosts=host_list,
            hostfile=args.hostfile,
            environment={**environment, RESTART_VARIABLE: str(attempt)} if args.restarts else environment,
            mpi_args=args.mpi_args,
            launcher_exec=args.launcher_exec,
            network_interface=args.network_interface,
            tag_ranks=tag_ranks,
        )

    def probe_command(host_name):
        return mpi.build_command(
            mpiexec,
            flavour,
            1,
            ["true"],
            hosts=f"{host_name}:1",
            mpi_args=args.mpi_args,
            launcher_exec=args.launcher_exec,
            network_interface=args.network_interface,
        )

    if args.dry_run:
        try:
            ranks, host_list = (
                _placement(args, environ, probe_command=None) if args.min_np else (args.num_processes, args.hosts)
            )
        except mpi.LaunchError as error:
            print(f"{PROG}: error: {error}", file=sys.stderr)
            return 1
        print(shlex.join(launch_command(0, ranks, host_list)))
        return 0
    local_job = not (args.hosts or args.hostfile or args.host_discovery_script)
    # Hosts another launcher program reaches, or --min-np probes itself, may not resolve here.
    if args.hosts and not (args.launcher_exec or args.min_np):
        unknown = [host.name for host in hosts.parse_host_list(args.hosts) if not hosts.resolves(host.name, environ)]
        if unknown:
            print(
                f"{PROG}: error: -H names host(s) that neither DNS nor ssh's configuration resolves: "
                f"{', '.join(unknown)}",
                file=sys.stderr,
            )
            return USAGE_ERROR
    # On other hosts the program may be another Python than here; only a local job is checked.
    if is_python(command[0]) and local_job:
        problem = interpreter_problem(command, environ)
        if problem:
            instead = _what_to_run_instead(argv, given_command, environ)
            print(f"{PROG}: error: every rank would run {problem}\n{instead}", file=sys.stderr)
            return USAGE_ERROR
    problem = _missing_program_or_script(command, local_job, environ)
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return USAGE_ERROR
    if _hydra_starts_proxies_with_srun_from_outside(args, flavour, environ):
        address = socket.gethostname()
        if args.network_interface:
            try:
                address = _interface_address(args.network_interface)
            except OSError as error:
                print(
                    f"{PROG}: error: no IPv4 address on --network-interface {args.network_interface}: {error}",
                    file=sys.stderr,
                )
                return USAGE_ERROR
            args.mpi_args = ["-localhost", address, *args.mpi_args]  # the user's own -localhost wins
        problem = _slurm_callback_problem(address, environ)
        if problem:
            print(
                f"{PROG}: error: in Slurm allocation {environ['SLURM_JOB_ID']} from {socket.gethostname()}, outside "
                f"it, hydra starts its proxies on the allocation's nodes with srun and they connect back to "
                f"{address}; that failed, and hydra would wait for them without end. Give --network-interface "
                f"naming this host's interface on the nodes' network, or run {PROG} on a node of the allocation "
                f"(in the sbatch script, or after `srun --pty bash` in salloc).\n{problem}",
                file=sys.stderr,
            )
            return 1
    notice_name = knobs.Knobs.from_environment(environment).notice_signal
    notice_signal = None if notice_name == "off" else getattr(signal, f"SIG{notice_name}")
    status = 1  # what a refusal to start reports, until an attempt has run
    failures, attempt, leaving = 0, -1, set()
    while True:
        attempt += 1
        ranks, host_list = args.num_processes, args.hosts
        if args.min_np:
            try:
                ranks, host_list = _placement_stopping_on_signals(args, environ, probe_command, leaving)
            except mpi.LaunchError as error:
                again = " again" if attempt else ""
                print(f"{PROG}: error: {error}; not starting the job{again}", file=sys.stderr, flush=True)
                return status
        launch = launch_command(attempt, ranks, host_list)
        if args.verbose:
            print(shlex.join(launch), file=sys.stderr, flush=True)
        job_output = (
            output.JobOutput(stdout, stderr, rank_tag, prepend_rank=args.prepend_rank) if passes_output_on else None
        )
        noticed_launcher = []
        growing = []  # gets True once the job is asked to stop so as to grow
        wants_to_grow = _growth_check(args, environ, probe_command, leaving, ranks, growing) if args.min_np else None
        try:
            status = run_forwarding_signals(launch, job_output, notice_signal, noticed_launcher, wants_to_grow)
        except OSError as error:
            print(f"{PROG}: error: cannot run {mpiexec}: {error}", file=sys.stderr)
            return 127
        if status == knobs.NOTICE_EXIT_STATUS and notice_signal and growing and not noticed_launcher:
            print(
                f"{PROG}: the job stopped at a step boundary to grow; starting it again, from the checkpoint of "
                "that step (this does not count against --restarts)",
                file=sys.stderr,
                flush=True,
            )
            continue
        if status == knobs.NOTICE_EXIT_STATUS and notice_signal:
            if not _restart_after_notice(args, notice_name, noticed_launcher, job_output, leaving):
                return status
            continue
        if status == 0 or status in STOP_STATUSES or failures == args.restarts:
            return status
        failures += 1
        print(
            f"{PROG}: the job ended with status {status}; starting it again (restart {failures} of {args.restarts})",
            file=sys.stderr,
            flush=True,
        )
