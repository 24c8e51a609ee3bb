"""kerasdist installed the way a user installs it: plain `pip install` (build isolation on,
dependencies resolved) into a fresh venv that already has requirements.txt's TensorFlow, from a
checkout (`pip install DIR`), then used from that venv alone: it builds against that TensorFlow and
adds no second one, and examples/keras_digits.py trains at 2 ranks through the venv's
`kerasdist-run`. `make test` runs it (minutes: one TensorFlow install and a compile of the op
library); test_other_tensorflow_release.py, which `make test-install` adds, covers the release
before it.
"""

import re

import pytest
from pip_venv import NEWEST_SPEC, ROOT, Venv, requirement, run

ACCURACY_LINE = re.compile(r"2 process\(es\): test accuracy (\d\.\d+)")

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def newest_venv(workdir, checkout):
    venv = Venv(workdir / "newest")
    venv.pip_install(NEWEST_SPEC, requirement("scikit-learn"))
    venv.pip_install(checkout)
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
