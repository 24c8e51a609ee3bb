"""kerasdist-run --launcher-exec and --network-interface: the command each MPI flavour gets.

Only PyPI's MPICH is installed here, so the Open MPI and Intel MPI lines are checked as strings
(a fake ``mpiexec --version`` names the flavour); tests/multihost runs real jobs through both
flags on emulated hosts.
"""

import os
import stat

import pytest
from launch_utils import LAUNCH_TEST_MARKS, op_library_built_against

from kerasdist.run import launcher, mpi

HYDRA_VERSION_TEXT = "HYDRA build details:\n    Version:                                 5.0.2\n"
INTEL_MPI_VERSION_TEXT = "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619\n"
OPEN_MPI_VERSION_TEXT = "mpirun (Open MPI) 4.1.5\n"
# The options that make hydra tag each piece of a rank's output, as a dry run prints them.
HYDRA_TAGS = ["-prepend-pattern", "'[%r]<kerasdist>:'"]

pytestmark = LAUNCH_TEST_MARKS


def _executable(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 99\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def fake_mpiexec(tmp_path):
    """An executable to name in KERASDIST_MPIEXEC; never run."""
    return _executable(tmp_path / "mpi" / "mpiexec")


@pytest.fixture
def site_ssh(tmp_path):
    """An executable standing for a site's ssh wrapper; never run."""
    return _executable(tmp_path / "site" / "cluster-ssh")


def dry_run(argv, fake_mpiexec, version_text, capsys, **environ):
    """The command `kerasdist-run --dry-run argv` prints, as a list of words, for an op library
    built against the MPI `version_text` names."""
    with op_library_built_against(mpi.flavour_from_version_text(version_text).name):
        status = launcher.main(
            ["--dry-run", *argv],
            environ={"KERASDIST_MPIEXEC": fake_mpiexec, **environ},
            run_version=lambda _path: version_text,
        )
    assert status == 0
    return capsys.readouterr().out.split()


def usage_error(argv, fake_mpiexec, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(argv, environ={"KERASDIST_MPIEXEC": fake_mpiexec}, run_version=lambda _path: HYDRA_VERSION_TEXT)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kerasdist-run: error: "), err
    return err


# ---- --launcher-exec ----------------------------------------------------------------------


def test_mpich_starts_remote_processes_through_hydras_ssh_launcher_with_the_program(fake_mpiexec, site_ssh, capsys):
    out = dry_run(
        ["-np", "4", "-H", "a:2,b:2", "--launcher-exec", site_ssh, "python", "t.py"],
        fake_mpiexec,
        HYDRA_VERSION_TEXT,
        capsys,
    )
    assert out == [
        fake_mpiexec,
        "-np",
        "4",
        *HYDRA_TAGS,
        "-hosts",
        "a:2,b:2",
        "-launcher",
        "ssh",
        "-launcher-exec",
        site_ssh,
        "python",
        "t.py",
    ]


def test_intel_mpi_spells_it_bootstrap_exec(fake_mpiexec, site_ssh, capsys):
    out = dry_run(
        ["-np", "2", "--launcher-exec", site_ssh, "python", "t.py"], fake_mpiexec, INTEL_MPI_VERSION_TEXT, capsys
    )
    assert out == [fake_mpiexec, "-np", "2", "-bootstrap", "ssh", "-bootstrap-exec", site_ssh, "python", "t.py"]


def test_open_mpi_gets_the_program_as_its_rsh_agent(fake_mpiexec, site_ssh, capsys):
    out = dry_run(
        ["-np", "2", "-H", "a,b", "--launcher-exec", site_ssh, "python", "t.py"],
        fake_mpiexec,
        OPEN_MPI_VERSION_TEXT,
        capsys,
    )
    assert out == [
        *[fake_mpiexec, "-np", "2", "--bind-to", "none", "--tag-output", "-H", "a,b"],
        *["--mca", "plm_rsh_agent", site_ssh, "python", "t.py"],
    ]


def test_launcher_program_given_by_name_or_relative_path_becomes_absolute(fake_mpiexec, site_ssh, capsys, monkeypatch):
    site_dir, name = os.path.split(site_ssh)
    monkeypatch.setenv("PATH", site_dir + os.pathsep + os.environ.get("PATH", ""))
    by_name = dry_run(["-np", "2", "--launcher-exec", name, "python", "t.py"], fake_mpiexec, HYDRA_VERSION_TEXT, capsys)
    monkeypatch.chdir(os.path.dirname(site_dir))
    relative = os.path.join(os.path.basename(site_dir), name)
    by_path = dry_run(
        ["-np", "2", "--launcher-exec", relative, "python", "t.py"], fake_mpiexec, HYDRA_VERSION_TEXT, capsys
    )
    assert by_name[by_name.index("-launcher-exec") + 1] == site_ssh
    assert by_path[by_path.index("-launcher-exec") + 1] == site_ssh


# ---- --network-interface ------------------------------------------------------------------


def test_mpich_keeps_hydra_and_ucx_and_libfabric_on_the_interface(fake_mpiexec, capsys):
    out = dry_run(
        ["-np", "2", "--network-interface", "eth1", "--log-level", "info", "python", "t.py"],
        fake_mpiexec,
        HYDRA_VERSION_TEXT,
        capsys,
    )
    assert out == [
        fake_mpiexec,
        "-np",
        "2",
        *HYDRA_TAGS,
        "-iface",
        "eth1",
        "-genv",
        "KERASDIST_LOG_LEVEL",
        "info",
        "-genv",
        "UCX_NET_DEVICES",
        "eth1",
        "-genv",
        "FI_TCP_IFACE",
        "eth1",
        "python",
        "t.py",
    ]


def test_intel_mpi_keeps_hydra_and_libfabric_on_the_interface(fake_mpiexec, capsys):
    out = dry_run(
        ["-np", "2", "--network-interface", "ib0", "python", "t.py"], fake_mpiexec, INTEL_MPI_VERSION_TEXT, capsys
    )
    assert out == [fake_mpiexec, "-np", "2", "-iface", "ib0", "-genv", "FI_TCP_IFACE", "ib0", "python", "t.py"]


def test_open_mpi_keeps_its_tcp_transport_runtime_and_ucx_on_the_interface(fake_mpiexec, capsys):
    out = dry_run(
        ["-np", "2", "--network-interface", "eth1", "python", "t.py"], fake_mpiexec, OPEN_MPI_VERSION_TEXT, capsys
    )
    assert out == [
        fake_mpiexec,
        "-np",
        "2",
        "--bind-to",
        "none",
        "--tag-output",
        "--oversubscribe",
        "--mca",
        "btl_tcp_if_include",
        "eth1",
        "--mca",
        "oob_tcp_if_include",
        "eth1",
        "-x",
        "UCX_NET_DEVICES=eth1",
        "python",
        "t.py",
    ]


@pytest.mark.parametrize(
    "version_text, spelled",
    [
        (HYDRA_VERSION_TEXT, ["-genv", "UCX_NET_DEVICES", "mlx5_0:1"]),
        (OPEN_MPI_VERSION_TEXT, ["-x", "UCX_NET_DEVICES=mlx5_0:1"]),
    ],
)
def test_a_device_the_caller_chose_for_ucx_is_kept(fake_mpiexec, capsys, version_text, spelled):
    out = dry_run(
        ["-np", "2", "--network-interface", "ib0", "python", "t.py"],
        fake_mpiexec,
        version_text,
        capsys,
        UCX_NET_DEVICES="mlx5_0:1",
    )
    joined = " ".join(out)
    assert " ".join(spelled) in joined and "UCX_NET_DEVICES ib0" not in joined and "UCX_NET_DEVICES=ib0" not in joined


def test_both_flags_together_with_a_hostfile_and_mpi_args_last(fake_mpiexec, site_ssh, tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a:2\nb:2\n")
    out = dry_run(
        [
            "-np",
            "4",
            "--hostfile",
            str(hostfile),
            "--launcher-exec",
            site_ssh,
            "--network-interface",
            "eth1",
            "--mpi-args",
            "-genv FI_TCP_IFACE eth2",
            "python",
            "t.py",
        ],
        fake_mpiexec,
        HYDRA_VERSION_TEXT,
        capsys,
    )
    assert out == [
        fake_mpiexec,
        "-np",
        "4",
        *HYDRA_TAGS,
        "-f",
        str(hostfile),
        "-launcher",
        "ssh",
        "-launcher-exec",
        site_ssh,
        "-iface",
        "eth1",
        "-genv",
        "UCX_NET_DEVICES",
        "eth1",
        "-genv",
        "FI_TCP_IFACE",
        "eth1",
        "-genv",
        "FI_TCP_IFACE",
        "eth2",
        "python",
        "t.py",
    ]


# ---- bad values: one line naming the flag, exit status 2 -----------------------------------


@pytest.mark.parametrize("value", ["/no/such/ssh", "no-such-command-kerasdist"])
def test_launcher_program_that_cannot_run_is_a_usage_error(fake_mpiexec, capsys, value):
    err = usage_error(["-np", "2", "--launcher-exec", value, "python", "t.py"], fake_mpiexec, capsys)
    assert "--launcher-exec" in err and value in err


def test_launcher_program_that_is_not_executable_is_a_usage_error(fake_mpiexec, tmp_path, capsys):
    plain_file = tmp_path / "ssh-wrapper"
    plain_file.write_text("#!/bin/sh\n")
    err = usage_error(["-np", "2", "--launcher-exec", str(plain_file), "python", "t.py"], fake_mpiexec, capsys)
    assert "--launcher-exec" in err


@pytest.mark.parametrize("name", ["", "eth 1", "a/b", "eth0:1", "..", "sixteen-chars-xx"])
def test_a_name_linux_would_refuse_for_an_interface_is_a_usage_error(fake_mpiexec, capsys, name):
    err = usage_error(["-np", "2", "--network-interface", name, "python", "t.py"], fake_mpiexec, capsys)
    assert "--network-interface" in err
