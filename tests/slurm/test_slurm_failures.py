"""kerasdist's failure paths under a real Slurm: 2 emulated hosts (scripts/slurm_cluster.sh), one
rank on each, PyPI's MPICH with its ofi netmod over TCP.

- `kerasdist-run --restarts 1` in a batch job: rank 1 raises in epoch 2 of the first attempt, the
  second resumes from the last complete checkpoint and ends on the weights of a run never
  interrupted.
- A node lost in the middle of a job (its link goes silent, then everything on it, its slurmd
  included, is killed, as when it loses power): under `srun` and under `kerasdist-run` in a batch
  job, the job ends within the collective timeout (and, under srun, Slurm's KillWait), with a
  message naming the rank and its host.
- `scancel` while rank 0 is inside a checkpoint save: the save completes, then every rank ends
  (SIGTERM); the checkpoints on disk are whole and nothing is left running.
- A batch job with `--requeue` (docs/reliability.md's script, as written), requeued in the middle
  of an epoch as a preemption would: the second run (SLURM_RESTART_COUNT=1) resumes from the last
  checkpoint and ends on the uninterrupted weights.

The detection times are printed for docs/reliability.md; the bounds asserted are loose, as the
machine is shared. Every wait is bounded.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from launch_utils import REPO_ROOT
from slurm_utils import SLURM_SCRIPT

SCRIPT = Path(__file__).resolve().parent / "scripts" / "preemptible_training.py"
PYTHON = sys.executable
KERASDIST_RUN = str(Path(sys.executable).parent / "kerasdist-run")
COLLECTIVE_TIMEOUT_S = 5
# The rest of the step (the script's ranks wait 1 s after it); then a waiting rank asks its peers
# after 5 s, takes one silent for the collective timeout for gone, and aborts 1 s after its message.
LOST_RANK_NAMED_WITHIN_S = 1 + 5 + COLLECTIVE_TIMEOUT_S + 1
# Start-up of TensorFlow on 2 ranks, teardown and scheduling on a loaded 2-core machine.
SLACK_S = 10
JOB_TIMEOUT_S = 180
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
# How long rank 0 holds its save open in scripts/preemptible_training.py --pause-in-save.
PAUSE_IN_SAVE_S = 3


def _job_env(extra=None):
    """What the jobs add to the cluster's job environment."""
    return {"TF_NUM_INTRAOP_THREADS": 1, **(extra or {})}


def _slurm(cluster, *argv, env=None, cwd=None):
    """Runs a Slurm command of this cluster (from `cwd`); its standard output."""
    done = subprocess.run(
        argv, env=cluster.job_env(**_job_env(env)), cwd=cwd, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, f"{' '.join(argv)}: {done.stdout}{done.stderr}"
    return done.stdout


def _job_fields(cluster, job_id):
    line = _slurm(cluster, "scontrol", "show", "job", "-o", str(job_id))
    return dict(re.findall(r"(\w+)=(\S*)", line))


def _wait_for_state(cluster, job_id, states, timeout):
    deadline = time.monotonic() + timeout
    while True:
        fields = _job_fields(cluster, job_id)
        if fields["JobState"] in states:
            return fields
        assert time.monotonic() < deadline, f"job {job_id} not in {sorted(states)} after {timeout} s: {fields}"
        time.sleep(0.2)


def _wait_for_file(path, what, timeout=JOB_TIMEOUT_S, output=None):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{what} not within {timeout} s" + (
            f":\n{output.read_text()[-4000:]}" if output and output.exists() else ""
        )
        time.sleep(0.05)


def _sbatch(cluster, batch_script, cwd, env=None):
    """Submits `batch_script` (text) from `cwd`: (job id, its output file, cwd/slurm-JOBID.out)."""
    path = cwd / "job.sh"
    path.write_text(batch_script)
    job_id = int(_slurm(cluster, "sbatch", "--parsable", str(path), env=env, cwd=cwd).strip().split(";")[0])
    return job_id, cwd / f"slurm-{job_id}.out"


def _kill_wait_s(cluster):
    """Slurm's KillWait in the cluster's slurm.conf (30 s when it is not set)."""
    found = re.search(r"^KillWait=(\d+)", Path(cluster.env["SLURM_CONF"]).read_text(), re.M)
    return int(found.group(1)) if found else 30


