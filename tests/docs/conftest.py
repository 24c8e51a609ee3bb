"""The documentation site, built once for the tests of this folder."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "build" / "docs" / "html"


@pytest.fixture(scope="session")
def site():
    """`make docs`, as CI runs it: installs requirements-docs.txt into .venv when missing, then
    builds the site into build/docs/html (only what changed, when it was built before)."""
    built = subprocess.run(["make", "-s", "-C", str(ROOT), "docs"], capture_output=True, text=True, timeout=1200)
    if built.returncode != 0:
        has_sphinx = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", "import sphinx, myst_parser, furo"])
        if has_sphinx.returncode != 0:
            pytest.skip(f"the docs requirements (requirements-docs.txt) could not be installed: {built.stderr[-2000:]}")
        pytest.fail(f"make docs failed:\n{built.stdout[-4000:]}\n{built.stderr[-4000:]}")
    return SITE
