"""The job's stdout and stderr as the launcher passes them on: each rank's lines whole, optionally
after ``[rank]``, and TensorFlow's start-up notices once, not once per rank.

mpiexec forwards what each rank writes in the pieces it reads, and pieces of different ranks
that meet on one stream splice lines (``JobStream`` puts them back together). Inside a rank,
``kerasdist.init()`` makes Python write whole lines, which also helps under a plain mpiexec.

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
import threading
import time

from kerasdist import knobs

# A line's start waits this long for its end, then goes out as it is (a prompt). The rest of a
# line mpiexec read in pieces comes at once, but a loaded host can hold mpiexec back for a moment
# (Open MPI stopped forwarding for over 0.5 s under 16 MB/s of long lines). A progress bar redrawn
# with \r goes out at each \r instead, without waiting.
PARTIAL_LINE_WAIT_S = 2.0
# What the engine writes (watchdog.cc's EndJob) when a rank ends the job on purpose: a collective
# made no progress for KERASDIST_COLLECTIVE_TIMEOUT_S, so a rank or a link is gone.
RANK_ENDS_JOB = b"so that the launcher ends the job"
# What a rank given notice to leave says (knobs.NOTICE_LINE), with its host as group 1.
NOTICE_LINE = re.compile(
    re.escape(knobs.NOTICE_LINE.format(rank="RANK", host="HOST"))
    .replace("RANK", r"\d+")
    .replace("HOST", r"(\S+)")
    .encode()
)
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


class JobStream:
    """One of the job's output streams, stdout or stderr, as the launcher passes it on.

    mpiexec forwards each rank's output in pieces as it reads them, and a line that one rank
    writes in pieces (``print`` under ``PYTHONUNBUFFERED`` writes the text and the newline apart)
    or that Open MPI 4 reads in pieces (it cuts even short lines) had another rank's line spliced
    into it. Given ``rank_tag``, the pattern of the tag mpiexec was asked to put before each piece
    (``mpi.Flavour.rank_tag``), the pieces of each rank are put back together and only whole
    lines go out. A line whose end has not come ``PARTIAL_LINE_WAIT_S`` after its start (a
    prompt) goes out as far as it has come, and a progress bar redrawn with ``\\r`` goes out up
    to its last ``\\r``; a line of another rank then starts on a line of its own. Text without a
    tag is mpiexec's own.

    Args:
        destination: the binary stream to write to (the launcher's own stdout or stderr).
        rank_tag: a bytes pattern whose group 1 is the rank, or None: mpiexec tags nothing, and
            the stream goes out as it comes, a line at a time.
        prepend_rank: start each line of a rank with ``[rank] ``.
        startup_notices_once: leave out each TensorFlow start-up notice already passed on.
        rank_ended_job: a ``threading.Event`` set when a line says a rank ends the job.
        noticed_hosts: a set that gets the host of each line saying a rank was given notice to leave.
        reader_gone: a ``threading.Event`` set when ``destination`` is a pipe whose reader has
            gone; what follows is read and dropped.

    Example:

    ```python
    import io, os, re
    from kerasdist.run.output import JobStream
    shown = io.BytesIO()
    read_end, write_end = os.pipe()
    os.write(write_end, b"<0>:epoch 1 <1>:epoch 1 done\\n<0>:done\\n")  # rank 0's line came in two pieces
    os.close(write_end)
    JobStream(shown, rank_tag=re.compile(rb"<(\\d+)>:"), prepend_rank=True).copy(read_end)
    os.close(read_end)
    print(shown.getvalue().decode().splitlines())  # ['[1] epoch 1 done', '[0] epoch 1 done']
    ```
    """

    def __init__(
        self,
        destination,
        rank_tag=None,
        prepend_rank=False,
        startup_notices_once=False,
        rank_ended_job=None,
        reader_gone=None,
        noticed_hosts=None,
    ):
        self._destination = destination
        self._noticed_hosts = noticed_hosts
        self._rank_tag = rank_tag
        self._prepend_rank = prepend_rank
        self._notices_seen = set() if startup_notices_once else None
        self._rank_ended_job = rank_ended_job
        self._reader_gone = reader_gone
        self._unparsed = b""  # read, but may be the start of a tag cut by the read
        self._unparsed_since = None
        self._piece_rank = None  # whose piece the stream is in (None: mpiexec's own text)
        self._at_line_start = True
        self._line_starts = {}  # rank (None: mpiexec's own text) -> the start of its current line
        self._waiting_since = {}  # rank -> when its line's start came
        self._unfinished = _NOBODY  # whose line went out without its end

    def copy(self, source_fd):
        """Copies everything readable from ``source_fd`` until end of file."""
        while True:
            due = self._seconds_until_a_wait_is_over()
            if due is not None and not select.select([source_fd], [], [], due)[0]:
                self._write_what_waited(time.monotonic())
                self._flush()
                continue
            chunk = os.read(source_fd, READ_SIZE)
            if not chunk:
                break
            if not self._unparsed:
                self._unparsed_since = time.monotonic()
            self._unparsed += chunk
            self._take_pieces(at_end=False)
            self._write_what_waited(time.monotonic())
            self._flush()
        self._write_what_waited(time.monotonic(), at_end=True)
        self._flush()

    def _seconds_until_a_wait_is_over(self):
        started = list(self._waiting_since.values())
        if self._unparsed:
            started.append(self._unparsed_since)
        if not started:
            return None
        return max(0.0, min(started) + PARTIAL_LINE_WAIT_S - time.monotonic())

    def _take_pieces(self, at_end):
        """Splits what was read into pieces, each of one rank and ending at a newline or before
        the next tag. mpiexec tags each piece it forwards and each line in it, so text without a
        tag continues the piece before it, unless it starts a line: then it is mpiexec's own
        (rank None). Keeps back what may be the start of a tag cut by the read, unless ``at_end``."""
        text, position, came = self._unparsed, 0, self._unparsed_since
        while position < len(text):
            tag = self._rank_tag.match(text, position) if self._rank_tag else None
            if tag:
                self._piece_rank, body = int(tag.group(1)), tag.end()
            elif self._at_line_start:
                self._piece_rank, body = None, position
            else:
                body = position
            end = text.find(b"\n", body) + 1 or len(text)
            next_tag = self._rank_tag.search(text, body, end) if self._rank_tag else None
            if next_tag:
                end = next_tag.start()
            elif end == len(text) and not text.endswith(b"\n") and not at_end:
                end = self._before_a_cut_tag(text, body)
                if end == body and not tag:
                    break
            self._add_to_line(self._piece_rank, text[body:end], came)
            self._at_line_start = text[end - 1 : end] == b"\n" if end > body else self._at_line_start and not tag
            position = end
        self._unparsed = text[position:]
        self._unparsed_since = came if self._unparsed else None

    def _before_a_cut_tag(self, text, start):
        """Where the end of ``text`` may hold the start of a tag whose rest is not read yet (from
        its last ``[``, the first byte of every tag), or its end."""
        if self._rank_tag is None:
            return len(text)
        bracket = text.rfind(b"[", start)
        return bracket if bracket != -1 and len(text) - bracket < _LONGEST_TAG else len(text)

    def _add_to_line(self, rank, piece, came):
        line = self._line_starts.get(rank, b"") + piece
        if line.endswith(b"\n"):
            self._line_starts.pop(rank, None)
            self._waiting_since.pop(rank, None)
            self._write_line(rank, line)
            return
        redrawn = line.rfind(b"\r") + 1  # what comes before a \r is drawn over: it is done
        if redrawn:
            self._waiting_since.pop(rank, None)
            self._write(rank, line[:redrawn], ends_line=False)
            line = line[redrawn:]
        if line:
            self._line_starts[rank] = line
            self._waiting_since.setdefault(rank, came)
        else:
            self._line_starts.pop(rank, None)

    def _write_line(self, rank, line):
        text = line[:-1]
        if self._rank_ended_job is not None and RANK_ENDS_JOB in text:
            self._rank_ended_job.set()
        if self._noticed_hosts is not None:
            noticed = NOTICE_LINE.search(text)
            if noticed:
                self._noticed_hosts.add(noticed.group(1).decode(errors="replace"))
        if self._notices_seen is not None and self._unfinished != rank:
            key = startup_notice_key(text)
            if key in self._notices_seen:
                return
            if key is not None:
                self._notices_seen.add(key)
        self._write(rank, line, ends_line=True)

    def _write_what_waited(self, now, at_end=False):
        """Writes the pieces whose end has waited too long (all of them ``at_end``) as they are."""
        if self._unparsed and (at_end or now - self._unparsed_since >= PARTIAL_LINE_WAIT_S):
            self._take_pieces(at_end=True)
        for rank, since in sorted(self._waiting_since.items(), key=lambda item: item[1]):
            if at_end or now - since >= PARTIAL_LINE_WAIT_S:
                del self._waiting_since[rank]
                self._write(rank, self._line_starts.pop(rank), ends_line=False)

    def _write(self, rank, text, ends_line):
        out = b""
        if self._unfinished is not _NOBODY and self._unfinished != rank:
            out = b"\n"  # another rank's line went out without its end: this one starts anew
        if self._unfinished != rank and self._prepend_rank and rank is not None:
            out += b"[%d] " % rank
        self._unfinished = _NOBODY if ends_line else rank
        self._send(out + text)

    def _send(self, data):
        try:
            self._destination.write(data)
        except BrokenPipeError:
            self._stop_writing()

    def _flush(self):
        try:
            self._destination.flush()
        except BrokenPipeError:
            self._stop_writing()

    def _stop_writing(self):
        point_at_devnull(self._destination)
        if self._reader_gone is not None:
            self._reader_gone.set()


_NOBODY = object()  # no rank's line is unfinished on the destination
# Longer than hydra's "[rank]<kerasdist>:" or Open MPI's "[job,rank]<stdout>:".
_LONGEST_TAG = 64


def point_at_devnull(stream):
    """Points ``stream``'s file descriptor at /dev/null: after its reader has gone, what is left
    in its buffer goes nowhere instead of failing again, with a traceback, at exit."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    except (OSError, ValueError):  # a stream without a file descriptor
        pass


class JobOutput:
    """The job's stdout and stderr, each passed on by a thread of its own (a ``JobStream``).

    ``rank_ended_job`` is set when a line on stderr says a rank ends the job; ``reader_gone``
    when the reader of the launcher's stdout or stderr has gone (``kerasdist-run ... | head``).
    ``noticed_hosts`` holds the hosts whose ranks said on stderr that they were given notice to leave.
    """

    def __init__(self, stdout, stderr, rank_tag=None, prepend_rank=False):
        self.rank_ended_job = threading.Event()
        self.reader_gone = threading.Event()
        self.noticed_hosts = set()
        self._streams = (
            JobStream(stdout, rank_tag, prepend_rank, reader_gone=self.reader_gone),
            JobStream(
                stderr,
                rank_tag,
                prepend_rank,
                startup_notices_once=True,
                rank_ended_job=self.rank_ended_job,
                reader_gone=self.reader_gone,
                noticed_hosts=self.noticed_hosts,
            ),
        )
        self._threads = []

    def start(self, stdout_fd, stderr_fd):
        """Starts copying the job's stdout and stderr, read from these file descriptors."""
        for stream, fd in zip(self._streams, (stdout_fd, stderr_fd)):
            thread = threading.Thread(target=stream.copy, args=(fd,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def join(self, timeout):
        """Waits up to ``timeout`` seconds in all for both copies to reach the end of their stream."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
