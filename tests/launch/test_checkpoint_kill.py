"""Rank0Checkpoint survives SIGKILL in the middle of a save.

One directory goes through several lives: each run resumes from it, saves twice and kills itself
inside its third save at a moment the test names (scripts/checkpoint_kill.py); a last run resumes
and saves once more without being killed. The moments cover every window of a save, for numbered
files with pruning: when `model.save` returns, just before each of the save's os.fsync /
os.replace / os.remove calls and just after the last one (between two of them nothing touches the
disk), and one moment inside `model.save` drawn from the seed; for one file overwritten by every
save, the moments around the durability calls. Every resume must find a loadable checkpoint
whose epoch is the last one saved before the kill (or the one being saved, when the kill came
after it was committed), and temporary files must never be taken for checkpoints.

The seed (model initialisation, the moment inside model.save) is printed with every failure; set
KD_TEST_CHECKPOINT_KILL_SEED=<seed> to rerun a failure with it.
"""

import os
import random
import signal

import pytest
from launch_utils import SKIP_UNDER_A_LAUNCHER, python_run

JOB_TIMEOUT_S = 120  # a hang bound
SAVES_BEFORE_THE_KILL = 2  # scripts/checkpoint_kill.py's warm-up saves


pytestmark = SKIP_UNDER_A_LAUNCHER


def kill_points(calls_in_a_save, inside_model_save, in_model_save):
    """Every window of a save with this many durability calls, in the order the test runs them
    (those inside `model.save` only if `in_model_save`)."""
    return (
        (["model.save:end", f"model.save:{inside_model_save}"] if in_model_save else [])
        + [f"call:{i}:before" for i in range(calls_in_a_save)]
        + [f"call:{calls_in_a_save - 1}:after"]
    )


# `model.save` writes a temporary file, whatever the name it will get, so its windows are killed
# in once, for numbered files; the overwritten file differs in the calls that follow it.
@pytest.mark.timeout(30 * JOB_TIMEOUT_S, method="thread")
@pytest.mark.parametrize(
    "filename, keep_last, in_model_save",
    [("epoch{epoch:04d}.keras", 2, True), ("model.keras", 0, False)],
    ids=["numbered_and_pruned", "one_file_overwritten"],
)
def test_a_kill_anywhere_in_a_save_leaves_the_previous_checkpoint_loadable(
    tmp_path, filename, keep_last, in_model_save
):
    seed = int(os.environ.get("KD_TEST_CHECKPOINT_KILL_SEED") or random.randrange(1, 2**31))
    inside_model_save = round(random.Random(seed).random(), 3)
    directory = tmp_path / "checkpoints"
    # The calls of a save are counted by the runs themselves (SAVE_CALLS); a save that prunes
    # makes one more, and saves prune once a resumed run starts with `keep_last` kept.
    calls_in_a_save, done, run = 1, [], 0
    last_saving, last_saved = 0, 0
    while True:
        todo = [point for point in kill_points(calls_in_a_save, inside_model_save, in_model_save) if point not in done]
        point = todo[0] if todo else "none"
        job = python_run(
            "checkpoint_kill.py", directory, filename, keep_last, seed, point, cwd=tmp_path, timeout=JOB_TIMEOUT_S
        )
        context = f"seed {seed}, run {run}, kill point {point}" + job.describe()
        assert not job.timed_out, context

        resumed = job.marker("RESUMED_EPOCH")
        assert resumed in {last_saved, last_saving}, context
        assert job.marker("RESTORED_ITERATIONS") == resumed, context
        if point == "none":
            assert job.returncode == 0 and "DONE" in job.output, context
            break
        assert job.returncode == -signal.SIGKILL and job.lines_with("KILL_AT:"), context
        if point.startswith("call:"):  # the named call happened: the kill did not fall back to the end
            assert job.lines_with("KILL_AT:") != ["at the end of the save"], context
        last_saving, last_saved = job.marker("SAVING"), job.marker("SAVED")
        assert last_saving == last_saved + 1 == resumed + SAVES_BEFORE_THE_KILL + 1, context
        calls_in_a_save = max([calls_in_a_save] + [int(n) for n in job.lines_with("SAVE_CALLS=")])
        done.append(point)
        run += 1

    assert run == len(kill_points(calls_in_a_save, inside_model_save, in_model_save)), (seed, done)
    names = os.listdir(directory)
    assert not [name for name in names if name.startswith(".kerasdist-partial-")], names
