"""What ranks print reaches the launcher's output in whole lines, and says which rank printed it
where that is asked for (`kerasdist-run --prepend-rank`) or where a rank fails.

Ranks printing at once used to splice each other's lines: 227 of 40,000 in a probe, and plain
prints at 2 ranks. Two causes, each with a test: mpiexec forwards a rank's output in the pieces
it reads, which `kerasdist-run` now puts back together from the tags it asks mpiexec for
(`output.JobStream`); and Python writing a line in several pieces (PYTHONUNBUFFERED: a write per
print argument), which `kerasdist.init()` makes one write a line, so that hydra forwards lines up
to 4 KiB whole under a plain mpiexec too. The scripts print with PYTHONUNBUFFERED=1, where the
pieces are many.
"""

import io
import os
import re
import sys
import threading
import time
from collections import Counter

import pytest
from launch_utils import LAUNCH_TEST_MARKS, MPIEXEC, SCRIPTS, child_env, run_job

from kerasdist.run import mpi, output

pytestmark = LAUNCH_TEST_MARKS
LAUNCHER = [sys.executable, "-m", "kerasdist.run"]
RANKS = 3
LINES = 3000
# Up to 5 times a pipe's atomic write, which no mpiexec forwards in one piece.
LONG_LINE_LENGTHS = "10,100,1000,3000,8000,20000"
# Within a pipe's atomic 4 KiB write, which hydra forwards whole.
SHORT_LINE_LENGTHS = "10,100,1000,3000"
LINE = re.compile(r"(?P<prefix>\[\d+\] )?LINE rank=(?P<rank>\d+) n=(?P<n>\d+) (?P<x>x*) END")


def _check_lines(job, lengths, prefixed=False):
    """Every line of every rank arrived once, whole, and in its rank's order; with ``prefixed``,
    under the prefix of the rank that printed it."""
    assert job.returncode == 0 and not job.timed_out, job.describe(2000)
    lengths = [int(length) for length in lengths.split(",")]
    printed = [line for line in job.output.splitlines() if "LINE rank=" in line]
    whole = [LINE.fullmatch(line) for line in printed]
    spliced = [line[:200] for line, match in zip(printed, whole) if match is None]
    assert not spliced, f"{len(spliced)} of {len(printed)} lines spliced, e.g. {spliced[:3]}"
    by_rank = {}
    for match in whole:
        rank, n = int(match["rank"]), int(match["n"])
        assert len(match["x"]) == lengths[n % len(lengths)], (rank, n, len(match["x"]))
        assert (match["prefix"] == f"[{rank}] ") if prefixed else match["prefix"] is None, match[0][:80]
        by_rank.setdefault(rank, []).append(n)
    assert by_rank == {rank: list(range(LINES)) for rank in range(RANKS)}


def test_kerasdist_run_passes_each_rank_s_lines_on_whole_however_mpiexec_cut_them(tmp_path):
    script = [sys.executable, SCRIPTS / "many_lines.py", str(LINES), LONG_LINE_LENGTHS]
    job = run_job([*LAUNCHER, "-np", str(RANKS), *script], tmp_path, child_env(PYTHONUNBUFFERED=1), timeout=300)
    _check_lines(job, LONG_LINE_LENGTHS)


def test_prepend_rank_starts_every_line_with_the_rank_that_printed_it(tmp_path):
    script = [sys.executable, SCRIPTS / "many_lines.py", str(LINES), LONG_LINE_LENGTHS]
    argv = [*LAUNCHER, "-np", str(RANKS), "--prepend-rank", *script]
    job = run_job(argv, tmp_path, child_env(PYTHONUNBUFFERED=1), timeout=300)
    _check_lines(job, LONG_LINE_LENGTHS, prefixed=True)
    done = sorted(line for line in job.output.splitlines() if "RANK_DONE" in line)
    assert done == [f"[{rank}] RANK_DONE rank={rank}" for rank in range(RANKS)]


def test_after_init_a_plain_mpiexec_gets_each_line_in_one_write(tmp_path):
    script = [sys.executable, SCRIPTS / "many_lines.py", str(LINES), SHORT_LINE_LENGTHS, "--init"]
    job = run_job([MPIEXEC, "-n", str(RANKS), *script], tmp_path, child_env(PYTHONUNBUFFERED=1), timeout=300)
    _check_lines(job, SHORT_LINE_LENGTHS)


def test_a_rank_s_traceback_comes_under_a_line_naming_the_rank(tmp_path):
    argv = [*LAUNCHER, "-np", "2", "--prepend-rank", sys.executable, SCRIPTS / "raise_on_rank.py", "allreduce"]
    job = run_job(argv, tmp_path, child_env(), timeout=120, script_name="raise_on_rank.py")
    assert job.returncode != 0 and not job.timed_out, job.describe()
    lines = job.output.splitlines()
    heading = next(i for i, line in enumerate(lines) if "raised an uncaught exception" in line)
    assert re.fullmatch(r"\[1\] kerasdist: rank 1 \(host \S+\) raised an uncaught exception:", lines[heading])
    traceback = lines[heading + 1 : lines.index("[1] RuntimeError: deliberate failure on rank 1") + 1]
    assert traceback[0] == "[1] Traceback (most recent call last):", job.describe()
    assert all(line.startswith("[1] ") for line in traceback), job.describe()


