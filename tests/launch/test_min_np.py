"""kerasdist-run --min-np: before each attempt, the hosts available now decide how many ranks run,
always a number that divides the planned one, and every rank learns the planned number from
KERASDIST_PLANNED_SIZE. A restart on half the ranks ends on the weights of one process trained
on the planned global batch.

The same with an emulated host lost for good: tests/multihost/test_lost_host.py.
"""

import os
import signal
import stat
import subprocess
import sys
import time

import pytest
from launch_utils import LAUNCH_TEST_MARKS, MPIEXEC, SCRIPTS, child_env, run_job

from kerasdist import runtime
from kerasdist.run import hosts, launcher, mpi

pytestmark = LAUNCH_TEST_MARKS
LAUNCHER = [sys.executable, "-m", "kerasdist.run"]
JOB_TIMEOUT_S = 240
HYDRA_VERSION_TEXT = "HYDRA build details:\n    Version: 5.0.2\n"


@pytest.mark.parametrize(
    "planned, available, min_ranks, expected",
    [
        (8, 8, 1, 8),
        (8, 12, 1, 8),  # never more than planned
        (8, 6, 2, 4),  # 6 and 5 do not divide 8
        (6, 4, 2, 3),  # fewer ranks than slots keeps the batch
        (7, 6, 1, 1),  # a prime: only one rank can stand in for all
        (2, 1, 1, 1),
    ],
)
def test_the_most_ranks_that_fit_and_divide_the_planned_number(planned, available, min_ranks, expected):
    assert hosts.choose_ranks(planned, available, min_ranks) == expected


def test_no_divisor_at_or_above_min_np_is_an_error_naming_the_numbers():
    with pytest.raises(mpi.LaunchError) as error:
        hosts.choose_ranks(8, 7, 5)
    message = str(error.value)
    assert "7 slot(s) are available" in message and "from 5 to 7" in message and "planned 8" in message
    assert "1, 2, 4, 8" in message and "make 8 slots available" in message


def test_fewer_slots_than_min_np_is_an_error():
    with pytest.raises(mpi.LaunchError, match=r"only 1 slot\(s\) are available, fewer than --min-np 2"):
        hosts.choose_ranks(4, 1, 2)


def test_ranks_fill_the_hosts_in_order():
    available = hosts.parse_host_list("a:2,b,c:3")
    assert available == [hosts.Host("a", 2), hosts.Host("b", 1), hosts.Host("c", 3)]
    assert hosts.host_list_text(hosts.place(available, 4)) == "a:2,b:1,c:1"
    assert hosts.host_list_text(hosts.place(available, 2)) == "a:2"


def test_discovery_output_is_one_host_a_line_with_optional_slots():
    assert hosts.parse_discovery_output("node1:4\n\n  node2 \nnode-3.example:1\n", "find-hosts") == [
        hosts.Host("node1", 4),
        hosts.Host("node2", 1),
        hosts.Host("node-3.example", 1),
    ]


@pytest.mark.parametrize(
    "text, line",
    [("node1:4\nnode2:four\n", "'node2:four' on line 2"), ("node1:0\n", "'node1:0' on line 1"), ("a b\n", "'a b'")],
)
def test_discovery_output_that_is_not_host_lines_is_an_error_naming_the_line(text, line):
    with pytest.raises(mpi.LaunchError, match=f"find-hosts printed {line}.*host or host:slots"):
        hosts.parse_discovery_output(text, "find-hosts")


def test_a_host_listed_twice_is_an_error():
    with pytest.raises(mpi.LaunchError, match="listed node1 twice"):
        hosts.parse_discovery_output("node1:2\nnode1:2\n", "find-hosts")


