"""Elastic jobs, timed: notices to leave at random steps (the soak), and a job growing back.

How to run (`make bench` runs it with the defaults, ~15 min on a busy 2-core machine):

  .venv/bin/python benchmarks/elastic.py
  .venv/bin/python benchmarks/elastic.py --notices 3 --growths 1     # a quick look

Both run on this one machine, under two names that kerasdist-run takes for two hosts: rank 0 on
`localhost`, rank 1 on the name the machine calls itself (the ranks name their host so). A
discovery program prints a file of hosts this script edits, as a cloud's or a scheduler's list
would change.

notice soak  `kerasdist-run -np 2 --restarts 1 --min-np 1 --discovery-interval 1` runs
    benchmarks/elastic_training.py. --notices times over: once both ranks train, wait a random
    0.5-3 s (a random step), send rank 1 the notice signal (SIGUSR1, as `scancel --signal=USR1`
    or a spot instance's agent would) and take its host off the list (it goes). Timed: from the
    signal to the checkpoint of the step every rank stopped at (within --grace, or it fails),
    and to the 1-rank job training again from it. Then, after a random 0.5-3 s, the host is listed
    again: timed until the 2-rank job trains again (the growth). Each restart must have resumed
    from a checkpoint written after its notice and within --grace, and the job must end within
    1e-5 of plain Keras in one process on the planned global batch (as many epochs): that is the
    soak's verdict.
digits growth  the digits example (`python -m examples.keras_digits --checkpoint_dir D`) under
    `-np 2 --min-np 1 --discovery-interval S`, offered 1 slot, then 2 once its first epoch has
    begun. Timed: from the slot's listing until the 2-rank job begins its next epoch (its
    first log line; up to one interval until the launcher looks), and from the launcher's look
    that found the slot (its line on stderr) until then: the stop, its checkpoint and the start
    (the target: within 20 s).

Results: the tables printed, and a result file at --json (benchmarks/results.py; default
bench-results/elastic.json; `make bench`: benchmarks/results/), which docs/reliability.md's
tables render from.
"""

import argparse
import os
import pathlib
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results as result_files  # noqa: E402  (benchmarks/results.py)

REPO = result_files.REPO
TRAINING = REPO / "benchmarks" / "elastic_training.py"
LAUNCHER = [sys.executable, "-m", "kerasdist.run"]
ENVIRONMENT = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PYTHONUNBUFFERED": "1",
    "PYTHONPATH": str(REPO),
}
WAIT_S = 300  # for any one step of a run to happen, before the run is called failed