# ---- the launcher's side, piece by piece --------------------------------------------------

HYDRA_TAG = mpi.MPICH.rank_tag
OPEN_MPI_TAG = mpi.OPEN_MPI.rank_tag


def _passed_on(pieces, rank_tag, prepend_rank=False, pause_s=0.0):
    """What a JobStream writes of ``pieces`` written to it one by one, ``pause_s`` apart."""
    shown = io.BytesIO()
    read_end, write_end = os.pipe()
    copier = threading.Thread(target=output.JobStream(shown, rank_tag, prepend_rank).copy, args=(read_end,))
    copier.start()
    for piece in pieces:
        os.write(write_end, piece)
        time.sleep(pause_s)
    os.close(write_end)
    copier.join(30)
    os.close(read_end)
    return shown.getvalue().decode()


def test_pieces_of_ranks_cut_mid_line_are_put_back_together():
    # What Open MPI 4.1 forwarded of two ranks' lines (seen with Debian's mpiexec.openmpi).
    pieces = [b"[1,0]<stdout>:a0[1,1]<stdout>:a1[1,0]<stdout>:b0\n[1,0]<stdout>:c0\n[1,1]<stdout>:b1\n"]
    assert _passed_on(pieces, OPEN_MPI_TAG).splitlines() == ["a0b0", "c0", "a1b1"]
    assert _passed_on(pieces, OPEN_MPI_TAG, prepend_rank=True).splitlines() == ["[0] a0b0", "[0] c0", "[1] a1b1"]


def test_a_tag_cut_between_two_reads_still_names_its_rank():
    pieces = [b"[0]<kerasdist>:one [1]<kera", b"sdist>:two\n[0]<kerasdist>:done\n"]
    assert _passed_on(pieces, HYDRA_TAG, prepend_rank=True, pause_s=0.05).splitlines() == ["[1] two", "[0] one done"]


def test_mpiexec_s_own_lines_pass_as_they_are():
    pieces = [b"[0]<kerasdist>:hello\n===  BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"]
    assert _passed_on(pieces, HYDRA_TAG, prepend_rank=True).splitlines() == [
        "[0] hello",
        "===  BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES",
    ]


def test_a_line_whose_end_waits_goes_out_and_the_next_rank_s_line_starts_anew():
    wait = output.PARTIAL_LINE_WAIT_S + 0.3
    pieces = [b"[0]<kerasdist>:50% of the epoch", b"[1]<kerasdist>:rank 1 done\n", b"[0]<kerasdist>: then 100%\n"]
    shown = _passed_on(pieces, HYDRA_TAG, prepend_rank=True, pause_s=wait)
    assert shown.splitlines() == ["[0] 50% of the epoch", "[1] rank 1 done", "[0]  then 100%"]


def test_a_progress_bar_goes_out_at_each_carriage_return_without_waiting():
    pieces = [b"[0]<kerasdist>:\r 1/10 [=>   ]", b"[1]<kerasdist>:rank 1 line\n", b"[0]<kerasdist>:\r 2/10 [==>  ]"]
    started = time.monotonic()
    shown = io.BytesIO()
    read_end, write_end = os.pipe()
    copier = threading.Thread(target=output.JobStream(shown, HYDRA_TAG).copy, args=(read_end,))
    copier.start()
    for piece in pieces:
        os.write(write_end, piece)
    while b" 1/10 [=>   ]\r" not in shown.getvalue() and time.monotonic() - started < 10:
        time.sleep(0.01)
    drawn_before_the_wait_is_over = shown.getvalue()
    os.close(write_end)
    copier.join(30)
    os.close(read_end)
    assert drawn_before_the_wait_is_over.endswith(b" 1/10 [=>   ]\r")
    assert shown.getvalue() == b"\r\nrank 1 line\n 1/10 [=>   ]\r 2/10 [==>  ]"


@pytest.mark.parametrize("rank_tag", [HYDRA_TAG, OPEN_MPI_TAG, None], ids=["hydra", "Open MPI", "untagged"])
def test_a_last_line_without_its_newline_goes_out_as_it_is(rank_tag):
    tag = {HYDRA_TAG: b"[0]<kerasdist>:", OPEN_MPI_TAG: b"[1,0]<stdout>:", None: b""}[rank_tag]
    assert _passed_on([tag + b"first\n" + tag + b"last"], rank_tag) == "first\nlast"


def test_lines_of_every_rank_are_counted_once():
    pieces = [b"[%d]<kerasdist>:line %d\n" % (rank, n) for n in range(50) for rank in range(3)]
    shown = _passed_on([b"".join(pieces)], HYDRA_TAG).splitlines()
    assert Counter(shown) == Counter(f"line {n}" for n in range(50) for _ in range(3))
