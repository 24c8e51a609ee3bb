"""kerasdist-run refuses an mpiexec of another MPI family than the op library was built against,
naming both and the fix, before any rank starts.

The situation the tests rebuild: kerasdist built against PyPI's mpich, whose mpiexec has gone
(`pip uninstall mpich`), and Open MPI's mpiexec first on PATH. It cannot start those ranks: each
one's MPI_Init aborts on Open MPI's PMIx (as root, Open MPI first prints 15 lines about root).
The mpiexec answers `--version` for real: a script that prints what Debian's Open MPI 4.1 prints,
and Debian's own mpiexec.openmpi where it is installed.
"""

import shutil
import stat
import sys

import pytest
from launch_utils import LAUNCH_TEST_MARKS

from kerasdist.run import launcher

pytestmark = LAUNCH_TEST_MARKS

DEBIAN_OPEN_MPI_MPIEXEC = shutil.which("mpiexec.openmpi")
VERSION_TEXTS = {
    "Open MPI": "mpiexec (OpenRTE) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/\n",
    "MPICH": "HYDRA build details:\n    Version:                                 5.0.2\n",
    "Intel MPI": "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619 (id: c2e19c2f3e)\n",
}


def _fake_mpiexec(directory, version_text):
    """An mpiexec in ``directory`` that answers --version with ``version_text`` and fails otherwise."""
    directory.mkdir(exist_ok=True)
    path = directory / "mpiexec"
    path.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && cat <<'EOF'\n{version_text}EOF\nexit 99\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def mpich_build_without_its_mpiexec(tmp_path, monkeypatch):
    """The op library as built against PyPI mpich, with that mpiexec gone: not where the build
    recorded it, and not beside this Python."""
    gone = tmp_path / "venv" / "bin" / "mpiexec"
    build_info = {"mpi": "PyPI mpich", "mpi_flavour": "mpich", "mpiexec": str(gone), "tensorflow": "2.21.0"}
    monkeypatch.setattr(launcher, "read_build_info", lambda: build_info)
    gone.parent.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(gone.parent / "python"))
    return gone


def _refusal(argv, path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(argv, environ={"PATH": str(path)})
    err = capsys.readouterr().err
    assert exit_info.value.code == launcher.USAGE_ERROR, err
    assert err.count("\n") == 1 and err.startswith("kerasdist-run: error: "), err
    return err


@pytest.mark.parametrize("extra", [[], ["--dry-run"]], ids=["launch", "dry-run"])
def test_open_mpi_s_mpiexec_on_path_is_refused_for_an_mpich_build(
    extra, mpich_build_without_its_mpiexec, tmp_path, capsys
):
    on_path = _fake_mpiexec(tmp_path / "path", VERSION_TEXTS["Open MPI"])
    err = _refusal(["-np", "2", *extra, "python", "t.py"], on_path.parent, capsys)
    assert "built against PyPI mpich (MPICH family)" in err
    assert f"the mpiexec found (from PATH), {on_path}, is Open MPI's" in err
    assert f"{mpich_build_without_its_mpiexec}, its mpiexec when it was built, is gone" in err
    assert "`pip install mpich` installs it again" in err
    assert "KERASDIST_MPIEXEC to an MPICH mpiexec, or rebuild kerasdist against Open MPI" in err


@pytest.mark.skipif(DEBIAN_OPEN_MPI_MPIEXEC is None, reason="Debian's Open MPI (openmpi-bin) is not installed")
def test_debian_s_open_mpi_mpiexec_on_path_is_refused_for_an_mpich_build(
    mpich_build_without_its_mpiexec, tmp_path, capsys
):
    path = tmp_path / "path"
    path.mkdir()
    (path / "mpiexec").symlink_to(DEBIAN_OPEN_MPI_MPIEXEC)
    err = _refusal(["-np", "2", "python", "t.py"], path, capsys)
    assert f"{path / 'mpiexec'}, is Open MPI's" in err and "(MPICH family)" in err


def test_check_build_names_the_refusal_and_exits_1(mpich_build_without_its_mpiexec, tmp_path, capsys):
    on_path = _fake_mpiexec(tmp_path / "path", VERSION_TEXTS["Open MPI"])
    assert launcher.main(["--check-build"], environ={"PATH": str(on_path.parent)}) == 1
    out = capsys.readouterr().out
    assert "launch mpiexec: none: the op library was built against PyPI mpich (MPICH family), but the " in out
    assert f"{on_path}, is Open MPI's" in out


def test_an_mpiexec_of_the_same_family_is_accepted(mpich_build_without_its_mpiexec, tmp_path, capsys):
    on_path = _fake_mpiexec(tmp_path / "path", VERSION_TEXTS["Intel MPI"])  # MPICH's ABI
    status = launcher.main(["-np", "2", "--dry-run", "python", "t.py"], environ={"PATH": str(on_path.parent)})
    assert status == 0 and capsys.readouterr().out.split() == [str(on_path), "-np", "2", "python", "t.py"]  # no tags


def test_mpich_s_mpiexec_is_refused_for_an_open_mpi_build(monkeypatch, tmp_path, capsys):
    build_info = {"mpi": "mpicc at /usr/bin/mpicc.openmpi", "mpi_flavour": "openmpi", "mpiexec": None}
    monkeypatch.setattr(launcher, "read_build_info", lambda: build_info)
    named = _fake_mpiexec(tmp_path / "mpich", VERSION_TEXTS["MPICH"])
    with pytest.raises(SystemExit):
        launcher.main(["-np", "2", "python", "t.py"], environ={"KERASDIST_MPIEXEC": str(named)})
    err = capsys.readouterr().err
    assert "built against mpicc at /usr/bin/mpicc.openmpi (Open MPI family)" in err
    assert f"(from KERASDIST_MPIEXEC), {named}, is MPICH (hydra)'s" in err
    assert "is gone" not in err


def test_a_build_that_did_not_record_its_mpi_refuses_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(launcher, "read_build_info", lambda: None)
    named = _fake_mpiexec(tmp_path / "openmpi", VERSION_TEXTS["Open MPI"])
    status = launcher.main(["-np", "2", "--dry-run", "python", "t.py"], environ={"KERASDIST_MPIEXEC": str(named)})
    assert status == 0, capsys.readouterr().err