def test_probes_that_fail_or_hang_leave_their_hosts_out_within_the_timeout():
    outcomes = {"up": ["true"], "refuses": ["sh", "-c", "echo no route >&2; exit 3"], "hangs": ["sleep", "60"]}
    started = time.monotonic()
    available, missing = hosts.probe_hosts(hosts.parse_host_list("up:2,refuses,hangs:4"), outcomes.get, timeout=1)
    assert time.monotonic() - started < 5
    assert available == [hosts.Host("up", 2)]
    assert missing == {"refuses": "probe exited with status 3: no route", "hangs": "no answer within 1 s"}


def test_a_stop_that_lands_as_a_probe_starts_still_stops_that_probe(monkeypatch):
    # The race CI met: SIGTERM after Popen has started the child but before it returns the
    # process object, which the cleanup would then not know about.
    started = []
    popen = subprocess.Popen

    def popen_then_stopped(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        os.kill(os.getpid(), signal.SIGTERM)
        return started[-1]

    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    monkeypatch.setattr(hosts.subprocess, "Popen", popen_then_stopped)
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(SystemExit, match=str(128 + signal.SIGTERM)):
            hosts.probe_hosts(hosts.parse_host_list("hangs"), lambda _: ["sleep", "60"], timeout=30)
    finally:
        signal.signal(signal.SIGTERM, previous)
        left_running = [probe for probe in started if probe.poll() is None]
        for probe in left_running:
            probe.kill()
            probe.wait()
    assert len(started) == 1 and not left_running


def test_a_discovery_that_hangs_is_stopped_with_what_it_started(tmp_path):
    child_pid = tmp_path / "child.pid"
    discover = _executable(tmp_path / "find-hosts", f"#!/bin/sh\nsleep 60 &\necho $! > {child_pid}\nwait\n")
    started = time.monotonic()
    with pytest.raises(mpi.LaunchError, match="printed no host list within 2 s"):
        hosts.discover_hosts(discover, dict(os.environ), timeout=2)
    assert time.monotonic() - started < 10
    sleep_pid = int(child_pid.read_text())
    deadline = time.monotonic() + 5  # a killed process may take a moment to go
    while _sleeping(sleep_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left_running = _sleeping(sleep_pid)
    if left_running:
        os.kill(sleep_pid, signal.SIGKILL)
    assert not left_running


def _executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def fake_mpiexec(tmp_path):
    return _executable(tmp_path / "mpiexec", "#!/bin/sh\nexit 99\n")


def _main(argv, fake_mpiexec):
    return launcher.main(argv, environ={"KERASDIST_MPIEXEC": fake_mpiexec}, run_version=lambda _: HYDRA_VERSION_TEXT)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["-np", "2", "-H", "a,b", "--min-np", "1"], "--min-np needs --restarts N"),
        (["-np", "2", "--restarts", "1", "--min-np", "1"], "--min-np needs the hosts"),
        (["-np", "2", "--hostfile", __file__, "--restarts", "1", "--min-np", "1"], "does not read --hostfile"),
        (["-np", "2", "-H", "a,b", "--restarts", "1", "--min-np", "3"], "--min-np 3 is more than the 2 ranks planned"),
        (["-np", "2", "--host-discovery-script", "true"], "--host-discovery-script needs --min-np"),
        (["-np", "2", "-H", "a", "--host-discovery-script", "true"], "not allowed with argument"),
    ],
)
def test_bad_min_np_flags_are_usage_errors(flags, message, fake_mpiexec, capsys):
    with pytest.raises(SystemExit) as exited:
        _main([*flags, "train.py"], fake_mpiexec)
    assert exited.value.code == launcher.USAGE_ERROR
    assert message in capsys.readouterr().err


