"""Rank0Checkpoint survives SIGKILL in the middle of a save.

One directory goes through several lives: each run resumes from it, saves twice and kills
itself at a random moment inside its third save (scripts/checkpoint_kill.py: a random time into
`model.save`, or just before or after one of the save's fsync / replace / remove calls); a last
run resumes and saves once more without being killed. Every resume must find a loadable checkpoint whose
epoch is the last one saved before the kill (or the one being saved, when the kill came after it
was committed), and temporary files must never be taken for checkpoints.
"""

import os
import random
import signal

from launch_utils import SKIP_UNDER_A_LAUNCHER, python_run

JOB_TIMEOUT_S = 60
# (filename, keep_last) per killed run: numbered files with pruning, then one overwritten file.
KILLED_RUNS = [("epoch{epoch:04d}.keras", 2), ("model.keras", 0), ("epoch{epoch:04d}.keras", 2)]


pytestmark = SKIP_UNDER_A_LAUNCHER


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    directory = tmp_path / "checkpoints"
    seeds = random.Random().sample(range(1, 2**31), len(KILLED_RUNS) + 1)
    last_saving, last_saved = 0, 0
    for run, ((filename, keep_last), seed) in enumerate(zip(KILLED_RUNS + [("epoch{epoch:04d}.keras", 2)], seeds)):
        final = run == len(KILLED_RUNS)
        job = python_run("checkpoint_kill.py", directory, filename, keep_last, seed, *(["--no-kill"] if final else []),
                         cwd=tmp_path, timeout=JOB_TIMEOUT_S)
        context = f"run {run} (seed {seed})" + job.describe()
        assert not job.timed_out, context

        resumed = job.marker("RESUMED_EPOCH")
        assert resumed in {last_saved, last_saving}, context
        assert job.marker("RESTORED_ITERATIONS") == resumed, context

        if final:
            assert job.returncode == 0 and "DONE" in job.output, context
            break
        assert job.returncode == -signal.SIGKILL and job.lines_with("KILL_AT:"), context
        last_saving, last_saved = job.marker("SAVING"), job.marker("SAVED")
        assert last_saving == last_saved + 1 == resumed + 3, context  # killed inside the third save

    names = os.listdir(directory)
    assert not [name for name in names if name.startswith(".kerasdist-partial-")], names
