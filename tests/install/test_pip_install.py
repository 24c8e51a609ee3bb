"""kerasdist installed the way a user installs it: plain `pip install` (build isolation on, dependencies
resolved) into a fresh venv that already has TensorFlow, then used from that venv alone.

* The newest TensorFlow (requirements.txt's pin) gets kerasdist from a checkout (`pip install DIR`);
  examples/keras_digits.py then trains at 2 ranks through the venv's `kerasdist-run`.
* The minor release before it gets kerasdist from an sdist (`python -m build --sdist`); the
  collectives suite then passes at 2 ranks against that library.
* That venv's TensorFlow is then upgraded under kerasdist: `kerasdist.init()` and
  `kerasdist-run --check-build` name both releases, and the rebuild command they name makes it work.

Minutes of work (two TensorFlow installs, three compiles of the op library): under `make test` it runs
on one pytest-xdist worker, started first, beside the emulated hosts on the other; `make test-install`
runs it alone.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = (ROOT / "requirements.txt").read_text(encoding="utf-8")
NEWEST = re.search(r"^tensorflow-cpu==(\d+)\.(\d+)\.\*$", REQUIREMENTS, re.M)
NEWEST_SPEC = f"tensorflow-cpu=={NEWEST[1]}.{NEWEST[2]}.*"
SECOND_SPEC = f"tensorflow-cpu=={NEWEST[1]}.{int(NEWEST[2]) - 1}.*"
# What a checkout holds that an install must not see: other environments' builds and venvs.
NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "*.so", "build_info.json", "bench-results"
)
ACCURACY_LINE = re.compile(r"2 process\(es\): test accuracy (\d\.\d+)")

pytestmark = pytest.mark.timeout(1800)


def requirement(name):
    """requirements.txt's line for `name` (with its pin), so the venvs test what the project pins."""
    return re.search(rf"^{re.escape(name)}[<>=].*$", REQUIREMENTS, re.M)[0]


def environment():
    """This process's variables less those of the venv running it: every command below runs from
    its own venv. One math thread per rank, as `make test` runs."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    return env


def run(argv, timeout, cwd=None, expect_ok=True):
    finished = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, env=environment(), cwd=cwd, timeout=timeout
    )
    if expect_ok:
        assert finished.returncode == 0, f"{shlex.join(map(str, argv))} exited {finished.returncode}:\n" + (
            finished.stdout[-3000:] + finished.stderr[-5000:]
        )
    return finished


class Venv:
    def __init__(self, path):
        self.path = path
        run([sys.executable, "-m", "venv", path], timeout=120)
        self.python = path / "bin" / "python"

    def pip_install(self, *args, timeout=900):
        return run([self.python, "-m", "pip", "install", "-q", *args], timeout=timeout)

    def installed(self):
        listed = run([self.python, "-m", "pip", "list", "--format", "json"], timeout=120).stdout
        return {entry["name"].lower().replace("_", "-"): entry["version"] for entry in json.loads(listed)}

    def build_info(self):
        found = list(self.path.glob("lib/python*/site-packages/kerasdist/build_info.json"))
        assert len(found) == 1, f"kerasdist's build_info.json in {self.path}: {found}"
        return json.loads(found[0].read_text())

    def check_build(self, expect_ok=True):
        return run([self.path / "bin" / "kerasdist-run", "--check-build"], timeout=120, expect_ok=expect_ok)

    def init(self, expect_ok=True):
        code = "import kerasdist; kerasdist.init(); print('size', kerasdist.size())"
        # cwd: the venv, so no checkout shadows the installed package.
        return run([self.python, "-c", code], timeout=300, cwd=self.path, expect_ok=expect_ok)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Removed afterwards, also after a failure: two venvs with TensorFlow take gigabytes."""
    path = tmp_path_factory.mktemp("install")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def checkout(workdir):
    """The checkout's sources as a clean clone has them."""
    copy = workdir / "kerasdist"
    shutil.copytree(ROOT, copy, ignore=NOT_SOURCES)
    return copy


@pytest.fixture(scope="module")
def newest_venv(workdir, checkout):
    venv = Venv(workdir / "newest")
    venv.pip_install(NEWEST_SPEC, requirement("scikit-learn"))
    venv.pip_install(checkout)
    return venv


@pytest.fixture(scope="module")
def second_venv(workdir, checkout):
    run([sys.executable, "-m", "build", "--sdist", "--outdir", workdir / "dist", checkout], timeout=600)
    (sdist,) = (workdir / "dist").glob("kerasdist-*.tar.gz")
    venv = Venv(workdir / "second")
    venv.pip_install(SECOND_SPEC, *(requirement(name) for name in ("pytest", "pytest-timeout", "hypothesis")))
    # --no-cache-dir: pip would keep the wheel it builds, in the user's cache, for each run's sdist.
    venv.pip_install("--no-cache-dir", sdist)
    return venv


def test_pip_install_of_a_checkout_builds_against_the_tensorflow_there_and_adds_no_second_one(newest_venv):
    installed = newest_venv.installed()
    tensorflows = sorted(
        name for name in installed if re.fullmatch(r"tensorflow(-cpu|-gpu|-intel)?|tf-nightly.*", name)
    )
    assert tensorflows == ["tensorflow-cpu"], tensorflows
    assert newest_venv.build_info()["tensorflow"] == installed["tensorflow-cpu"]
    assert "mpich" in installed and "mpi4py" in installed  # the default MPI came with it
    report = newest_venv.check_build().stdout
    assert f"built against:  TensorFlow {installed['tensorflow-cpu']}" in report, report
    assert f"running:        TensorFlow {installed['tensorflow-cpu']} (tensorflow-cpu)" in report, report


def test_digits_example_trains_at_two_ranks_from_the_installed_package(newest_venv, workdir):
    finished = run(
        [
            newest_venv.path / "bin" / "kerasdist-run",
            "-np",
            "2",
            newest_venv.python,
            ROOT / "examples" / "keras_digits.py",
        ],
        timeout=600,
        cwd=workdir,
    )
    accuracy = ACCURACY_LINE.search(finished.stdout)
    assert accuracy, finished.stdout[-3000:] + finished.stderr[-3000:]
    # 20 epochs of the small CNN on 1347 digits: README's run reached 0.98; chance is 0.10.
    assert float(accuracy[1]) > 0.9, accuracy[0]


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