def _lines_with(text, prefix):
    return [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]


def _placements(text):
    """The PLACED reports, per attempt: {attempt: {rank: host}}."""
    placed = {}
    for report in _lines_with(text, "PLACED "):
        entry = json.loads(report)
        placed.setdefault(entry["attempt"], {})[entry["rank"]] = entry["host"]
    return placed


def _processes_mentioning(text):
    """Pids of the processes whose command line holds `text` (a test's own directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass  # ended meanwhile
    return found


def _training(directory, *options):
    return [PYTHON, str(SCRIPT), str(directory), *map(str, options)]


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster, tmp_path_factory):
    """An srun of the training, never interrupted: its output and its checkpoint directory."""
    cwd = tmp_path_factory.mktemp("uninterrupted")
    job = slurm_cluster.run(
        ["srun", "--mpi=pmi2", "-N2", "-n2", *_training(cwd / "checkpoints")],
        cwd,
        env=_job_env(),
        timeout=JOB_TIMEOUT_S,
        script_name=SCRIPT.name,
    )
    assert job.returncode == 0 and not job.timed_out, job.describe()
    assert len(set(_placements(job.output)[0].values())) == 2, job.describe()  # one rank on each host
    [weights] = _lines_with(job.output, "WEIGHTS=")
    return weights, cwd / "checkpoints"


def test_kerasdist_run_restarts_inside_an_allocation_and_resumes_from_the_last_checkpoint(
    slurm_cluster, uninterrupted, tmp_path
):
    weights, _ = uninterrupted
    command = [KERASDIST_RUN, "-np", "2", "--restarts", "1", *_training(tmp_path / "checkpoints")]
    command += ["--raise-on-rank", "1", "--in-epoch", "2"]
    batch_script = "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n" + " ".join(command) + "\n"
    job_id, output = _sbatch(slurm_cluster, batch_script, tmp_path)
    try:
        fields = _wait_for_state(slurm_cluster, job_id, FINAL_STATES, JOB_TIMEOUT_S)
    finally:
        slurm_cluster.command(["scancel", str(job_id)])  # if it is still there: free the nodes
    text = output.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", f"{fields}\n{text}"
    assert "injected fault on rank 1 in epoch 2" in text, text
    assert "the job ended with status 1; starting it again (restart 1 of 1)" in text, text
    # The second attempt started after epoch 2's checkpoint (epochs count from 0 in the fault).
    assert sorted(re.findall(r"RESUMED_FROM=(\d+)", text)) == ["0", "0", "2", "2"], text
    placed = _placements(text)
    assert sorted(placed) == [0, 1] and all(len(set(hosts.values())) == 2 for hosts in placed.values()), text
    assert _lines_with(text, "WEIGHTS=") == [weights], text


def test_scancel_during_a_save_keeps_that_checkpoint_whole_and_leaves_no_process(
    slurm_cluster, uninterrupted, tmp_path
):
    """Rank 0 is inside epoch 2's save (the archive written under its temporary name, not yet
    renamed) when Slurm sends SIGTERM to every task: it completes the save, then ends."""
    import keras  # here, so that collecting the Slurm tests does not start TensorFlow

    _, uninterrupted_checkpoints = uninterrupted
    marker = tmp_path / "rank0-is-saving"
    directory = tmp_path / "checkpoints"
    name = f"kd-scancel-{os.getpid()}"
    finished = {}

    def run():
        finished["job"] = slurm_cluster.run(
            ["srun", "--job-name", name, "--mpi=pmi2", "-N2", "-n2"]
            + _training(directory, "--pause-in-save", 1, "--marker", marker),
            tmp_path,
            env=_job_env(),
            timeout=JOB_TIMEOUT_S,
            script_name=SCRIPT.name,
        )

    job_thread = threading.Thread(target=run)
    job_thread.start()
    try:
        _wait_for_file(marker, "rank 0's save of epoch 2")
        save_paused_at = time.monotonic()
        [job_id] = _slurm(slurm_cluster, "squeue", "-h", "-n", name, "-o", "%i").split()
        _slurm(slurm_cluster, "scancel", job_id)
        # Otherwise the SIGTERM may have come after the save, and the test would prove nothing.
        assert time.monotonic() - save_paused_at < PAUSE_IN_SAVE_S - 1, "scancel came too late"
    except BaseException:
        slurm_cluster.command(["scancel", "--full", "--user", "root"])  # the job must not outlive the test
        raise
    finally:
        job_thread.join(JOB_TIMEOUT_S + 30)
    job = finished["job"]
    assert not job.timed_out and job.returncode == 128 + signal.SIGTERM, job.describe()
    assert "task 0: Terminated" in job.output and "task 1: Terminated" in job.output, job.describe()
    fields = _wait_for_state(slurm_cluster, job_id, FINAL_STATES, 60)
    assert fields["JobState"] == "CANCELLED", fields
    assert _processes_mentioning(str(tmp_path)) == [], job.describe()
    # Epoch 2's save was completed: both checkpoints whole, nothing half-written beside them.
    assert sorted(p.name for p in directory.iterdir()) == [
        "checkpoint_state.json",
        "epoch0001.keras",
        "epoch0002.keras",
    ], job.describe()
    assert json.loads((directory / "checkpoint_state.json").read_text())["latest"] == "epoch0002.keras"
    for checkpoint in ("epoch0001.keras", "epoch0002.keras"):
        saved = keras.saving.load_model(directory / checkpoint, compile=False).get_weights()
        expected = keras.saving.load_model(uninterrupted_checkpoints / checkpoint, compile=False).get_weights()
        assert all((a == b).all() for a, b in zip(saved, expected, strict=True)), checkpoint


def _recipe(*, notice):
    """The batch script of docs/reliability.md's Slurm section that requeues after a notice
    (`#SBATCH --signal`), or the one Slurm requeues."""
    text = (REPO_ROOT / "docs" / "reliability.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    [script] = [block for block in blocks if "#SBATCH --requeue" in block and ("#SBATCH --signal" in block) == notice]
    return script


def _run_requeued(cluster, recipe, tmp_path, interrupt):
    """Submits `recipe` training slowly from epoch 2, runs the Slurm command `interrupt` (+ job id)
    once epoch 2 began, lets the requeued job start at once, and waits for its end: (the job's
    fields, the output of both runs)."""
    marker = tmp_path / "epoch-2-step-1-done"
    # The recipe runs `.venv/bin/python train.py` in the directory it was submitted from.
    (tmp_path / ".venv").symlink_to(Path(PYTHON).parent.parent)
    training = _training("checkpoints", "--slow-from-epoch", 2, "--marker", marker)[1:]
    (tmp_path / "train.py").write_text(
        f"import runpy, sys\nsys.argv = {training!r}\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    job_id, output = _sbatch(cluster, recipe, tmp_path)
    try:
        _wait_for_file(marker, "epoch 2", output=output)
        _slurm(cluster, *interrupt, str(job_id))
        # Slurm holds a requeued job back for AuthInfo's cred_expire (120 s by default); let it go now.
        _wait_for_state(cluster, job_id, {"PENDING"}, 60)
        _slurm(cluster, "scontrol", "update", f"JobId={job_id}", "StartTime=now")
        fields = _wait_for_state(cluster, job_id, FINAL_STATES, JOB_TIMEOUT_S)
    finally:
        cluster.command(["scancel", str(job_id)])
    return fields, output.read_text()  # both runs: the recipes append (--open-mode=append)


def test_a_requeued_batch_job_resumes_from_the_last_checkpoint(slurm_cluster, uninterrupted, tmp_path):
    weights, _ = uninterrupted
    fields, text = _run_requeued(slurm_cluster, _recipe(notice=False), tmp_path, ["scontrol", "requeue"])
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", f"{fields}\n{text}"
    assert "DUE TO JOB REQUEUE" in text, text
    assert sorted(_placements(text)) == [0, 1], text  # SLURM_RESTART_COUNT: 1 in the second run
    # The second run started after epoch 2's checkpoint, the last complete one.
    assert re.findall(r"RESUMED_FROM=(\d+)", text) == ["0", "0", "2", "2"], text
    assert _lines_with(text, "WEIGHTS=") == [weights], text


def _lose_host(cluster, host):
    """Takes `host`'s link down, then kills every process on it (its slurmd, slurmstepd, ranks):
    to the others the node goes silent, as when it loses power."""
    link = subprocess.run(
        ["nsenter", f"--net=/run/netns/{host}", "ip", "link", "set", cluster.interface, "down"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert link.returncode == 0, link.stderr
    namespace = os.stat(f"/run/netns/{host}").st_ino
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.stat(entry / "ns" / "net").st_ino == namespace:
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass  # ended meanwhile


def _bring_back(cluster, host):
    """Puts `host`'s link up and starts its slurmd again; waits until Slurm sees every node idle."""
    subprocess.run(
        ["nsenter", f"--net=/run/netns/{host}", "ip", "link", "set", cluster.interface, "up"],
        check=True,
        timeout=30,
    )
    subprocess.run([SLURM_SCRIPT, "start-slurmd", cluster.directory, host], check=True, timeout=30)
    # The lost job stays COMPLETING, holding both nodes, until the slurmd is back.
    deadline = time.monotonic() + 60
    while sorted(_slurm(cluster, "sinfo", "-h", "-N", "-t", "idle", "-o", "%N").split()) != sorted(cluster.hosts):
        assert time.monotonic() < deadline, f"{cluster.hosts} not all idle again within 60 s"
        time.sleep(0.2)


