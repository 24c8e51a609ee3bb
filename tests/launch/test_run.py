"""kerasdist-run: the command it builds for each MPI flavour, its argument errors, and real
2-process jobs started through it (exit status, knobs in the ranks' environment, signals).

Command lines for Open MPI and Intel MPI are checked with a fake ``mpiexec --version`` (only
PyPI's MPICH is installed here); every real job runs under a timeout.
"""

import io
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_utils import (
    DEFAULT_JOB_TIMEOUT_S,
    LAUNCH_TEST_MARKS,
    MPIEXEC,
    REPO_ROOT,
    announced_rank_pids,
    child_env,
    op_library_built_against,
    run_job,
)

from kerasdist import knobs
from kerasdist.run import launcher, mpi, output

HYDRA_VERSION_TEXT = """HYDRA build details:
    Version:                                 5.0.2
    Process Manager:                         pmi
    Launchers available:                     ssh rsh fork slurm ll lsf sge manual persist
"""
OPEN_MPI_VERSION_TEXT = """mpirun (Open MPI) 4.1.5

Report bugs to http://www.open-mpi.org/community/help/
"""
INTEL_MPI_VERSION_TEXT = """Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619 (id: c2e19c2f3e)
Copyright 2003-2023, Intel Corporation.
"""
# The options that make hydra tag each piece of a rank's output, as a dry run prints them.
HYDRA_TAGS = "-prepend-pattern '[%r]<kerasdist>:'"
VERSION_TEXTS = {"mpich": HYDRA_VERSION_TEXT, "openmpi": OPEN_MPI_VERSION_TEXT, "intel": INTEL_MPI_VERSION_TEXT}
LAUNCHER = [sys.executable, "-m", "kerasdist.run"]
QUICK_TIMEOUT_S = 60


pytestmark = LAUNCH_TEST_MARKS


