"""What ranks print under Open MPI reaches `kerasdist-run`'s output in whole lines, with the rank
in front where asked for. Open MPI 4.1 forwards a rank's stdout in the pieces it reads from the
terminal it gives the rank, cutting even short lines: 3 ranks printing at once spliced more than
1 line in 100, however they wrote. The launcher asks for `--tag-output` and puts the pieces back
together (tests/launch/test_rank_output.py has the same under hydra).

Lines of up to 3000 characters at about 4 MB in all: under 16 MB/s of 20,000-character lines
Open MPI once stopped forwarding for longer than the launcher waits for a line's end (2 s)."""

import re

import pytest
from openmpi_utils import LAUNCH_SCRIPTS, kerasdist_run, openmpi_env

RANKS = 3
LINES = 1500
LENGTHS = [10, 100, 1000, 3000]
LINE = re.compile(r"(?P<prefix>\[\d+\] )?LINE rank=(?P<rank>\d+) n=(?P<n>\d+) (?P<x>x*) END")


@pytest.mark.parametrize("prepend_rank", [False, True], ids=["plain", "prepend-rank"])
def test_every_line_of_every_rank_arrives_whole(open_mpi, tmp_path, prepend_rank):
    flags = ["--prepend-rank"] if prepend_rank else []
    lengths = ",".join(map(str, LENGTHS))
    job = kerasdist_run(
        RANKS,
        LAUNCH_SCRIPTS / "many_lines.py",
        str(LINES),
        lengths,
        cwd=tmp_path,
        flags=flags,
        env=openmpi_env(PYTHONUNBUFFERED=1),
        timeout=300,
    )
    assert job.returncode == 0 and not job.timed_out, job.describe(2000)
    printed = [line for line in job.output.splitlines() if "LINE rank=" in line]
    spliced = [line[:120] for line in printed if not LINE.fullmatch(line)]
    assert not spliced, f"{len(spliced)} of {len(printed)} lines spliced, e.g. {spliced[:3]}"
    by_rank = {}
    for match in map(LINE.fullmatch, printed):
        rank, n = int(match["rank"]), int(match["n"])
        assert len(match["x"]) == LENGTHS[n % len(LENGTHS)]
        assert match["prefix"] == (f"[{rank}] " if prepend_rank else None), match[0][:80]
        by_rank.setdefault(rank, []).append(n)
    assert by_rank == {rank: list(range(LINES)) for rank in range(RANKS)}