def _srun_struck_in_epoch_1(cluster, tmp_path, strike):
    """srun of the training, `strike()` called in epoch 1. (output, status, seconds to the end)"""
    marker = tmp_path / "epoch-1-step-1-done"
    finished = {}

    def run():
        finished["job"] = cluster.run(
            ["srun", "--mpi=pmi2", "-N2", "-n2"]
            + _training(tmp_path / "checkpoints", "--slow-from-epoch", 1, "--marker", marker),
            tmp_path,
            env=_job_env({"KERASDIST_COLLECTIVE_TIMEOUT_S": COLLECTIVE_TIMEOUT_S}),
            timeout=JOB_TIMEOUT_S,
            script_name=SCRIPT.name,
        )

    job_thread = threading.Thread(target=run)
    job_thread.start()
    try:
        # Struck at once, while every rank waits a second after its step: the rank left then
        # waits for the lost one in the next step's negotiation, which names the rank it misses.
        _wait_for_file(marker, "epoch 1's first step")
        fault_at = time.time()
        strike()
    except BaseException:
        cluster.command(["scancel", "--full", "--user", "root"])  # the job must not outlive the test
        raise
    finally:
        job_thread.join(JOB_TIMEOUT_S + 30)
    job = finished["job"]
    assert not job.timed_out, job.describe()
    return job.output, job.returncode, job.ended - fault_at


