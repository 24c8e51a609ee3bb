"""Stall warnings say how long a collective has waited, counted from the first rank's call."""

import re

from launch_utils import LAUNCH_TEST_MARKS, child_env, mpirun

pytestmark = LAUNCH_TEST_MARKS


def test_a_stall_warning_never_claims_a_longer_wait_than_the_call_has_had(tmp_path):
    job = mpirun(
        "stall_wait.py",
        cwd=tmp_path,
        env=child_env(KERASDIST_MISMATCH_TIMEOUT_S=0, KERASDIST_STALL_WARNING_S=2, KERASDIST_STALL_TIMEOUT_S=6),
    )
    assert not job.timed_out and len(job.lines_with("RANK_DONE")) == 2, job.describe()
    warnings = re.findall(r"STDERR_AT (\S+) .*stall: 'only_on_rank_0'.*\(waiting (\d+) s\)", job.output)
    assert warnings, "rank 0 warned of no stall in a 6 s wait" + job.describe()
    for actual, claimed in warnings:
        # The claim is rounded to whole seconds; the line is timestamped after it is written.
        assert int(claimed) <= float(actual) + 0.5, f"claimed {claimed} s after {actual} s" + job.describe()
        assert float(actual) >= 2 - 0.5, f"warned after {actual} s, before the 2 s warning time" + job.describe()
