"""Writes docs/cli.md, the reference of `kerasdist-run`'s flags, from the launcher's argument parser.

`make docs` runs it before Sphinx, and tests/docs/test_cli_page.py fails when the committed page
is not what this script writes now, so a flag added to `kerasdist.run.launcher.make_parser` (or a
knob added to `kerasdist.knobs.KNOBS`) reaches the page or fails the tests.

    python docs/make_cli_page.py            # rewrite docs/cli.md
    python docs/make_cli_page.py --check    # exit 1 if docs/cli.md is not current
"""

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's kerasdist, also where it is not installed

from kerasdist import knobs  # noqa: E402  (after the path above)
from kerasdist.run import launcher  # noqa: E402

PAGE = ROOT / "docs" / "cli.md"

# Runs anywhere kerasdist is installed: --dry-run prints the mpiexec command and starts nothing.
DRY_RUN_EXAMPLE = (
    "kerasdist-run --dry-run -np 2 --fusion-threshold-mb 32 \\\n"
    "    python -c 'import kerasdist; kerasdist.init(); print(kerasdist.rank(), kerasdist.size())'"
)
LAUNCH_EXAMPLE = DRY_RUN_EXAMPLE.replace("--dry-run ", "")

_HEADER = f"""# kerasdist-run: command-line reference

<!-- Written by docs/make_cli_page.py from kerasdist-run's argument parser; `make docs` rewrites
it. Edit the parser (kerasdist/run/launcher.py) or the knobs (kerasdist/knobs.py), not this page. -->

`kerasdist-run [flags] command ...` (also `python -m kerasdist.run`) starts `command` as NP ranks
with the mpiexec kerasdist was built with. Every flag comes before the command. This page lists
every flag as the launcher's argument parser declares it (`kerasdist-run --help` prints the same);
[configuration.md](configuration.md#launcher-flags) says more about each, and about the
variables the launcher, the ranks and the build read.

## Example

`--dry-run` prints the mpiexec command a launch would run, and starts nothing:

```sh
{DRY_RUN_EXAMPLE}
```

It prints the command, with the variable the flag sets on every rank (32 MiB in bytes); with
MPICH's mpiexec:

```text
/path/to/mpiexec -np 2 -prepend-pattern '[%r]<kerasdist>:' -genv KERASDIST_FUSION_THRESHOLD 33554432 python -c '...'
```

Without `--dry-run` the job runs, and each of the two ranks prints its rank and the job's size
(`0 2` and `1 2`, in either order):

```sh
{LAUNCH_EXAMPLE}
```
"""


def _cell(text):
    """Text for a Markdown table cell: one line, bars escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _flag_names(action):
    return ", ".join(f"`{name}`" for name in action.option_strings)


def _argument(action):
    """What the flag takes: its metavar, none for a switch."""
    if action.nargs == 0:
        return ""
    return f"`{action.metavar or action.dest.upper()}`"


def _default(action):
    """The default as a user would type it; the knobs' flags read theirs from knobs.py."""
    knob = next((knob for knob in knobs.KNOBS if knob.field == action.dest), None)
    if knob is not None:
        return f"`{knob.default_text()}`"
    if action.default == argparse.SUPPRESS:
        return ""
    if not action.option_strings:
        return "required"  # the command; the launcher refuses to start without one
    if action.nargs == 0:
        return "on" if action.default else "off"
    if action.default is None or action.default == []:
        return "required" if re.search(r"\brequired\b", action.help or "") else "none"
    return f"`{action.default}`"


def _exclusive_note(action, parser):
    for group in parser._mutually_exclusive_groups:  # argparse's own help formatter reads it too
        if action in group._group_actions:
            others = [other.option_strings[-1] for other in group._group_actions if other is not action]
            return f"; not with {' or '.join(f'`{name}`' for name in others)}"
    return ""


def cli_page(parser):
    """The Markdown of docs/cli.md for `parser`: per group of flags, a table of each flag, its
    argument, its default and its help."""
    sections = [_HEADER]
    for group in parser._action_groups:  # the groups `--help` prints, in its order
        if not group._group_actions:
            continue
        sections.append(
            f"\n## {group.title[0].upper()}{group.title[1:]}\n\n"
            "| flag | argument | default | what it does |\n"
            "|---|---|---|---|\n"
            + "".join(
                f"| {_flag_names(action)} | {_argument(action)} | {_default(action)} | "
                f"{_cell(action.help or '')}{_exclusive_note(action, parser)} |\n"
                for action in group._group_actions
            )
        )
    return "".join(sections)


def main(argv=None):
    arguments = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    arguments.add_argument("--check", action="store_true", help="exit 1 if the page is not current")
    check = arguments.parse_args(argv).check
    page = cli_page(launcher.make_parser())
    if check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE} is not current: run python docs/make_cli_page.py", file=sys.stderr)
            return 1
        return 0
    if not PAGE.exists() or PAGE.read_text() != page:  # unchanged: Sphinx need not rebuild it
        PAGE.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
