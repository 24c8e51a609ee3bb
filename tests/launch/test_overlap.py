"""Gradient buckets leave during backprop with kerasdist's thread defaults, as the timeline shows.

One 2-rank `model.fit` (scripts/overlap_steps.py: six 1 MiB layers in 1 MiB buckets, so six
buckets; the bucket size is set because on one CPU host the automatic size is one bucket) writes a
timeline, on which a marker shows, each step, when backprop reached the first layer: the last
layer's kernel gradient (the last bucket's) cannot be computed before it. With overlap, the
first bucket (the last layer's) is queued while backprop still runs through the layers below,
before the marker. If every bucket waited for the end of backprop (one bucket, or TensorFlow
running the backward pass inline on a single inter-op thread while the collectives wait in its
queue), every bucket would be queued after the marker, in every step.

The verdict is an order of events, not a share of the step's time, so a loaded machine (which
stretches every step) cannot fail it; how much of a step the buckets spread over is a figure of
`make bench` (benchmarks/overlap.py).
"""

import json

from launch_utils import LAUNCH_TEST_MARKS, SCRIPTS, child_env, mpirun

pytestmark = LAUNCH_TEST_MARKS

BUCKETS = 6
MARKER = "backprop_reached_the_first_layer"  # scripts/overlap_steps.py's


def _is_gradient_bucket(tensor_name):
    # The Allreduce reduction's unnamed grouped allreduces, named after their line in its file.
    return tensor_name.startswith("allreduce@") and "/allreduce.py:" in tensor_name


def queue_times(timeline_path):
    """(per step, when each gradient bucket was queued, in queue order; per step, when backprop
    reached the first layer), both in µs on the engine's clock."""
    queued = [e for e in json.loads(timeline_path.read_text()) if e.get("name") == "queued"]
    buckets = sorted(e["ts"] for e in queued if _is_gradient_bucket(e["args"]["tensor"]))
    marks = sorted(e["ts"] for e in queued if e["args"]["tensor"] == MARKER)
    return [buckets[i : i + BUCKETS] for i in range(0, len(buckets), BUCKETS)], marks


def test_a_bucket_is_queued_before_backprop_reaches_the_first_layer(tmp_path):
    assert (SCRIPTS / "overlap_steps.py").read_text().count(f'MARKER = "{MARKER}"') == 1
    timeline = tmp_path / "timeline.json"
    env = child_env(KERASDIST_TIMELINE=timeline, KERASDIST_BUCKET_BYTES=2**20)
    for variable in ("TF_NUM_INTEROP_THREADS", "KERASDIST_TF_THREADS"):
        env.pop(variable, None)  # kerasdist's thread pool defaults are what is tested
    job = mpirun("overlap_steps.py", cwd=tmp_path, env=env)
    assert job.returncode == 0 and not job.timed_out, job.describe()
    steps, marks = queue_times(timeline)
    assert len(steps) == len(marks) >= 10 and all(len(step) == BUCKETS for step in steps), (steps, marks)
    # Each step's marker comes before its last bucket (which waits for the first layer's gradient)
    # and after the step's first bucket: the pairing of steps and markers holds.
    assert all(mark < step[-1] for step, mark in zip(steps, marks)), (steps, marks)
    overlapped = [step[0] < mark for step, mark in zip(steps, marks)]
    assert sum(overlapped) > len(steps) / 2, (
        f"the first bucket was queued before backprop reached the first layer in {sum(overlapped)} of "
        f"{len(steps)} steps\n{steps}\n{marks}"
    )
