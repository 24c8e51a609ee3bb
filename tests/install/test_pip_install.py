"""kerasdist installed the way a user installs it: plain `pip install 'DIR[examples]'` from a
terminal (build isolation on, dependencies resolved) into a fresh venv that already has
requirements.txt's TensorFlow, then used from that venv alone: it builds against that TensorFlow
and adds no second one, the terminal shows the compile's progress, and the digits example trains
at 2 ranks from the installed package (`kerasdist-run -np 2 python -m kerasdist.examples...`),
then, with scikit-learn removed, says in one line per rank what to install. `make test` runs it
(minutes: one TensorFlow install and a compile of the op library); test_other_tensorflow_release.py,
which `make test-install` adds, covers the release before it.
"""

import re
import sys
import tarfile

import pytest
from pip_venv import NEWEST_SPEC, Venv, run, run_in_terminal

ACCURACY_LINE = re.compile(r"2 process\(es\): test accuracy (\d\.\d+)")
MISSING_EXTRA = "keras_digits.py needs scikit-learn, for its digits: pip install 'kerasdist[examples]'"

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def newest_venv(workdir, checkout):
    venv = Venv(workdir / "newest")
    venv.pip_install(NEWEST_SPEC)
    # As typed at a terminal, without -q: pip shows a build's own output only with -v.
    status, venv.install_terminal = run_in_terminal(
        [venv.python, "-m", "pip", "install", f"{checkout}[examples]"], timeout=1200
    )
    assert status == 0, venv.install_terminal[-5000:]
    return venv


@pytest.fixture(scope="module")
def elsewhere(workdir):
    """An empty directory to run from: no checkout beside it for `python -m` to find."""
    path = workdir / "elsewhere"
    path.mkdir()
    return path


def run_digits_example(venv, cwd, expect_ok=True):
    command = [venv.path / "bin" / "kerasdist-run", "-np", "2", venv.python, "-m", "kerasdist.examples.keras_digits"]
    return run(command, timeout=600, cwd=cwd, expect_ok=expect_ok)


def test_pip_install_of_a_checkout_builds_against_the_tensorflow_there_and_adds_no_second_one(newest_venv):
    installed = newest_venv.installed()
    tensorflows = sorted(
        name for name in installed if re.fullmatch(r"tensorflow(-cpu|-gpu|-intel)?|tf-nightly.*", name)
    )
    assert tensorflows == ["tensorflow-cpu"], tensorflows
    assert newest_venv.build_info()["tensorflow"] == installed["tensorflow-cpu"]
    assert "mpich" in installed and "mpi4py" in installed  # the default MPI came with it
    assert "scikit-learn" in installed  # the examples extra
    report = newest_venv.check_build().stdout
    assert f"built against:  TensorFlow {installed['tensorflow-cpu']}" in report, report
    assert f"running:        TensorFlow {installed['tensorflow-cpu']} (tensorflow-cpu)" in report, report


def test_the_terminal_shows_the_compile_starting_with_its_duration_and_each_file_compiled(newest_venv, checkout):
    csrc = checkout / "kerasdist" / "csrc"  # what the build without NCCL compiles
    sources = len(list(csrc.glob("engine/*.cc")) + list(csrc.glob("tensorflow/*.cc")))
    shown = newest_venv.install_terminal
    started = re.findall(r"kerasdist: \[0:00\] compiling the op library: (\d+) C\+\+ files, .* with 2 CPUs", shown)
    assert started == [str(sources)], shown[-5000:]
    compiled = re.findall(rf"kerasdist: \[(\d+):(\d\d)\] compiled (\d+)/{sources}: ", shown)
    assert [int(count) for *_, count in compiled] == list(range(1, sources + 1)), shown[-5000:]
    elapsed = [int(minutes) * 60 + int(seconds) for minutes, seconds, _ in compiled]
    assert elapsed == sorted(elapsed), elapsed


def test_the_sdist_ships_the_examples(workdir, checkout):
    run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", workdir / "sdist", checkout], 600)
    (sdist,) = (workdir / "sdist").glob("kerasdist-*.tar.gz")
    with tarfile.open(sdist) as archive:
        shipped = {name.partition("/")[2] for name in archive.getnames()}
    examples = {f"examples/{path.name}" for path in (checkout / "examples").glob("*.py")}
    assert "examples/keras_digits.py" in examples and examples <= shipped, sorted(examples - shipped)


def test_digits_example_trains_at_two_ranks_from_the_installed_package(newest_venv, elsewhere):
    finished = run_digits_example(newest_venv, elsewhere)
    accuracy = ACCURACY_LINE.search(finished.stdout)
    assert accuracy, finished.stdout[-3000:] + finished.stderr[-3000:]
    # 20 epochs of the small CNN on 1347 digits: README's run reached 0.98; chance is 0.10.
    assert float(accuracy[1]) > 0.9, accuracy[0]


def test_without_scikit_learn_every_rank_names_the_extra_in_one_line(newest_venv, elsewhere):
    """Runs last: it removes scikit-learn from the venv."""
    run([newest_venv.python, "-m", "pip", "uninstall", "-q", "-y", "scikit-learn"], timeout=300)
    finished = run_digits_example(newest_venv, elsewhere, expect_ok=False)
    output = finished.stdout + finished.stderr
    assert finished.returncode != 0
    assert [line for line in output.splitlines() if MISSING_EXTRA in line] == [MISSING_EXTRA] * 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
