"""The message counts docs/scale.md's model rests on, counted at 2 and 8 ranks by the PMPI shim of
benchmarks/scale_counts.py around the engine's C API (no TensorFlow): the fast path is one
bitwise AND per cycle whose size is the cache's, not the job's; the slow path sends every rank's
requests to rank 0; a negotiation left waiting asks every peer. Each would fail if the design
changed (a bit vector sized by ranks, a tree gather, questions to rank 0 only): change
docs/scale.md with it."""

import pathlib
import sys

import pytest
from launch_utils import LAUNCH_TEST_MARKS, child_env, run_job

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import scale_counts  # noqa: E402  (benchmarks/scale_counts.py)

pytestmark = LAUNCH_TEST_MARKS

CACHE_CAPACITY = 1024
# Rank 0 starts the last step this late: past the stall inspector's 5 s before its first
# questions, with 4 s to spare for a loaded machine.
PAUSE_S = 9
JOB_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    """The summary of one counted job at 2 and one at 8 ranks, by rank count."""
    driver, shim = scale_counts.build(tmp_path_factory.mktemp("build"))
    args = scale_counts.parse_args(["--steps", "5", "--pause_s", str(PAUSE_S), "--cache_capacity", str(CACHE_CAPACITY)])
    summaries = {}
    for ranks in (2, 8):
        counts_dir = tmp_path_factory.mktemp(f"counts{ranks}")
        job = run_job(
            scale_counts.job_command(driver, ranks, args),
            cwd=counts_dir,
            env=scale_counts.job_env(shim, counts_dir, base=child_env()),
            timeout=JOB_TIMEOUT_S,
            script_name=driver.name,
        )
        passed = [
            line for line in job.output.splitlines() if line.endswith(" checks failed") and ": passed, 0 of" in line
        ]
        assert not job.timed_out and job.returncode == 0 and len(passed) == ranks, job.describe()
        summaries[ranks] = scale_counts.summarize(*scale_counts.read_counts(counts_dir, ranks), ranks)
    return summaries


def test_the_fast_path_is_one_and_of_the_caches_size_whatever_the_ranks(counts):
    words = 1 + (CACHE_CAPACITY + 63) // 64  # a word of flags, then a bit per cache slot
    for ranks, summary in counts.items():
        assert summary["and_bytes_per_cycle"] == [8 * words], ranks
        assert summary["and_calls_equal_cycles_on_every_rank"], ranks
        assert summary["steady_slow_path_cycles"] == 0, ranks


def test_the_slow_path_sends_every_ranks_requests_to_rank_0(counts):
    for ranks, summary in counts.items():
        assert summary["churn_slow_path_cycles"] >= summary["churn_steps"], ranks
        assert summary["rank0_gatherv_messages_in"] == (ranks - 1) * summary["churn_slow_path_cycles"], ranks
        assert min(summary["other_rank_gather_bytes_out_per_step"]) > 0, ranks
    # What one rank sends for a step does not depend on the ranks; rank 0 gets it from each.
    per_rank = {ranks: max(summary["other_rank_gather_bytes_out_per_step"]) for ranks, summary in counts.items()}
    assert abs(per_rank[8] - per_rank[2]) < 0.1 * per_rank[2], per_rank
    assert counts[8]["rank0_gather_bytes_in_per_step"] > 6 * per_rank[2], counts[8]
    # The answer rank 0 broadcasts names no ranks.
    assert counts[8]["answer_bytes_per_step"] < 2 * counts[2]["answer_bytes_per_step"], counts


def test_a_waiting_negotiation_asks_every_peer(counts):
    for ranks, summary in counts.items():
        assert summary["stall_isends_per_waiting_rank"][0] >= ranks - 1, (ranks, summary)
