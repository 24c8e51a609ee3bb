"""Gradient buckets leave during backprop with kerasdist's thread defaults, as the timeline shows.

One 2-rank `model.fit` (scripts/overlap_steps.py: six 1 MiB layers in 1 MiB buckets, so six
buckets; the bucket size is set because on one CPU host the automatic size is one bucket) writes a
timeline. If every bucket waited for the end of backprop (one bucket, or TensorFlow running the
backward pass inline on a single inter-op thread while the collectives wait in its queue), a
step's buckets would be queued within a few ms of each other (3 ms measured, of a 57 ms step);
with overlap the first is queued while the other layers' gradients are still being computed
(30-35 ms before the last, of a 60-66 ms step).
"""

import json
import statistics

from launch_utils import LAUNCH_TEST_MARKS, child_env, mpirun

pytestmark = LAUNCH_TEST_MARKS

BUCKETS = 6
# Share of a step between queuing the first and the last bucket: 0.05 without overlap, 0.5 with.
MIN_SPREAD_SHARE = 0.25


def _is_gradient_bucket(tensor_name):
    # The Allreduce reduction's unnamed grouped allreduces, named after their line in its file.
    return tensor_name.startswith("allreduce@") and "/allreduce.py:" in tensor_name


def bucket_queue_times(timeline_path):
    """Per step, when each gradient bucket was queued (µs), in queue order."""
    events = json.loads(timeline_path.read_text())
    queued = sorted(e["ts"] for e in events if e.get("name") == "queued" and _is_gradient_bucket(e["args"]["tensor"]))
    return [queued[i : i + BUCKETS] for i in range(0, len(queued) - BUCKETS + 1, BUCKETS)]


def test_buckets_are_queued_while_backprop_goes_on(tmp_path):
    timeline = tmp_path / "timeline.json"
    env = child_env(KERASDIST_TIMELINE=timeline, KERASDIST_BUCKET_BYTES=2**20)
    for variable in ("TF_NUM_INTEROP_THREADS", "KERASDIST_TF_THREADS"):
        env.pop(variable, None)  # kerasdist's thread pool defaults are what is tested
    job = mpirun("overlap_steps.py", cwd=tmp_path, env=env)
    assert job.returncode == 0 and not job.timed_out, job.describe()
    steps = bucket_queue_times(timeline)
    assert len(steps) >= 10, steps
    spread = statistics.median(step[-1] - step[0] for step in steps)
    period = statistics.median(b[0] - a[0] for a, b in zip(steps, steps[1:]))
    assert spread >= MIN_SPREAD_SHARE * period, (
        f"a step's {BUCKETS} buckets were queued within {spread / 1e3:.1f} ms of a {period / 1e3:.1f} ms step"
    )