def _kerasdist_run_losing_a_host(cluster, tmp_path):
    """kerasdist-run in a batch job; the second host is lost in epoch 1. (output, its status, seconds
    to the end)"""
    marker = tmp_path / "epoch-1-step-1-done"
    command = [KERASDIST_RUN, "-np", "2"]
    command += _training(tmp_path / "checkpoints", "--slow-from-epoch", 1, "--marker", marker)
    batch_script = (
        "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n"
        + " ".join(command)
        + '\necho "KERASDIST_RUN_STATUS=$? ENDED_AT=$(date +%s.%N)"\n'
    )
    job_id, output = _sbatch(
        cluster, batch_script, tmp_path, env={"KERASDIST_COLLECTIVE_TIMEOUT_S": COLLECTIVE_TIMEOUT_S}
    )
    try:
        _wait_for_file(marker, "epoch 1's first step", output=output)
        fault_at = time.time()
        _lose_host(cluster, cluster.hosts[1])
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while "ENDED_AT=" not in output.read_text():
            assert time.monotonic() < deadline, output.read_text()
            time.sleep(0.1)
    finally:
        cluster.command(["scancel", str(job_id)])
    text = output.read_text()
    [(status, ended_at)] = re.findall(r"KERASDIST_RUN_STATUS=(\d+) ENDED_AT=([0-9.]+)", text)
    return text, int(status), float(ended_at) - fault_at


