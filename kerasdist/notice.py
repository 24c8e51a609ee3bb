"""A notice to leave (a preemption notice, `scancel --signal`): the signal `KERASDIST_NOTICE_SIGNAL`
names, caught from `init()` on, so that `StopAgreement` can stop `fit` at a step boundary.

MPICH installs a SIGUSR1 handler of its own from C, which swallowed the signal: a rank given
notice went on as if nothing had come. From `init()` on, the signal sets `notice_state.received`
instead, and one that comes outside `fit` is said on stderr at once. `kerasdist.notice_received`
is the check for a training loop of one's own.
"""

import os
import signal
import threading


class _NoticeState:
    """This process's notice: whether it came, and where it stopped `fit` (what `Rank0Checkpoint`
    saves)."""

    def __init__(self):
        self.signal = None  # the notice signal this process handles, once `install` ran
        self.rank = None
        self.received = False  # the signal came and no fit has stopped on it yet
        self.in_fit = False
        self.taken_at = None  # (epoch, batches of it done) once every rank agreed to stop on a notice
        self.saved = False  # Rank0Checkpoint saved that step
        self.announced = False  # notice_received said so on stderr (the line kerasdist-run reads)


notice_state = _NoticeState()


def install(signal_name, rank):
    """Catches the signal named `signal_name` ("USR1", ...; "off": nothing) for the rest of the
    process; True when it is caught. Python runs handlers in the main thread only, so from
    another thread nothing is installed (and False returned)."""
    if notice_state.signal is not None:
        return True
    if signal_name == "off" or threading.current_thread() is not threading.main_thread():
        return False
    notice_state.signal, notice_state.rank = getattr(signal, f"SIG{signal_name}"), rank
    signal.signal(notice_state.signal, _on_notice)
    return True


def _on_notice(signum, frame):
    notice_state.received = True
    if not notice_state.in_fit:
        # os.write: a print here could land inside a print of the interrupted code.
        os.write(
            2,
            f"kerasdist: rank {notice_state.rank} got the notice signal {signal.Signals(signum).name} outside "
            "fit: the next fit with kerasdist.callbacks() stops at its first update's end; a loop of your own "
            "must call kerasdist.notice_received()\n".encode(),
        )
