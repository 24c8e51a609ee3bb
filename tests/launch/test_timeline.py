"""The timeline (KERASDIST_TIMELINE) holds what docs/configuration.md's knob table promises: a Chrome trace
that rank 0 alone writes, with each tensor's queued / copy_in / allreduce / scale phases (copy_in
for fused tensors only; a compressed tensor reduced alone is copied in and out instead of
scaled), the per-op phase of the other collectives, and a mark per negotiation cycle. One 2-rank
job (scripts/timeline.py) writes the trace all tests here read."""

import json

import pytest
from launch_utils import LAUNCH_TEST_MARKS, child_env, mpirun

pytestmark = LAUNCH_TEST_MARKS

# Phases by start time for each tensor name of scripts/timeline.py (one request per name).
UNFUSED = ["queued", "allreduce", "scale"]
EXPECTED_PHASES = {
    "timeline_allreduce_tensor": UNFUSED,
    "timeline_large_tensor": UNFUSED,
    "timeline_in_function_tensor": UNFUSED,
    "timeline_compressed_tensor": ["queued", "copy_in", "allreduce", "copy_out"],  # to 16 bits and back
    "timeline_allgather_tensor": ["queued", "allgather"],
    "timeline_broadcast_tensor": ["queued", "broadcast"],
}
GROUPED, GROUP_SIZE = "timeline_grouped_tensor", 3
TIME_SLACK_US = 0.01  # timestamps and durations are printed with 3 decimals


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    directory = tmp_path_factory.mktemp("timeline")
    job = mpirun("timeline.py", cwd=directory, env=child_env(KERASDIST_TIMELINE=directory / "timeline-rank{rank}.json"))
    assert job.returncode == 0 and not job.timed_out, job.describe()
    return job, directory


@pytest.fixture(scope="module")
def events(job):
    _, directory = job
    trace = json.loads((directory / "timeline-rank0.json").read_text())
    events = trace if isinstance(trace, list) else trace.get("traceEvents")
    assert isinstance(events, list) and events, f"not a Chrome trace: {str(trace)[:500]}"
    return events


def phases_of(events):
    """{tensor name: its complete ("X") events sorted by start}."""
    by_tensor = {}
    for event in events:
        if event["ph"] == "X":
            by_tensor.setdefault(event["args"]["tensor"], []).append(event)
    return {name: sorted(found, key=lambda e: e["ts"]) for name, found in by_tensor.items()}


def test_only_rank_0_writes_the_timeline(job):
    _, directory = job
    assert sorted(path.name for path in directory.glob("timeline-rank*.json")) == ["timeline-rank0.json"]


def test_every_event_is_well_formed_and_begin_end_pairs_balance(events):
    assert {event["ph"] for event in events} <= {"X", "B", "E", "i", "M"}, {event["ph"] for event in events}
    open_spans = {}
    for event in events:
        if event["ph"] == "X":
            assert event["dur"] >= 0 and event["ts"] >= 0, event
        elif event["ph"] in "BE":
            stack = open_spans.setdefault(event["tid"], [])
            if event["ph"] == "B":
                stack.append(event["name"])
            else:
                assert stack and stack.pop() == event["name"], f"unmatched end: {event}"
    assert all(not stack for stack in open_spans.values()), f"begins without an end: {open_spans}"


def test_each_tensor_has_a_track_named_after_it(events):
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    for event in events:
        if event["ph"] == "X":
            assert tracks.get(event["tid"]) == event["args"]["tensor"], event


def test_unfused_tensors_and_other_collectives_have_their_phases_in_order(events):
    phases = phases_of(events)
    for name, expected in EXPECTED_PHASES.items():
        assert [event["name"] for event in phases.get(name, [])] == expected, (name, phases.get(name))
        for before, after in zip(phases[name], phases[name][1:]):
            assert before["ts"] + before["dur"] <= after["ts"] + TIME_SLACK_US, (name, before, after)


def test_each_tensor_of_a_fused_group_is_copied_in_reduced_and_scaled(events):
    phases = phases_of(events)[GROUPED]
    names = [event["name"] for event in phases]
    assert names[0] == "queued" and names.count("queued") == 1, names
    for phase in ("copy_in", "allreduce", "scale"):
        assert names.count(phase) == GROUP_SIZE, names
    # One fused call: the copy-in ends where the reduction starts, which ends where scaling starts.
    queued, copy_in, allreduce, scale = (
        next(e for e in phases if e["name"] == n) for n in ("queued", "copy_in", "allreduce", "scale")
    )
    assert queued["ts"] + queued["dur"] <= copy_in["ts"] + TIME_SLACK_US
    assert copy_in["ts"] + copy_in["dur"] == pytest.approx(allreduce["ts"], abs=TIME_SLACK_US)
    assert allreduce["ts"] + allreduce["dur"] == pytest.approx(scale["ts"], abs=TIME_SLACK_US)


def test_only_fused_and_compressed_tensors_are_copied_in(events):
    copied = {name for name, found in phases_of(events).items() if any(e["name"] == "copy_in" for e in found)}
    assert copied == {GROUPED, "timeline_compressed_tensor"}


def test_each_cycle_mark_counts_the_requests_negotiated_in_its_cycle(events):
    # A cycle's mark carries the moment its negotiation finished; requests seen for the first
    # time are settled just after it, so a request's queued phase ends in [its mark, the next).
    marks = sorted(
        (event for event in events if event["ph"] == "i" and event["name"] == "cycle"), key=lambda mark: mark["ts"]
    )
    assert sum(mark["args"]["ready"] for mark in marks) == len(EXPECTED_PHASES) + 1  # + the group
    queued_until = [found[0]["ts"] + found[0]["dur"] for found in phases_of(events).values()]
    bounds = [mark["ts"] - TIME_SLACK_US for mark in marks] + [float("inf")]
    counted = [sum(1 for end in queued_until if bounds[i] <= end < bounds[i + 1]) for i in range(len(marks))]
    assert counted == [mark["args"]["ready"] for mark in marks], (counted, marks)


def test_the_timeline_loads_after_a_job_ended_by_abort(tmp_path):
    # Rank 1 raises after a warm-up allreduce; the excepthook's MPI_Abort then ends rank 0
    # without exit handlers, in the run whose timeline a user most needs.
    job = mpirun(
        "raise_on_rank.py",
        "allreduce",
        cwd=tmp_path,
        env=child_env(KERASDIST_TIMELINE=tmp_path / "aborted.json"),
    )
    assert job.returncode != 0 and not job.timed_out, job.describe()
    events = json.loads((tmp_path / "aborted.json").read_text())
    assert "warmup" in {event.get("args", {}).get("tensor") for event in events}, events
