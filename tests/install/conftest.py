"""The pip-install tests' working directory and the checkout's sources they install from."""

import shutil

import pytest
from pip_venv import NOT_SOURCES, ROOT


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
