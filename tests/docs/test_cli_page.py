"""docs/cli.md, the reference of kerasdist-run's flags, is what docs/make_cli_page.py writes from
the launcher's argument parser: every flag with its argument, default and help, and a launch line
that runs."""

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from kerasdist import knobs
from kerasdist.run import launcher

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("make_cli_page", ROOT / "docs" / "make_cli_page.py")
make_cli_page = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_cli_page)


def _rows(page):
    """{first cell + second cell: the row's cells} of every table row of the page."""
    rows = {}
    for line in page.splitlines():
        if line.startswith("| ") and not line.startswith("| flag |"):
            cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows[cells[0] or cells[1]] = cells
    return rows


def test_the_committed_page_is_what_the_parser_makes_now():
    committed = (ROOT / "docs" / "cli.md").read_text()
    assert committed == make_cli_page.cli_page(launcher.make_parser()), (
        "docs/cli.md is behind kerasdist-run's parser: run python docs/make_cli_page.py (make docs does)"
    )


def test_a_flag_added_to_the_parser_makes_the_committed_page_stale():
    parser = launcher.make_parser()
    parser.add_argument("--warp-factor", type=int, default=9, metavar="W", help="how fast the ranks travel")
    page = make_cli_page.cli_page(parser)

    assert _rows(page)["`--warp-factor`"] == ["`--warp-factor`", "`W`", "`9`", "how fast the ranks travel"]
    assert page != (ROOT / "docs" / "cli.md").read_text()


def test_every_flag_is_on_the_page_with_its_argument_default_and_help():
    page = (ROOT / "docs" / "cli.md").read_text()
    rows = _rows(page)
    parser = launcher.make_parser()
    knob_defaults = {knob.flag: knob.default_text() for knob in knobs.KNOBS}
    for action in parser._actions:
        names = ", ".join(f"`{name}`" for name in action.option_strings)
        key = names or f"`{action.metavar}`"
        assert key in rows, f"{key} is not on docs/cli.md"
        _, argument, default, what = rows[key]
        if action.nargs != 0:
            assert argument == f"`{action.metavar}`", (key, argument)
        assert what.startswith(" ".join(action.help.split()).replace("|", "\\|")), (key, what)
        if action.option_strings and action.option_strings[0] in knob_defaults:
            assert default == f"`{knob_defaults[action.option_strings[0]]}`", (key, default)
    # Defaults that are not the knobs', spelled out: the page must agree with the launcher's behaviour.
    assert rows["`-np`, `-n`, `--np`"][2] == "required"
    assert rows["`--restarts`"][2] == "`0`"
    assert rows["`--dry-run`"][2] == "off"
    assert "not with `--hostfile` or `--host-discovery-script`" in rows["`-H`, `--hosts`"][3]


def test_the_dry_run_example_runs_and_prints_the_mpiexec_command(tmp_path):
    page = (ROOT / "docs" / "cli.md").read_text()
    example = re.search(r"```sh\n(kerasdist-run --dry-run .*?)\n```", page, flags=re.S)[1]
    # The page's `kerasdist-run` and `python` are the ones of the environment kerasdist is installed in.
    environ = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    ran = subprocess.run(
        ["bash", "-c", example], cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=120
    )

    assert ran.returncode == 0, ran.stderr
    command = shlex.split(ran.stdout.strip())
    assert Path(command[0]).name.startswith("mpiexec") or "mpirun" in command[0], command
    assert command[command.index("-np") + 1] == "2", command
    assert "33554432" in command, command  # --fusion-threshold-mb 32, in bytes
    assert command[-3:] == ["python", "-c", shlex.split(example)[-1]], command