@pytest.mark.parametrize("form", ["srun", "kerasdist-run"])
def test_a_node_lost_mid_job_ends_the_job_naming_the_rank_and_its_host(slurm_cluster, tmp_path, form):
    lost = slurm_cluster.hosts[1]
    try:
        if form == "srun":
            text, status, detected_after = _srun_struck_in_epoch_1(
                slurm_cluster, tmp_path, lambda: _lose_host(slurm_cluster, lost)
            )
            # srun then waits KillWait + 2 s for the lost node's tasks before it gives up on them.
            bound = LOST_RANK_NAMED_WITHIN_S + _kill_wait_s(slurm_cluster) + 2 + SLACK_S
        else:
            text, status, detected_after = _kerasdist_run_losing_a_host(slurm_cluster, tmp_path)
            bound = LOST_RANK_NAMED_WITHIN_S + SLACK_S
    finally:
        _bring_back(slurm_cluster, lost)
    print(f"LOST NODE UNDER {form.upper()}: DETECTED_AFTER_S={detected_after:.2f} STATUS={status}")
    assert status == 1, text
    assert re.search(rf"rank\(s\) 1 \(host {re.escape(lost)}\) left this rank's questions unanswered", text), text
    assert detected_after < bound, text
    assert "WEIGHTS=" not in text, text


def _kill_rank(directory, rank):
    """SIGKILLs the rank `rank` of the job running in `directory` (its SLURM_PROCID)."""

    def is_the_rank(pid):
        try:
            environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            return (
                f"SLURM_PROCID={rank}".encode() in environment
                and SCRIPT.name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
            )
        except OSError:
            return False  # ended meanwhile

    [pid] = filter(is_the_rank, _processes_mentioning(str(directory)))
    os.kill(pid, signal.SIGKILL)


def test_a_rank_killed_under_srun_ends_the_job(slurm_cluster, tmp_path):
    """srun leaves the other tasks running when one dies (no --kill-on-bad-exit), with its host and
    network up. Rank 0's next negotiation then never returned from MPI_Iallreduce (MPICH's TCP
    transport retried connecting to the dead rank's port), nor from a question to it, and the job
    hung until the test's timeout. The watchdog now watches those calls: rank 0 ends the job, and
    srun names the rank that died."""
    text, status, detected_after = _srun_struck_in_epoch_1(
        slurm_cluster, tmp_path, lambda: _kill_rank(tmp_path / "checkpoints", 1)
    )
    print(f"RANK KILLED UNDER SRUN: DETECTED_AFTER_S={detected_after:.2f} STATUS={status}")
    assert status != 0, text
    assert f"{slurm_cluster.hosts[1]}: task 1: Killed" in text, text
    assert re.search(
        rf"on rank 0 \(host {re.escape(slurm_cluster.hosts[0])}\) has not finished after [0-9.]+ s "
        r"\(KERASDIST_COLLECTIVE_TIMEOUT_S\)",
        text,
    ), text
    assert detected_after < LOST_RANK_NAMED_WITHIN_S + SLACK_S, text
    assert "WEIGHTS=" not in text, text


def test_a_notice_from_scancel_checkpoints_the_step_and_the_job_requeues_itself_and_resumes_there(
    slurm_cluster, uninterrupted, tmp_path
):
    """`scancel --signal=USR1` (what `#SBATCH --signal=USR1@T` sends before the time limit): every
    rank stops at one step boundary with a checkpoint, srun exits 75, the recipe requeues the job,
    and the second run resumes inside epoch 2, where the first stopped, ending on the weights of a
    run never interrupted."""
    weights, _ = uninterrupted
    fields, text = _run_requeued(slurm_cluster, _recipe(notice=True), tmp_path, ["scancel", "--signal=USR1"])
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", f"{fields}\n{text}"
    assert "every rank stopped on notice after batch" in text, text
    [part_epoch] = [path.name for path in (tmp_path / "checkpoints").glob("epoch0003-batch*.keras")]
    assert "Rank0Checkpoint saved this step" in text, text
    assert re.findall(r"RESUMED_FROM=(\d+)", text) == ["0", "0", "2", "2"], f"{part_epoch}\n{text}"
    assert _lines_with(text, "WEIGHTS=") == [weights], text
