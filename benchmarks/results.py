"""Result files of the benchmarks: what a run measured, and where and how it ran.

Every benchmark that feeds a docs page writes one JSON file (`make bench` and `make bench-net`
write them under benchmarks/results/), and benchmarks/render.py makes the pages' tables from
those files. A file is a run's own data plus a header saying where the numbers came from:

    {"benchmark": "allreduce",
     "source": "measured",               # or "transcribed from docs/<page>.md as of commit ..."
     "command": "mpiexec -n 2 python benchmarks/allreduce.py ...",
     "git": {"commit": "9dceb9a...", "dirty": false},
     "date": "2026-12-05T07:40:12+00:00",
     "machine": {"cpu": "Intel(R) Xeon(R) Processor", "cores": 2, "load_average_at_start": [2.8, 2.5, 1.4]},
     "sizes": [...], ...}               # the run's rows, under the benchmark's own names: medians,
                                        # the raw baseline measured in the same run, ratios, samples

A "tables" entry, where present, holds tables already laid out as {"columns": [...], "rows":
[[cell, ...], ...]}: the files transcribed from the pages before the benchmarks wrote their own
files, and the expensive benchmarks, which lay out their tables with their own functions.

Example:
    >>> run = start_run("allreduce")          # at the start: the load average is the run's
    >>> record = finish_run(run, sizes=[{"size_bytes": 4096, "ratio": 0.13}])
    >>> record["source"], sorted(record["machine"])
    ('measured', ['cores', 'cpu', 'load_average_at_start'])
"""

import datetime
import json
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"
MEASURED = "measured"


def cpu_model():
    """The CPU's model name as /proc/cpuinfo gives it, else the platform's guess."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def git_state():
    """The commit checked out and whether tracked files differ from it (a dirty tree's numbers
    belong to no commit exactly)."""

    def git(*args):
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    changes = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if changes is None else bool(changes)}


def command_line(argv=None, launcher=()):
    """This process's command line as a user would type it again, paths relative to the repo;
    ``launcher`` is what started it (e.g. mpiexec -n 2), which the process cannot see."""
    argv = [*launcher, sys.executable, *sys.argv] if argv is None else list(argv)

    def relative(word):
        word = str(word)
        if os.path.isabs(word) and os.path.abspath(word).startswith(f"{REPO}{os.sep}"):
            return os.path.relpath(word, REPO)
        return word

    return shlex.join(relative(word) for word in argv)


def start_run(benchmark, argv=None, launcher=()):
    """The header of a run that starts now: call it before measuring, so that the load average is
    the one the run started under."""
    return {
        "benchmark": benchmark,
        "source": MEASURED,
        "command": command_line(argv, launcher),
        "git": git_state(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "load_average_at_start": [round(value, 2) for value in os.getloadavg()],
        },
    }


def finish_run(run, **data):
    """The result file's content: the run's header, then its data (rows, tables, sections)."""
    return {**run, **data}


def write(path, record):
    """Writes a result file (strict JSON: NaN and infinities become null)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(strict(record), indent=1) + "\n")
    return path


def read(path):
    return json.loads(pathlib.Path(path).read_text())


def strict(value):
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


_TABLE_ROW = re.compile(r"^\|(.*)\|\s*$")
_RULE_CELL = re.compile(r"^:?-+:?$")


def markdown_tables(text):
    """The markdown tables in ``text``, each as {"columns": [...], "rows": [[...], ...]}: how the
    benchmarks that print their tables as markdown keep them in their result file."""
    tables, current = [], None
    for line in text.splitlines():
        match = _TABLE_ROW.match(line.strip())
        if not match:
            current = None
            continue
        cells = [cell.strip() for cell in match.group(1).split("|")]
        if current is None:
            current = {"columns": cells, "rows": []}
            tables.append(current)
        elif not all(_RULE_CELL.match(cell) for cell in cells):
            current["rows"].append(cells)
    return tables
