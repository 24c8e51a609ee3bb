"""How a rank of a job of several ends, and what it says: what ``init()`` installs so that no exit
leaves the others waiting and every failure names its rank.

An uncaught exception aborts the job, its traceback under a line naming the rank; ``sys.exit(n)``
and ``os._exit(n)`` are remembered, so that ``shutdown()`` can end the job with the status the
program chose (see ``requested_status``); and ``os._exit`` shuts kerasdist down first. Python
writes stdout and stderr a line at a time, so that mpiexec forwards whole lines. A job of one
rank installs none of it.
"""

import os
import sys
import threading
import time
import traceback


def install(MPI, shutdown, running_rank):
    """Installs the three hooks and writes output a line at a time; `shutdown` is kerasdist's,
    `running_rank()` this process's rank while kerasdist runs (None once it has shut down)."""
    _write_whole_lines()
    _abort_job_on_uncaught_exception(MPI)
    _remember_exit_status()
    _exit_through_shutdown(MPI, shutdown, running_rank)


def _write_whole_lines():
    """Makes Python write stdout and stderr a line at a time, each line in one write.

    mpiexec forwards a rank's output in the pieces it reads, and another rank's piece can land
    between two of them. Written unbuffered (``PYTHONUNBUFFERED``, ``python -u``), a ``print``
    is a write per argument and one for the newline; block-buffered (stdout to a pipe), a write
    ends wherever the buffer filled. Hydra forwards a write of up to a pipe's 4 KiB whole.
    """
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)  # absent where a stream was replaced
        if reconfigure is not None:
            reconfigure(line_buffering=True, write_through=False)


def _abort_job_on_uncaught_exception(MPI):
    """Without this, a rank that dies of an exception blocks in MPI_Finalize and the rest
    of the job waits for it forever."""
    previous = sys.excepthook

    def abort(exc_type, exc, tb):
        where = f"rank {MPI.COMM_WORLD.Get_rank()} (host {MPI.Get_processor_name()})"
        heading = f"kerasdist: {where} raised an uncaught exception:\n"
        if previous is sys.__excepthook__:
            # In one write, so that the traceback stays under its heading when ranks fail together.
            sys.stderr.write(heading + "".join(traceback.format_exception(exc_type, exc, tb)))
            sys.stderr.flush()
        else:
            sys.stderr.write(heading)
            sys.stderr.flush()
            previous(exc_type, exc, tb)
        abort_job(MPI, f"uncaught exception on {where}; aborting the job", 1)

    sys.excepthook = abort


def abort_job(MPI, message, status):
    """Says `message` and ends every rank of the job with exit status `status`."""
    sys.stderr.write(f"kerasdist: {message}\n")
    sys.stderr.flush()
    # The launcher forwards output asynchronously and an abort tears its pipes down: give it a
    # moment, or the message that explains the failure can be lost.
    time.sleep(0.5)
    MPI.COMM_WORLD.Abort(status)


# What this rank's program passed to sys.exit() or os._exit(), as an exit status; None until it
# calls one, and which of the two it called.
requested_status = None
requested_by = "sys.exit"


def _remember_exit_status():
    """Records sys.exit's status, which atexit handlers cannot otherwise see.

    A rank leaving with status n while others still run would make their pending collectives
    fail, and they would abort the job with status 1: the status the program chose would be
    lost. Knowing it, `shutdown()` ends the job with it instead.
    """
    exit_for_real = sys.exit

    def exit(status=None):
        global requested_status
        requested_status = _as_exit_status(status)
        exit_for_real(status)

    exit.__doc__ = exit_for_real.__doc__
    sys.exit = exit


_OS_EXIT_BACKSTOP_S = 10


def _exit_through_shutdown(MPI, shutdown, running_rank):
    """Makes `os._exit` in this process leave the job the way a normal exit does.

    `os._exit` skips atexit, so neither `shutdown()` nor MPI_Finalize ran: hydra then took the
    rank for one that ended early, killed the ranks still training without a word and ended the
    job with the status the rank gave, 0 included. Shutting down first makes a rank that leaves
    mid-job fail the collectives the others wait in (they end the job non-zero, as after a
    `sys.exit(0)` mid-job), and keeps the status of a non-zero `os._exit(n)`. Forked children
    (multiprocessing workers leave through `os._exit`) have no engine and exit as before.
    """
    exit_now = os._exit
    initializing_pid = os.getpid()

    def _exit(status):
        global requested_status, requested_by
        rank = running_rank()
        if rank is not None and os.getpid() == initializing_pid:
            sys.stderr.write(
                f"kerasdist: rank {rank} left with os._exit({status}); shutting kerasdist down first, "
                "so that ranks still in collectives with it fail instead of being killed silently\n"
            )
            sys.stderr.flush()
            requested_status, requested_by = _as_exit_status(status), "os._exit"
            # os._exit must end the process even if the shutdown waits (a peer frozen, or this
            # thread called it while another holds the runtime's lock, as pytest-timeout does).
            backstop = threading.Timer(_OS_EXIT_BACKSTOP_S, exit_now, args=(_as_exit_status(status) or 1,))
            backstop.daemon = True
            backstop.start()
            shutdown()
            if not MPI.Is_finalized():
                MPI.Finalize()
        exit_now(status)

    _exit.__doc__ = exit_now.__doc__
    os._exit = _exit


def _as_exit_status(status):
    """The process exit status Python gives `sys.exit(status)`."""
    if status is None:
        return 0
    if isinstance(status, int) and not isinstance(status, bool):
        return status & 0xFF
    return 1  # a message: Python prints it and exits 1
