"""kerasdist from an sdist (`python -m build --sdist`) in a fresh venv with the TensorFlow minor
release before requirements.txt's: the collectives suite passes at 2 ranks against that library.
That venv's TensorFlow is then upgraded under kerasdist: `kerasdist.init()` and `kerasdist-run
--check-build` name both releases, and the rebuild command they name makes it work.

Not in `make test`: a second TensorFlow install, an sdist and two compiles take about 8 minutes of
CPU here, which CI's budget does not hold; `make test-install` runs it with test_pip_install.py.
The message and the rebuild command themselves are checked in `make test` by
test_tensorflow_mismatch.py.
"""

import re
import shlex
import sys

import pytest
from pip_venv import NEWEST_SPEC, ROOT, SECOND_SPEC, Venv, requirement, run

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def second_venv(workdir, checkout):
    run([sys.executable, "-m", "build", "--sdist", "--outdir", workdir / "dist", checkout], timeout=600)
    (sdist,) = (workdir / "dist").glob("kerasdist-*.tar.gz")
    venv = Venv(workdir / "second")
    venv.pip_install(SECOND_SPEC, *(requirement(name) for name in ("pytest", "pytest-timeout", "hypothesis")))
    # --no-cache-dir: pip would keep the wheel it builds, in the user's cache, for each run's sdist.
    venv.pip_install("--no-cache-dir", sdist)
    return venv


def test_collectives_pass_at_two_ranks_against_the_second_newest_tensorflow(second_venv):
    built_against = second_venv.build_info()["tensorflow"]
    assert built_against == second_venv.installed()["tensorflow-cpu"]
    assert built_against.split(".")[:2] == SECOND_SPEC.split("==")[1].split(".")[:2]
    # -P: kerasdist from the venv, not from the checkout the tests are read from.
    finished = run(
        [
            second_venv.path / "bin" / "mpiexec",
            "-n",
            "2",
            second_venv.python,
            "-P",
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/collectives",
        ],
        timeout=900,
        cwd=ROOT,
    )
    assert re.search(r"\d+ passed", finished.stdout) and "failed" not in finished.stdout, finished.stdout[-3000:]


def test_another_tensorflow_under_the_library_is_named_with_both_releases_and_the_fix(second_venv):
    """Runs after the collectives test, on its venv: it changes that venv's TensorFlow."""
    built_against = second_venv.build_info()["tensorflow"]
    second_venv.pip_install(NEWEST_SPEC)
    running = second_venv.installed()["tensorflow-cpu"]
    assert running.split(".")[:2] != built_against.split(".")[:2]

    failed = second_venv.init(expect_ok=False)
    assert failed.returncode != 0
    message = failed.stderr.strip().splitlines()[-1]
    assert message.startswith("ImportError: kerasdist's op library was built against "), failed.stderr[-3000:]
    assert f"TensorFlow {built_against}" in message and f"runs TensorFlow {running}" in message, message
    assert "undefined symbol" not in failed.stderr  # refused before TensorFlow tried to load it

    report = second_venv.check_build(expect_ok=False)
    assert report.returncode == 1, report.stdout
    assert f"built against:  TensorFlow {built_against}" in report.stdout, report.stdout
    assert f"running:        TensorFlow {running} (tensorflow-cpu)" in report.stdout, report.stdout

    fix = message.split("rebuilt against the running one: ", 1)[1]
    assert "--force-reinstall" in fix and "--no-cache-dir" in fix, fix
    run(shlex.split(fix), timeout=900)
    assert second_venv.build_info()["tensorflow"] == running
    assert "size 1" in second_venv.init().stdout
    assert second_venv.check_build().returncode == 0