@pytest.fixture
def fake_mpiexec(tmp_path):
    """An executable file to name in KERASDIST_MPIEXEC; it is never run."""
    path = tmp_path / "bin" / "mpiexec"
    path.parent.mkdir()
    path.write_text("#!/bin/sh\nexit 99\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _dry_run(argv, fake_mpiexec, version_text, capsys, **environ):
    """main(--dry-run argv) with `fake_mpiexec` answering --version with `version_text`, for an op
    library built against that mpiexec's MPI."""
    flavour = environ.get("KERASDIST_MPI_FLAVOUR") or mpi.flavour_from_version_text(version_text).name
    with op_library_built_against(flavour):
        status = launcher.main(
            ["--dry-run", *argv],
            environ={"KERASDIST_MPIEXEC": fake_mpiexec, **environ},
            run_version=lambda _path: version_text,
        )
    assert status == 0
    return capsys.readouterr().out.strip()


def _usage_error(argv, capsys, **environ):
    """Runs main(argv), expects a usage error, returns its one-line message."""
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(argv, environ=environ, run_version=lambda _path: HYDRA_VERSION_TEXT)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kerasdist-run: error: "), err
    return err


# ---- the command line for each flavour ----------------------------------------------------


@pytest.mark.parametrize("flavour_name, text", VERSION_TEXTS.items())
def test_mpiexec_version_output_tells_the_flavour(flavour_name, text):
    assert mpi.flavour_from_version_text(text).name == flavour_name


def test_unrecognised_version_output_is_no_flavour():
    assert mpi.flavour_from_version_text("mpiexec.gforker: unrecognized argument --version") is None


def test_mpich_command_uses_hosts_and_genv(fake_mpiexec, capsys):
    out = _dry_run(
        ["-np", "4", "-H", "node1:2,node2:2", "--log-level", "info", "python", "train.py", "--lr=0.1"],
        fake_mpiexec,
        HYDRA_VERSION_TEXT,
        capsys,
    )
    assert out == (
        f"{fake_mpiexec} -np 4 {HYDRA_TAGS} -hosts node1:2,node2:2 -genv KERASDIST_LOG_LEVEL info python train.py "
        "--lr=0.1"
    )


def test_intel_mpi_command_uses_hostfile_option_f_and_genv(fake_mpiexec, tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1:2\nnode2:2\n")
    out = _dry_run(
        ["-np", "4", "--hostfile", str(hostfile), "--cycle-time-ms", "2.5", "python", "train.py"],
        fake_mpiexec,
        INTEL_MPI_VERSION_TEXT,
        capsys,
    )
    assert out == f"{fake_mpiexec} -np 4 -f {hostfile} -genv KERASDIST_CYCLE_TIME_MS 2.5 python train.py"


def test_open_mpi_command_uses_capital_h_and_x(fake_mpiexec, capsys):
    out = _dry_run(
        ["-np", "2", "-H", "a:1,b:1", "--stall-warning-s", "5", "--stall-timeout-s", "30", "python", "train.py"],
        fake_mpiexec,
        OPEN_MPI_VERSION_TEXT,
        capsys,
    )
    assert out == (
        f"{fake_mpiexec} -np 2 --bind-to none --tag-output -H a:1,b:1 -x KERASDIST_STALL_WARNING_S=5 "
        f"-x KERASDIST_STALL_TIMEOUT_S=30 python train.py"
    )


def test_open_mpi_hostfile_option_is_long(fake_mpiexec, tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\n")
    out = _dry_run(
        ["-np", "2", "--hostfile", str(hostfile), "python", "t.py"], fake_mpiexec, OPEN_MPI_VERSION_TEXT, capsys
    )
    assert out == f"{fake_mpiexec} -np 2 --bind-to none --tag-output --hostfile {hostfile} python t.py"


def test_fusion_threshold_is_passed_in_bytes(fake_mpiexec, capsys):
    out = _dry_run(
        ["-np", "2", "--fusion-threshold-mb", "32", "python", "t.py"], fake_mpiexec, HYDRA_VERSION_TEXT, capsys
    )
    assert f"-genv KERASDIST_FUSION_THRESHOLD {32 * 1024 * 1024} " in out
    out = _dry_run(
        ["-np", "2", "--fusion-threshold-mb", "0.5", "python", "t.py"], fake_mpiexec, HYDRA_VERSION_TEXT, capsys
    )
    assert "-genv KERASDIST_FUSION_THRESHOLD 524288 " in out


def test_timeline_path_is_made_absolute(fake_mpiexec, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = _dry_run(
        ["-np", "2", "--timeline", "trace.json", "python", "t.py"], fake_mpiexec, OPEN_MPI_VERSION_TEXT, capsys
    )
    assert f"-x KERASDIST_TIMELINE={Path.cwd() / 'trace.json'} " in out


def test_knobs_already_in_the_environment_are_passed_on_and_flags_win(fake_mpiexec, capsys):
    out = _dry_run(
        ["-np", "2", "--log-level", "debug", "python", "t.py"],
        fake_mpiexec,
        OPEN_MPI_VERSION_TEXT,
        capsys,
        KERASDIST_CACHE_CAPACITY="8",
        KERASDIST_LOG_LEVEL="error",
        UNRELATED="1",
    )
    assert out == (
        f"{fake_mpiexec} -np 2 --bind-to none --tag-output --oversubscribe "
        "-x KERASDIST_CACHE_CAPACITY=8 -x KERASDIST_LOG_LEVEL=debug python t.py"
    )


def test_mpi_args_come_after_ours_and_before_the_command(fake_mpiexec, capsys):
    out = _dry_run(
        ["-np", "2", "--mpi-args", "-bind-to core -genv FOO 'a b'", "python", "t.py"],
        fake_mpiexec,
        HYDRA_VERSION_TEXT,
        capsys,
    )
    assert out == f"{fake_mpiexec} -np 2 {HYDRA_TAGS} -bind-to core -genv FOO 'a b' python t.py"


def test_flavour_override_beats_version_output(fake_mpiexec, capsys):
    out = _dry_run(
        ["-np", "2", "-H", "a:2", "python", "t.py"],
        fake_mpiexec,
        HYDRA_VERSION_TEXT,
        capsys,
        KERASDIST_MPI_FLAVOUR="openmpi",
    )
    assert out == f"{fake_mpiexec} -np 2 --bind-to none --tag-output -H a:2 python t.py"


def test_a_double_dash_before_the_command_is_dropped(fake_mpiexec, capsys):
    out = _dry_run(["-np", "2", "--", "python", "t.py"], fake_mpiexec, HYDRA_VERSION_TEXT, capsys)
    assert out == f"{fake_mpiexec} -np 2 {HYDRA_TAGS} python t.py"


def test_mpiexec_is_found_beside_this_python_without_override():
    mpiexec, source = mpi.find_mpiexec({"PATH": ""}, recorded_at_build=None)
    assert mpiexec == str(MPIEXEC) and source == "beside this Python"


def test_mpiexec_recorded_at_build_comes_before_the_one_beside_python(fake_mpiexec):
    assert mpi.find_mpiexec({}, recorded_at_build=fake_mpiexec) == (fake_mpiexec, "build_info.json")


# ---- bad arguments: one line on stderr naming the argument, exit status 2 -----------------


@pytest.mark.parametrize(
    "argv, names",
    [
        (["python", "t.py"], "-np"),
        (["-np", "2"], "no command"),
        (["-np", "0", "python", "t.py"], "-np"),
        (["-np", "two", "python", "t.py"], "-np"),
        (["-np", "2", "-H", "a:2", "--hostfile", __file__, "python", "t.py"], "not allowed with"),
        (["-np", "2", "-H", "a:0", "python", "t.py"], "-H"),
        (["-np", "2", "--hostfile", "/no/such/hostfile", "python", "t.py"], "--hostfile"),
        (["-np", "2", "--fusion-threshold-mb", "big", "python", "t.py"], "--fusion-threshold-mb"),
        (["-np", "2", "--cycle-time-ms", "fast", "python", "t.py"], "--cycle-time-ms"),
        (["-np", "2", "--stall-warning-s", "nan", "python", "t.py"], "--stall-warning-s"),
        (["-np", "2", "--stall-timeout-s", "-1", "python", "t.py"], "--stall-timeout-s"),
        (["-np", "2", "--log-level", "verbose", "python", "t.py"], "--log-level"),
        (["-np", "2", "--mpi-args", "'unclosed", "python", "t.py"], "--mpi-args"),
    ],
)
def test_bad_argument_is_a_usage_error_naming_it(argv, names, capsys, fake_mpiexec):
    err = _usage_error(argv, capsys, KERASDIST_MPIEXEC=fake_mpiexec)
    assert names in err


# Every engine flag but --timeline (any path will do) checks its text as kerasdist.init() would.
CHECKED_KNOB_FLAGS = [knob.flag for knob in knobs.KNOBS if knob.parse is not knobs._text]


@pytest.mark.parametrize("value", ["garbage", "-1", ""])
@pytest.mark.parametrize("flag", CHECKED_KNOB_FLAGS)
def test_every_engine_flag_refuses_garbage_naming_itself(flag, value, capsys, fake_mpiexec):
    err = _usage_error(["-np", "2", flag, value, "python", "t.py"], capsys, KERASDIST_MPIEXEC=fake_mpiexec)
    assert flag in err and repr(value) in err


@pytest.mark.parametrize(
    "argv, names",
    [
        (["-np", "2", "--restarts", "-1", "python", "t.py"], "--restarts"),
        (["-np", "2", "--restarts", "twice", "python", "t.py"], "--restarts"),
        (["-np", "2", "-H", "", "python", "t.py"], "-H"),
        (["-np", "2", "-H", "a:two", "python", "t.py"], "-H"),
        (["-np", "2", "-H", "a:1,,b:1", "python", "t.py"], "-H"),
        (["-np", "2", "-H", "a:-1", "python", "t.py"], "-H"),
        (["-np", "2.5", "python", "t.py"], "-np"),
    ],
)
def test_bad_restarts_and_host_lists_are_usage_errors_naming_them(argv, names, capsys, fake_mpiexec):
    err = _usage_error(argv, capsys, KERASDIST_MPIEXEC=fake_mpiexec)
    assert names in err


def test_unknown_flavour_override_is_a_usage_error(fake_mpiexec, capsys):
    err = _usage_error(
        ["-np", "2", "python", "t.py"], capsys, KERASDIST_MPIEXEC=fake_mpiexec, KERASDIST_MPI_FLAVOUR="mvapich"
    )
    assert "KERASDIST_MPI_FLAVOUR='mvapich'" in err and "openmpi" in err


def test_missing_mpiexec_override_is_a_usage_error(capsys):
    err = _usage_error(["-np", "2", "python", "t.py"], capsys, KERASDIST_MPIEXEC="/no/such/mpiexec")
    assert "KERASDIST_MPIEXEC" in err


def test_unrecognised_mpiexec_asks_for_the_flavour(fake_mpiexec, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(
            ["-np", "2", "python", "t.py"],
            environ={"KERASDIST_MPIEXEC": fake_mpiexec},
            run_version=lambda _path: "some other launcher 1.0",
        )
    assert exit_info.value.code == 2
    assert "KERASDIST_MPI_FLAVOUR" in capsys.readouterr().err


def test_bad_knob_in_the_environment_is_a_usage_error(fake_mpiexec, capsys):
    err = _usage_error(
        ["-np", "2", "python", "t.py"], capsys, KERASDIST_MPIEXEC=fake_mpiexec, KERASDIST_CACHE_CAPACITY="lots"
    )
    assert "KERASDIST_CACHE_CAPACITY" in err


def test_usage_error_from_the_command_line_is_one_line_and_exit_2(tmp_path):
    finished = subprocess.run(
        [*LAUNCHER, "-np", "0", "python", "t.py"],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=tmp_path,
        timeout=QUICK_TIMEOUT_S,
    )
    assert finished.returncode == 2
    assert finished.stderr.count("\n") == 1 and "argument -np/-n" in finished.stderr, finished.stderr


# ---- exit status and signals ---------------------------------------------------------------


def test_child_killed_by_a_signal_exits_128_plus_it():
    assert launcher.run_forwarding_signals(["sh", "-c", "kill -KILL $$"]) == 128 + signal.SIGKILL


def test_an_mpiexec_that_outlives_a_rank_ending_the_job_is_stopped(monkeypatch, capsys):
    """Hydra waits without end for a proxy on a host it can no longer reach (tests/multihost/
    test_link_down.py): once a rank said it ends the job, mpiexec gets the grace period."""
    monkeypatch.setattr(launcher, "LAUNCHER_GRACE_S", 1)
    copied = io.BytesIO()
    a_stuck_mpiexec = (
        "import sys, time; sys.stderr.write('[kerasdist rank 0] ERROR: kerasdist: it stopped. Ending this rank "
        "with status 1 so that the launcher ends the job.\\n'); sys.stderr.flush(); time.sleep(60)"
    )
    started = time.monotonic()
    status = launcher.run_forwarding_signals(
        [sys.executable, "-c", a_stuck_mpiexec], output.JobOutput(io.BytesIO(), copied)
    )
    assert status == 1 and time.monotonic() - started < 15
    assert b"so that the launcher ends the job" in copied.getvalue()
    assert "had not exited 1 s later" in capsys.readouterr().err


def test_an_mpiexec_still_ending_the_job_in_the_grace_period_keeps_its_status(monkeypatch):
    monkeypatch.setattr(launcher, "LAUNCHER_GRACE_S", 30)
    ends_in_time = (
        "import sys, time; sys.stderr.write('so that the launcher ends the job\\n'); sys.stderr.flush(); "
        "time.sleep(1); sys.exit(7)"
    )
    status = launcher.run_forwarding_signals(
        [sys.executable, "-c", ends_in_time], output.JobOutput(io.BytesIO(), io.BytesIO())
    )
    assert status == 7


def test_exit_status_of_a_real_job_is_passed_through(tmp_path):
    job = run_job([*LAUNCHER, "-np", "2", sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path)
    assert not job.timed_out and job.returncode == 3, job.describe()


def test_successful_real_job_exits_0(tmp_path):
    job = run_job([*LAUNCHER, "-np", "2", sys.executable, "-c", "print('HELLO')"], tmp_path)
    assert job.returncode == 0 and job.output.count("HELLO") == 2, job.describe()


_SLEEPING_RANK = (
    "import os, time; print('LAUNCH_PID rank=%s pid=%d' % (os.environ['PMI_RANK'], os.getpid()), "
    "flush=True); time.sleep(120)"
)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_stops_the_job_and_exits_128_plus_it(tmp_path, signum):
    log_path = tmp_path / "job.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*LAUNCHER, "-np", "2", sys.executable, "-c", _SLEEPING_RANK],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=tmp_path,
            env=child_env(),
            start_new_session=True,
        )
    rank_pids = []
    try:
        rank_pids = announced_rank_pids(log_path, 2, QUICK_TIMEOUT_S, proc)
        assert len(rank_pids) == 2, log_path.read_text()
        proc.send_signal(signum)
        assert proc.wait(timeout=QUICK_TIMEOUT_S) == 128 + signum, log_path.read_text()
        deadline = time.monotonic() + 10  # hydra finishes cleaning up just after it exits
        while any(Path(f"/proc/{pid}").exists() for pid in rank_pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in rank_pids if Path(f"/proc/{pid}").exists()], "ranks outlived the job"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for pid in rank_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ---- knobs reach the ranks; the other entry points ----------------------------------------

# One write per rank, so two ranks' lines cannot interleave mid-line (see child_env).
_PRINT_KERASDIST_VARIABLES = (
    "import os, sys; rank = os.environ['PMI_RANK']; "
    "sys.stdout.write(''.join(f'RANK{rank} {k}={v}\\n' for k, v in "
    "sorted(os.environ.items()) if k.startswith('KERASDIST_')))"
)


def test_knob_flags_reach_every_rank_environment(tmp_path):
    job = run_job(
        [
            *LAUNCHER,
            "-np",
            "2",
            "--fusion-threshold-mb",
            "8",
            "--cycle-time-ms",
            "1.5",
            "--timeline",
            "trace.json",
            "--stall-warning-s",
            "7",
            "--stall-timeout-s",
            "70",
            "--log-level",
            "DEBUG",
            sys.executable,
            "-c",
            _PRINT_KERASDIST_VARIABLES,
        ],
        tmp_path,
    )
    assert job.returncode == 0 and not job.timed_out, job.describe()
    expected = {
        "KERASDIST_FUSION_THRESHOLD": str(8 * 1024 * 1024),
        "KERASDIST_CYCLE_TIME_MS": "1.5",
        "KERASDIST_TIMELINE": str(tmp_path.resolve() / "trace.json"),
        "KERASDIST_STALL_WARNING_S": "7",
        "KERASDIST_STALL_TIMEOUT_S": "70",
        "KERASDIST_LOG_LEVEL": "debug",
    }
    for rank in range(2):
        seen = dict(line.split("=", 1) for line in job.lines_with(f"RANK{rank} "))
        assert seen == expected, job.describe()


def test_dry_run_prints_the_command_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    finished = subprocess.run(
        [*LAUNCHER, "-np", "2", "--dry-run", "touch", str(marker)],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=tmp_path,
        timeout=QUICK_TIMEOUT_S,
    )
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.split() == [str(MPIEXEC), "-np", "2", *HYDRA_TAGS.split(), "touch", str(marker)]
    assert not marker.exists()


@pytest.mark.parametrize("spelling", ["-n", "--np"])
def test_the_rank_count_takes_mpiexec_s_other_spellings(tmp_path, spelling):
    finished = subprocess.run(
        [*LAUNCHER, spelling, "3", "--dry-run", "true"],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=tmp_path,
        timeout=QUICK_TIMEOUT_S,
    )
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.split()[:3] == [str(MPIEXEC), "-np", "3"]


def test_verbose_prints_the_command_to_stderr_then_runs_it(tmp_path):
    finished = subprocess.run(
        [*LAUNCHER, "-np", "1", "--verbose", sys.executable, "-c", "print('RAN')"],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=tmp_path,
        timeout=QUICK_TIMEOUT_S,
    )
    assert finished.returncode == 0, finished.stderr
    assert f"{MPIEXEC} -np 1 " in finished.stderr and "RAN" in finished.stdout


def test_check_build_describes_the_op_library_and_its_mpi(tmp_path):
    finished = subprocess.run(
        [*LAUNCHER, "--check-build"],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=tmp_path,
        timeout=QUICK_TIMEOUT_S,
    )
    assert finished.returncode == 0, finished.stdout + finished.stderr
    build_info = launcher.read_build_info()
    assert build_info is not None, "no kerasdist/build_info.json: run `make build`"
    assert str(REPO_ROOT / "kerasdist") in finished.stdout  # where the op library is
    assert f"TensorFlow {build_info['tensorflow']}" in finished.stdout
    assert build_info["mpi"] in finished.stdout and "NCCL:           no" in finished.stdout
    assert f"launch mpiexec: {MPIEXEC} (MPICH (hydra)" in finished.stdout, finished.stdout


def test_build_recorded_this_environment_s_mpiexec_and_flavour():
    build_info = launcher.read_build_info()
    assert build_info is not None, "no kerasdist/build_info.json: run `make build`"
    assert build_info["mpiexec"] == str(MPIEXEC) and build_info["mpi_flavour"] == "mpich"


def test_console_script_and_python_m_build_the_same_command(tmp_path):
    script = Path(sys.executable).parent / "kerasdist-run"
    assert script.exists(), f"{script} missing: `make build` installs it (pip install -e .)"
    argv = ["-np", "3", "--log-level", "info", "--dry-run", "python", "train.py"]
    outputs = [
        subprocess.run(
            entry + argv, capture_output=True, text=True, env=child_env(), cwd=tmp_path, timeout=QUICK_TIMEOUT_S
        )
        for entry in ([str(script)], LAUNCHER)
    ]
    assert [o.returncode for o in outputs] == [0, 0], [o.stderr for o in outputs]
    assert outputs[0].stdout == outputs[1].stdout


def test_launcher_imports_neither_tensorflow_nor_mpi4py(tmp_path):
    check = (
        "import sys, kerasdist.run; heavy = {'tensorflow', 'mpi4py'} & set(sys.modules); "
        "sys.exit(f'imported {heavy}' if heavy else 0)"
    )
    finished = subprocess.run(
        [sys.executable, "-c", check],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=tmp_path,
        timeout=QUICK_TIMEOUT_S,
    )
    assert finished.returncode == 0, finished.stderr


def test_site_wrapper_script_runs_a_two_process_job(tmp_path):
    # One write per line: the two ranks print at once (see child_env).
    say_rank = "import os, sys; sys.stdout.write('WRAPPED_RANK ' + os.environ['PMI_RANK'] + '\\n')"
    job = run_job(
        [REPO_ROOT / "scripts" / "mpirun.sh", "-np", "2", sys.executable, "-c", say_rank],
        tmp_path,
        timeout=DEFAULT_JOB_TIMEOUT_S,
    )
    assert job.returncode == 0 and not job.timed_out, job.describe()
    assert sorted(job.lines_with("WRAPPED_RANK ")) == ["0", "1"], job.describe()


def test_a_script_path_with_shell_metacharacters_runs_as_named_and_nothing_else(tmp_path):
    # The launcher hands argv lists to mpiexec, never a shell: `;`, `$(...)`, quotes and spaces
    # in a path stay part of the path.
    directory = tmp_path / "it's a dir; touch INJECTED $(touch INJECTED2) `touch INJECTED3`"
    directory.mkdir()
    script = directory / "train.py"
    script.write_text("import sys; print('RAN', sys.argv[1])\n")
    job = run_job([*LAUNCHER, "-np", "2", script, "arg; touch INJECTED4"], tmp_path)
    assert job.returncode == 0 and job.output.count("RAN arg; touch INJECTED4") == 2, job.describe()
    assert not list(tmp_path.rglob("INJECTED*")) and not list(Path.cwd().glob("INJECTED*"))
