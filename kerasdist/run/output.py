"""The job's stderr as the launcher passes it on: TensorFlow's start-up notices once, not once per rank.

Every rank prints the same notices while ``import tensorflow`` loads its libraries, and some of
them even at ``TF_CPP_MIN_LOG_LEVEL=3``: absl writes every message logged before
``absl::InitializeLog()`` to stderr, and TensorFlow logs its oneDNN notice then (TensorFlow
2.21 even twice per rank). The launcher drops a notice it has already passed
on; every other byte, errors included, goes through unchanged and in order.

Under your own mpiexec, srun or a site wrapper nothing filters, and kerasdist cannot help from
inside a rank: a script imports TensorFlow, which prints the notices, before kerasdist runs, and
only redirecting the rank's stderr would hide them, along with its errors. There,
``TF_CPP_MIN_LOG_LEVEL=2`` removes the CPU-feature notice and TensorFlow's later C++ INFO and
WARNING lines (on every rank alike), but not the absl and oneDNN ones.
"""

import os
import re
import select

# A partial line (a prompt, a progress bar redrawn with \r) waits this long for its end, then
# goes out as it is: start-up notices arrive whole, each in one write.
PARTIAL_LINE_WAIT_S = 0.1
# What the engine writes (watchdog.cc's EndJob) when a rank ends the job on purpose: a collective
# made no progress for KERASDIST_COLLECTIVE_TIMEOUT_S, so a rank or a link is gone.
RANK_ENDS_JOB = b"so that the launcher ends the job"
READ_SIZE = 65536

# absl's log-line header is "Immdd hh:mm:ss.micros thread file:line] "; the time and thread differ
# between ranks, so the text from "file:line]" on is what identifies a notice.
_STARTUP_NOTICE = re.compile(
    rb"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    rb"|I\d{4} [0-9:.]+ +\d+ (?P<source>(?:port|cpu_feature_guard)\.cc:\d+\] .*)"
    rb"|To enable the following instructions: .* rebuild TensorFlow with the appropriate compiler flags\."
)


def startup_notice_key(line):
    """What ``line`` (bytes, without its newline) says when it is one of TensorFlow's start-up
    notices, without the parts that differ between ranks; None for any other line.

    Example:

    ```python
    from kerasdist.run.output import startup_notice_key
    notice = b"I0000 00:00:1796111508.473692    5579 port.cc:153] oneDNN custom operations are on."
    print(startup_notice_key(notice))  # b'port.cc:153] oneDNN custom operations are on.'
    error = b"E0000 00:00:1796111508.473692    5579 port.cc:153] out of memory"
    print(startup_notice_key(error))  # None
    ```
    """
    match = _STARTUP_NOTICE.fullmatch(line.rstrip(b"\r"))
    if match is None:
        return None
    return match.group("source") or match.group(0)


def copy_showing_startup_notices_once(source_fd, destination, rank_ended_job=None):
    """Copies everything readable from ``source_fd`` to the binary stream ``destination`` until
    end of file, leaving out each TensorFlow start-up notice already copied; sets the
    ``rank_ended_job`` event (a ``threading.Event``) when a line says a rank ends the job."""
    seen = set()
    pending = b""  # the start of a line whose end has not arrived
    while True:
        if pending and not select.select([source_fd], [], [], PARTIAL_LINE_WAIT_S)[0]:
            destination.write(pending)
            destination.flush()
            pending = b""
            continue
        chunk = os.read(source_fd, READ_SIZE)
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if rank_ended_job is not None and RANK_ENDS_JOB in line:
                rank_ended_job.set()
            key = startup_notice_key(line)
            if key is not None:
                if key in seen:
                    continue
                seen.add(key)
            destination.write(line + b"\n")
        destination.flush()
    destination.write(pending)
    destination.flush()