class Job:
    """A kerasdist-run job whose output lines are kept with the time each arrived."""

    def __init__(self, argv, cwd):
        self.lines, self._lock = [], threading.Lock()
        self.process = subprocess.Popen(
            argv, cwd=cwd, env=ENVIRONMENT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.process.stdout:
            with self._lock:
                self.lines.append((time.time(), line.rstrip("\n")))

    def resumed_from(self, attempt):
        """The name of the checkpoint `attempt` resumed from (elastic_training.py's RESUMED_FROM line:
        an epoch and the batches of it done over the 2 ranks that saved it), or None before it says."""
        with self._lock:
            for _, line in self.lines:
                found = re.search(rf"RESUMED_FROM={attempt} (\d+)/(\d+)", line)
                if found:
                    epoch, batches = map(int, found.groups())
                    return (
                        f"epoch{epoch:04d}.keras" if not batches else f"epoch{epoch + 1:04d}-batch{batches // 2}.keras"
                    )
        return None

    def first_line_after(self, pattern, after):
        with self._lock:
            return next((at for at, line in self.lines if at > after and re.search(pattern, line)), None)

    def wait(self):
        try:
            status = self.process.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.stop()
            raise SystemExit(f"the job did not end within {WAIT_S} s:\n{self.output()}") from None
        self._reader.join(30)
        return status

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def output(self):
        with self._lock:
            return "\n".join(line for _, line in self.lines)


def wait_for(what, condition, job):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if job.process.poll() is not None:
            raise SystemExit(f"the job ended while waiting for {what}:\n{job.output()[-6000:]}")
        time.sleep(0.02)
    job.stop()
    raise SystemExit(f"waited {WAIT_S} s for {what}:\n{job.output()[-6000:]}")


def write_hosts(path, text):
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    partial.replace(path)


def discovery_program(directory, listing):
    program = directory / "find-hosts"
    program.write_text(f"#!/bin/sh\ncat {listing}\n")
    program.chmod(0o755)
    return program


def ranks_up(state, attempt, size):
    """{rank: (pid, time)} once every rank of `attempt` has trained a batch at `size` ranks."""
    found = {}
    for rank in range(size):
        path = state / f"up-{attempt}-{rank}"
        if not path.exists():
            return None
        pid, ranks, at = path.read_text().split()
        if int(ranks) != size:
            raise SystemExit(f"attempt {attempt} runs {ranks} ranks where {size} were expected")
        found[rank] = (int(pid), float(at))
    return found


def notice_soak(notices, grace, rng):
    here = socket.gethostname()
    with tempfile.TemporaryDirectory(prefix="kerasdist-elastic-") as scratch:
        scratch = pathlib.Path(scratch)
        checkpoints, state, finish, listing = (scratch / name for name in ("checkpoints", "state", "finish", "hosts"))
        state.mkdir()
        both = f"localhost:1\n{here}:1\n"
        write_hosts(listing, both)
        argv = [*LAUNCHER, "-np", "2", "--restarts", "1", "--min-np", "1", "--discovery-interval", "1"]
        argv += ["--host-discovery-script", str(discovery_program(scratch, listing))]
        job = Job([*argv, sys.executable, str(TRAINING), str(checkpoints), str(state), str(finish)], scratch)
        rows, attempt = [], 0
        try:
            for number in range(1, notices + 1):
                up = wait_for(f"attempt {attempt} at 2 ranks", lambda attempt=attempt: ranks_up(state, attempt, 2), job)
                time.sleep(rng.uniform(0.5, 3.0))
                write_hosts(listing, "localhost:1\n")  # the host given notice goes
                noticed_at = time.time()
                os.kill(up[1][0], signal.SIGUSR1)
                attempt += 1
                alone = wait_for(
                    f"attempt {attempt} at 1 rank", lambda attempt=attempt: ranks_up(state, attempt, 1), job
                )
                # The checkpoint the restart resumed from, and when rank 0 wrote it (before
                # keep_last deletes it: the 1-rank job has saved none yet at its first batch).
                saved = wait_for(f"attempt {attempt}'s resume", lambda attempt=attempt: job.resumed_from(attempt), job)
                saved_at = (checkpoints / saved).stat().st_mtime
                time.sleep(rng.uniform(0.5, 3.0))
                listed_at = time.time()
                write_hosts(listing, both)  # the host is given back
                attempt += 1
                regrown = wait_for(
                    f"attempt {attempt} at 2 ranks", lambda attempt=attempt: ranks_up(state, attempt, 2), job
                )
                rows.append(
                    {
                        "notice": number,
                        "resumed_from": saved,
                        "to_checkpoint_s": saved_at - noticed_at,
                        "to_training_again_s": alone[0][1] - noticed_at,
                        "growth_s": min(at for _, at in regrown.values()) - listed_at,
                    }
                )
                print(
                    f"notice {number}: checkpoint {rows[-1]['to_checkpoint_s']:.2f} s, training again at 1 rank "
                    f"{rows[-1]['to_training_again_s']:.1f} s; back to 2 ranks {rows[-1]['growth_s']:.1f} s "
                    "after the host was listed again",
                    flush=True,
                )
            finish.touch()
            status = job.wait()
        finally:
            job.stop()
        output = job.output()
    resumed = re.findall(r"RESUMED_FROM=(\d+) (\d+)/(\d+)", output)
    difference = re.search(r"MAX_DIFFERENCE=(\S+)", output)
    verdict = {
        "status": status,
        "resumes": len(resumed),
        "max_difference": float(difference.group(1)) if difference else None,
        # Written after the notice, within the grace: a restart that resumed from an older
        # checkpoint would have lost the steps since.
        "within_grace": sum(0 < row["to_checkpoint_s"] <= grace for row in rows),
    }
    failures = [f"status {status}"] if status else []
    if verdict["max_difference"] is None or verdict["max_difference"] >= 1e-5:
        failures.append(f"final weights differ from plain Keras by {verdict['max_difference']}")
    if verdict["within_grace"] < len(rows):
        failures.append(
            f"{len(rows) - verdict['within_grace']} restart(s) resumed from no checkpoint written within the {grace} s "
            "grace after the notice"
        )
    if failures:
        raise SystemExit("notice soak failed: " + "; ".join(failures) + f"\n{output[-6000:]}")
    return rows, verdict


def digits_growth(interval, rng_seed):
    with tempfile.TemporaryDirectory(prefix="kerasdist-growth-") as scratch:
        scratch = pathlib.Path(scratch)
        listing = scratch / "hosts"
        write_hosts(listing, "localhost:1\n")
        argv = [*LAUNCHER, "-np", "2", "--restarts", "1", "--min-np", "1", "--discovery-interval", str(interval)]
        argv += ["--host-discovery-script", str(discovery_program(scratch, listing))]
        argv += [sys.executable, "-m", "examples.keras_digits", "--checkpoint_dir", str(scratch / "checkpoints")]
        job = Job([*argv, "--epochs", "30", "--seed", str(rng_seed)], REPO)
        try:
            wait_for("the 1-rank job's first epoch", lambda: job.first_line_after(r"^Epoch 1/", 0), job)
            listed_at = time.time()
            write_hosts(listing, "localhost:2\n")
            looked = wait_for("the launcher's look", lambda: job.first_line_after("ranks fit now", listed_at), job)
            stopped = wait_for(
                "the stop to grow", lambda: job.first_line_after("stopped at a step boundary to grow", listed_at), job
            )
            trains = wait_for(
                "the 2-rank job's first epoch", lambda: job.first_line_after(r"^Epoch \d+/", stopped), job
            )
            status = job.wait()
        finally:
            job.stop()
        if status != 0 or "2 process(es): test accuracy" not in job.output():
            raise SystemExit(f"the digits job did not end well at 2 ranks (status {status}):\n{job.output()[-6000:]}")
        accuracy = float(re.search(r"2 process\(es\): test accuracy ([0-9.]+)", job.output()).group(1))
    return {
        "growth_s": trains - listed_at,
        "look_to_training_s": trains - looked,
        "accuracy": accuracy,
    }


def seconds(values):
    """Median (range) of times in seconds, to a hundredth below a second, else a tenth."""

    def shown(value):
        return f"{value:.2f}" if value < 1 else f"{value:.1f}"

    return f"{shown(statistics.median(values))} s ({shown(min(values))}–{shown(max(values))})"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--notices", type=int, default=20, help="notices of the soak (0: no soak)")
    parser.add_argument("--grace", type=float, default=30.0, help="seconds a notice gives before the host goes")
    parser.add_argument("--growths", type=int, default=3, help="runs of the digits example growing back (0: none)")
    parser.add_argument("--interval", type=int, default=5, help="--discovery-interval of the digits runs")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random steps the notices come at")
    parser.add_argument("--json", default=str(REPO / "bench-results" / "elastic.json"))
    arguments = parser.parse_args()
    run = result_files.start_run("elastic")
    rng = random.Random(arguments.seed)
    tables, data = {}, {}
    if arguments.notices:
        rows, verdict = notice_soak(arguments.notices, arguments.grace, rng)
        data["notices"], data["soak"] = rows, verdict
        tables["notice"] = {
            "columns": ["what", "median (range)", "runs"],
            "rows": [
                [
                    "notice → checkpoint of the step every rank stopped at",
                    seconds([r["to_checkpoint_s"] for r in rows]),
                    len(rows),
                ],
                [
                    "notice → training again without the host, from that checkpoint",
                    seconds([r["to_training_again_s"] for r in rows]),
                    len(rows),
                ],
                [
                    "host listed again → training at 2 ranks (interval 1 s)",
                    seconds([r["growth_s"] for r in rows]),
                    len(rows),
                ],
                [
                    f"notices whose checkpoint came within the {arguments.grace:.0f} s grace",
                    f"{verdict['within_grace']} of {len(rows)}",
                    len(rows),
                ],
                [
                    "final weights against plain Keras on the planned global batch",
                    f"{verdict['max_difference']:.2g} apart after {verdict['resumes']} starts",
                    1,
                ],
            ],
        }
    if arguments.growths:
        runs = [digits_growth(arguments.interval, seed) for seed in range(arguments.growths)]
        data["digits_growth"] = runs
        tables["growth"] = {
            "columns": ["what", "median (range)", "runs"],
            "rows": [
                [
                    f"digits example: slot listed → 2-rank job's next epoch (interval {arguments.interval} s)",
                    seconds([r["growth_s"] for r in runs]),
                    len(runs),
                ],
                [
                    "the launcher's look that found it → that epoch (stop, checkpoint, start; target ≤ 20 s)",
                    seconds([r["look_to_training_s"] for r in runs]),
                    len(runs),
                ],
                ["test accuracy at the end", ", ".join(f"{r['accuracy']:.4f}" for r in runs), len(runs)],
            ],
        }
    for name, table in tables.items():
        print(f"\n{name}:\n" + "\n".join(" | ".join(str(cell) for cell in row) for row in table["rows"]))
    result_files.write(arguments.json, result_files.finish_run(run, tables=tables, **data))
    print(f"\nwrote {arguments.json}")


if __name__ == "__main__":
    main()
