"""Shared pytest setup for the kerasdist suites.

The same test files run as one plain process and under ``mpiexec -n N``, where
every rank runs its own pytest. This file makes that workable:

* ranks other than 0 print nothing unless one of their tests fails (then they
  print their own failure summary, headed by their rank), but every rank's exit
  status still reflects its own failures, so ``mpiexec`` fails the job;
* every test gets a timeout (thread method: stacks dumped, process ends) so a
  hang in a collective ends the job instead of eating the CI budget;
* under MPI, the ranks check that they collected the same tests in the same
  order; a divergence would pair different collectives across ranks.

Rank and size come from the launcher's environment, not from kerasdist, so a
broken library cannot break collection of the launch tests.
"""

import collections
import io
import os
import sys
import threading
import zlib

import pytest

# Must be set before TensorFlow is first imported by any test module.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# Per-test wall-clock limits (seconds). A collective that hangs is a failure;
# the limit is generous because 3 ranks share 2 cores here.
COLLECTIVE_TEST_TIMEOUT_S = 180
DEFAULT_TEST_TIMEOUT_S = 300


def launcher_rank_and_size():
    """(rank, size) as the MPI launcher announced them; (0, 1) without one."""
    for rank_var, size_var in (
        ("PMI_RANK", "PMI_SIZE"),  # MPICH hydra, Intel MPI
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),  # Open MPI
    ):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


RANK, SIZE = launcher_rank_and_size()


class _RankOutputGate(io.TextIOBase):
    """A text stream that drops writes until opened.

    Writes from threads other than the main thread always pass: that is where
    pytest-timeout dumps the stacks of a hung rank, which we want to see.
    """

    def __init__(self, stream):
        super().__init__()
        self._stream = stream
        self.is_open = False

    def write(self, text):
        if self.is_open or threading.current_thread() is not threading.main_thread():
            self._stream.write(text)
            self._stream.flush()
        return len(text)

    def flush(self):
        self._stream.flush()

    def isatty(self):
        return False


_gate = None


class _PerRankBaseTemp:
    """Ranks sharing pytest's default temp root prune each other's numbered directories (seen:
    "error removing .../garbage-..."); with 4 or more ranks one could delete a live one. This
    must run before pytest's tmp_path plugin reads the option, hence a tryfirst plugin."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(self, config):
        if SIZE > 1 and config.option.basetemp is None:
            import getpass
            import tempfile

            # One root per checkout too: pytest empties a basetemp it is given, and suites of two
            # checkouts running at once would otherwise empty each other's.
            checkout = zlib.crc32(str(config.rootpath).encode())
            parent = os.path.join(tempfile.gettempdir(), f"kerasdist-pytest-{getpass.getuser()}-{checkout:08x}")
            os.makedirs(parent, exist_ok=True)  # pytest creates only the last level
            config.option.basetemp = os.path.join(parent, f"rank{RANK}")


def pytest_addoption(parser, pluginmanager):
    pluginmanager.register(_PerRankBaseTemp(), "kerasdist-per-rank-basetemp")


def pytest_report_header(config):
    return f"kerasdist test world (from launcher env): rank {RANK} of {SIZE}"


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    global _gate
    if RANK == 0:
        return
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if reporter is None or not hasattr(reporter, "_tw"):
        config.option.verbose = -2
        return
    from _pytest.config import create_terminal_writer

    _gate = _RankOutputGate(getattr(reporter._tw, "_file", sys.stdout))
    reporter._tw = create_terminal_writer(config, _gate)
    reporter.hasmarkup = reporter._tw.hasmarkup


# Under pytest-xdist, `make test` runs the one-process suite on two workers with `--dist loadfile`:
# a file's tests stay on one worker, so its module fixtures (the pip-install tests' venvs, a
# compiled test program) are made once. Not `loadgroup`: with pytest 9.2 it silently ignores its
# groups (pytest-xdist issue #1386), which is how the install venvs came to be built twice each.
# Files on both workers may start emulated hosts and Slurms at once: each cluster picks its own
# names, addresses and ports. The order xdist hands out files (`--no-loadscope-reorder` keeps it;
# by itself it orders by number of tests): the longest files first, so that no worker ends on
# one while the other idles, then the other files whose tests start jobs of their own (a few
# tests of a minute each), then the rest, most tests first.
# Each took 3.5-6 minutes in a CI run of 2026-12-06 (under load; the install's setup included).
LONGEST_FILES = (
    "launch/test_restarts.py",
    "launch/test_checkpoint_kill.py",
    "install/test_pip_install.py",
    "multihost/test_multihost_training.py",
    "multihost/test_fault_matrix.py",
    "slurm/test_slurm_failures.py",
)
JOB_STARTING_DIRECTORIES = ("install", "launch", "multihost", "optimizers", "slurm")


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        if item.get_closest_marker("timeout") is None:
            limit = COLLECTIVE_TEST_TIMEOUT_S if "collectives" in item.path.parts else DEFAULT_TEST_TIMEOUT_S
            item.add_marker(pytest.mark.timeout(limit, method="thread"))
    if hasattr(config, "workerinput"):  # an xdist worker: its collection is what xdist schedules
        _order_for_workers(config, items)
    if SIZE > 1:
        _check_same_tests_on_every_rank(items)


def _order_for_workers(config, items):
    """Sorts whole files (a stable sort keeps each file's own order) as the comment above says."""
    tests = config.rootpath / "tests"

    def file_of(item):
        return item.path.relative_to(tests).as_posix() if item.path.is_relative_to(tests) else str(item.path)

    tests_in = collections.Counter(file_of(item) for item in items)

    def rank(item):
        file = file_of(item)
        if file in LONGEST_FILES:
            return (0, LONGEST_FILES.index(file))
        return (1 if file.split("/")[0] in JOB_STARTING_DIRECTORIES else 2, -tests_in[file], file)

    items.sort(key=rank)


def _check_same_tests_on_every_rank(items):
    # mpi4py, not kerasdist: this check must not depend on the code under test.
    from mpi4py import MPI

    ids = [item.nodeid for item in items]
    digest = zlib.crc32("\n".join(ids).encode())
    digests = MPI.COMM_WORLD.allgather((digest, len(ids)))
    if len(set(digests)) != 1:
        # Every rank sees the same gathered list, so every rank stops here.
        raise pytest.UsageError(
            "ranks collected different tests (crc32, count) per rank: "
            f"{digests}; collectives would pair up wrongly. Run the same "
            "command line on every rank and avoid rank-dependent collection."
        )


def pytest_sessionfinish(session, exitstatus):
    failed_here = bool(session.testsfailed) or exitstatus not in (0, 5)
    if _gate is not None and failed_here:
        _gate.is_open = True
        _gate.write(f"\n===== rank {RANK} of {SIZE}: this rank's results =====\n")
    if SIZE > 1:
        _report_other_ranks(session, failed_here)


def _report_other_ranks(session, failed_here):
    """Rank 0's summary and exit status speak for the whole world."""
    from mpi4py import MPI

    failed = MPI.COMM_WORLD.allgather((failed_here, session.testsfailed))
    bad = [f"rank {r} ({n} failed)" for r, (is_bad, n) in enumerate(failed) if is_bad and r != RANK]
    if RANK == 0 and bad:
        reporter = session.config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            reporter.write_sep("!", "failures on other ranks: " + ", ".join(bad) + "; each prints its own report")
        if session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
