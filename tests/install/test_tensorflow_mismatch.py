"""The op library refuses a TensorFlow other than the one it was built against, and says how to
rebuild it. Fast and in-process; test_pip_install.py does it for real."""

import importlib.metadata
import json
import sys

import pytest

from kerasdist import op_library
from kerasdist.run import launcher


def test_releases_of_one_minor_version_agree():
    assert op_library.tensorflow_mismatch("2.20.0", "2.20.1") is None


def test_unknown_build_is_not_called_a_mismatch():
    assert op_library.tensorflow_mismatch(None, "2.21.0") is None


class FakeDistribution:
    def __init__(self, direct_url):
        self.direct_url = direct_url

    def read_text(self, name):
        assert name == "direct_url.json"
        return json.dumps(self.direct_url)


@pytest.fixture
def installed_from(monkeypatch):
    """Makes kerasdist look installed from a given direct_url.json, built with given build_info."""

    def install(direct_url, build_info):
        monkeypatch.setattr(importlib.metadata, "distribution", lambda name: FakeDistribution(direct_url))
        monkeypatch.setattr(op_library, "build_info", lambda: build_info)

    return install


def test_another_minor_release_is_named_with_both_versions_and_a_reinstall(installed_from):
    installed_from({"url": "file:///src/kerasdist-0.1.0.tar.gz", "archive_info": {}}, {"mpi": "PyPI mpich"})
    message = op_library.tensorflow_mismatch("2.20.0", "2.21.0")
    assert "built against TensorFlow 2.20.0" in message and "runs TensorFlow 2.21.0" in message
    assert message.endswith(
        f"{sys.executable} -m pip install --no-cache-dir --force-reinstall --no-deps /src/kerasdist-0.1.0.tar.gz"
    )


def test_rebuild_reinstalls_the_sdist_it_came_from(installed_from):
    installed_from({"url": "file:///tmp/my%20dir/kerasdist-0.1.0.tar.gz", "archive_info": {}}, {"mpi": "PyPI mpich"})
    command = op_library.rebuild_command()
    assert command == (
        f"{sys.executable} -m pip install --no-cache-dir --force-reinstall --no-deps "
        "'/tmp/my dir/kerasdist-0.1.0.tar.gz'"
    )


def test_rebuild_from_git_pins_the_installed_commit(installed_from):
    url = "https://example.org/kerasdist.git"
    installed_from({"url": url, "vcs_info": {"vcs": "git", "commit_id": "abc123"}}, {"mpi": "PyPI mpich"})
    assert op_library.rebuild_command().endswith(f"--no-deps git+{url}@abc123")


def test_rebuild_keeps_a_system_mpi_and_the_nccl_variant(installed_from):
    build_info = {"mpi": "mpicc at /usr/bin/mpicc.openmpi", "nccl": True}
    installed_from({"url": "file:///src/kerasdist", "dir_info": {}}, build_info)
    command = op_library.rebuild_command()
    assert command.startswith("MPICC=/usr/bin/mpicc.openmpi KERASDIST_WITH_NCCL=1 ")
    assert command.endswith("--no-deps --no-build-isolation /src/kerasdist")


def test_rebuild_of_an_editable_checkout_builds_in_place(installed_from):
    installed_from({"url": "file:///src/kerasdist", "dir_info": {"editable": True}}, {"mpi": "PyPI mpich"})
    assert op_library.rebuild_command() == f"cd /src/kerasdist && {sys.executable} setup.py build_ext --inplace"


def test_check_build_reports_the_running_tensorflow_beside_the_built_against_one(monkeypatch, capsys):
    import tensorflow as tf  # the running release, read independently of package metadata

    monkeypatch.setattr(launcher, "read_build_info", lambda path=None: {"tensorflow": "2.0.0", "mpi": "PyPI mpich"})
    status = launcher.check_build({})
    report = capsys.readouterr().out
    assert "built against:  TensorFlow 2.0.0" in report
    assert f"running:        TensorFlow {tf.__version__} (" in report
    assert "mismatch:       kerasdist's op library was built against TensorFlow 2.0.0" in report
    assert status == 1