def test_dry_run_starts_the_ranks_the_discovered_hosts_allow_and_passes_the_planned_size(
    tmp_path, fake_mpiexec, capsys
):
    discover = _executable(tmp_path / "find-hosts", "#!/bin/sh\necho node1:2\necho node2:1\n")
    argv = ["--dry-run", "-np", "4", "--restarts", "1", "--min-np", "1", "--host-discovery-script", discover]
    assert _main([*argv, "python", "train.py"], fake_mpiexec) == 0
    captured = capsys.readouterr()
    assert captured.out.split() == [
        fake_mpiexec,
        "-np",
        "2",
        "-prepend-pattern",
        "'[%r]<kerasdist>:'",
        "-hosts",
        "node1:2",
        "-genv",
        runtime.PLANNED_SIZE_VARIABLE,
        "4",
        "-genv",
        "KERASDIST_RESTART",
        "0",
        "python",
        "train.py",
    ]
    assert "starting 2 of the planned 4 ranks on node1:2: each accumulates 2 times" in captured.err


@pytest.mark.parametrize(
    "script, message",
    [
        ("echo node1:lots", "printed 'node1:lots' on line 1"),
        ("echo cannot reach the scheduler >&2; exit 4", "exited with status 4: cannot reach the scheduler"),
        ("echo node1:1", "only 1 slot(s) are available, fewer than --min-np 2"),
    ],
)
def test_a_discovery_that_fails_or_leaves_too_few_slots_starts_nothing_and_says_why(
    tmp_path, fake_mpiexec, capsys, script, message
):
    discover = _executable(tmp_path / "find-hosts", f"#!/bin/sh\n{script}\n")
    argv = ["-np", "2", "--restarts", "1", "--min-np", "2", "--host-discovery-script", discover, "python", "x.py"]
    assert _main(argv, fake_mpiexec) == 1  # fake_mpiexec would have exited 99
    err = capsys.readouterr().err
    assert message in err and "not starting the job" in err


def _recording_mpiexec(tmp_path, lost_host_probe):
    """An mpiexec that appends "PID ARGS" to tmp_path/calls and runs `lost_host_probe` (shell) when
    it probes host b; every other call succeeds at once."""
    calls = tmp_path / "calls"
    script = f"""#!/bin/sh
echo "$$ $*" >> {calls}
case "$*" in
    *"-hosts b:1 true") {lost_host_probe};;
esac
exit 0
"""
    return _executable(tmp_path / "mpiexec", script), calls


def _launcher_env(mpiexec):
    return child_env(KERASDIST_MPIEXEC=mpiexec, KERASDIST_MPI_FLAVOUR="mpich")


def test_hosts_given_with_h_are_probed_and_a_failing_one_is_left_out(tmp_path):
    mpiexec, calls = _recording_mpiexec(tmp_path, "echo cannot connect >&2; exit 255")
    argv = [*LAUNCHER, "-np", "4", "-H", "a:2,b:2", "--restarts", "1", "--min-np", "1", "python", "train.py"]
    job = run_job(argv, tmp_path, env=_launcher_env(mpiexec), timeout=60)
    assert job.returncode == 0 and not job.timed_out, job.describe()
    assert "host b is unavailable (probe exited with status 255: cannot connect); leaving it out" in job.output
    launched = [line.split(" ", 1)[1] for line in calls.read_text().splitlines()]
    assert sorted(launched[:2]) == ["-np 1 -hosts a:1 true", "-np 1 -hosts b:1 true"]  # probed at once
    assert launched[2].startswith(
        f"-np 2 -prepend-pattern [%r]<kerasdist>: -hosts a:2 -genv {runtime.PLANNED_SIZE_VARIABLE} 4 "
    ), launched


def test_sigterm_while_hosts_are_probed_stops_the_probes_and_the_launcher(tmp_path):
    mpiexec, calls = _recording_mpiexec(tmp_path, "exec sleep 60")
    argv = [*LAUNCHER, "-np", "2", "-H", "a,b", "--restarts", "1", "--min-np", "1", "python", "train.py"]
    launcher_process = subprocess.Popen([str(a) for a in argv], cwd=tmp_path, env=_launcher_env(mpiexec))
    hanging_probe = None
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (calls.exists() and "b:1" in calls.read_text()):
            time.sleep(0.05)
        hanging_probe = next(int(line.split()[0]) for line in calls.read_text().splitlines() if "b:1" in line)
        launcher_process.send_signal(signal.SIGTERM)
        assert launcher_process.wait(timeout=10) == 128 + signal.SIGTERM
    finally:
        launcher_process.kill()
        launcher_process.wait()
        probe_left_running = hanging_probe is not None and _sleeping(hanging_probe)
        if probe_left_running:
            os.kill(hanging_probe, signal.SIGKILL)
    assert not probe_left_running
    assert len(calls.read_text().splitlines()) == 2  # no job was started


def _sleeping(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().startswith(b"sleep")
    except OSError:
        return False


@pytest.mark.parametrize("text, size, expected", [("", 2, 2), (" 4 ", 2, 4), ("3", 1, 3), ("2", 2, 2)])
def test_planned_size_is_read_from_the_environment(text, size, expected):
    assert runtime.planned_size_from_environment({runtime.PLANNED_SIZE_VARIABLE: text}, size) == expected
    assert runtime.planned_size_from_environment({}, size) == size


@pytest.mark.parametrize("text", ["3", "1", "0", "-4", "four"])
def test_a_planned_size_that_is_not_a_multiple_of_the_ranks_is_refused(text):
    with pytest.raises(ValueError, match=f"KERASDIST_PLANNED_SIZE='{text}' must be a whole multiple of this job's 2"):
        runtime.planned_size_from_environment({runtime.PLANNED_SIZE_VARIABLE: text}, 2)


@pytest.mark.parametrize("planned, status", [("4", 0), ("3", 1)])
def test_every_rank_reads_the_planned_size_or_fails_at_init(tmp_path, planned, status):
    program = "import kerasdist as kd; kd.init(); print('PLANNED', kd.rank(), kd.planned_size(), flush=True)"
    job = run_job(
        [MPIEXEC, "-n", "2", sys.executable, "-c", program],
        tmp_path,
        env=child_env(**{runtime.PLANNED_SIZE_VARIABLE: planned}),
        timeout=60,
    )
    assert job.returncode == status and not job.timed_out, job.describe()
    if status == 0:
        assert sorted(job.lines_with("PLANNED ")) == ["0 4", "1 4"], job.describe()
    else:  # both ranks say why
        assert job.output.count("KERASDIST_PLANNED_SIZE='3' must be a whole multiple") == 2, job.describe()


def test_a_restart_on_half_the_ranks_ends_on_one_process_at_the_planned_global_batch(tmp_path):
    # The discovery offers 2 slots to the first attempt and 1 to every later one.
    offered = tmp_path / "offered"
    discover = _executable(
        tmp_path / "find-hosts",
        f"#!/bin/sh\nif [ -e {offered} ]; then echo localhost:1; else touch {offered}; echo localhost:2; fi\n",
    )
    script = SCRIPTS / "shrinking_training.py"
    job = run_job(
        [*LAUNCHER, "-np", "2", "--restarts", "1", "--min-np", "1", "--host-discovery-script", discover]
        + [script, tmp_path / "checkpoints", "raise"],
        tmp_path,
        timeout=JOB_TIMEOUT_S,
        script_name=script.name,
    )
    assert job.returncode == 0 and not job.timed_out, job.describe()
    assert "injected fault in epoch 2" in job.output, job.describe()
    assert "starting 1 of the planned 2 ranks on localhost:1" in job.output, job.describe()
    # The second attempt: one rank, planned two, resumed after the last complete epoch (1).
    assert sorted(job.lines_with("ATTEMPT=")) == [
        "0 SIZE=2 PLANNED=2 RESUMED_FROM=0",
        "0 SIZE=2 PLANNED=2 RESUMED_FROM=0",
        "1 SIZE=1 PLANNED=2 RESUMED_FROM=2",
    ], job.describe()
    assert job.lines_with("ITERATIONS=") == ["20"], job.describe()  # 5 epochs of 4 updates
    assert float(job.lines_with("MAX_DIFFERENCE=")[0]) < 1e-5, job.describe()
