"""kerasdist.init() sizes TensorFlow's thread pools when ranks share CPUs, and stops their
spinning when a rank has one CPU or less.

The expected sizes are computed here from the CPU sets the ranks report: each rank gets
its CPUs divided by the number of ranks whose sets overlap its own, and at least two
inter-op threads (with one, a gradient bucket's collective cannot start during backprop).
"""

import json
import os
import re
import sys

import pytest
from launch_utils import LAUNCH_TEST_MARKS, MPIEXEC, SCRIPTS, child_env, mpirun, run_job

pytestmark = LAUNCH_TEST_MARKS


def unsized_env(**extra):
    """The child environment without any thread-pool size the test run itself set."""
    env = child_env(**extra)
    for variable in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        if variable not in extra:
            env.pop(variable, None)
    return env


def reports(job, n):
    assert job.returncode == 0 and not job.timed_out, job.describe()
    # Ranks that print at the same moment can share a line of the launcher's output.
    found = [json.loads(report) for report in re.findall(r"TF_THREADS (\{.*?\})", job.output)]
    assert len(found) == n, job.describe()
    return found


def shares(found):
    """Each rank's CPU count divided among the ranks whose CPU sets overlap its own."""
    sets = [set(r["affinity"]) for r in found]
    return [max(1, len(mine) // sum(1 for theirs in sets if theirs & mine)) for mine in sets]


def overlapping(found):
    sets = [set(r["affinity"]) for r in found]
    return all(a & b for a in sets for b in sets)


@pytest.mark.parametrize("n", [2, 3])
def test_unbound_ranks_get_their_share_of_the_cpus(tmp_path, n):
    found = reports(mpirun("tf_threads.py", n=n, cwd=tmp_path, env=unsized_env()), n)
    if not overlapping(found):
        pytest.skip("this launcher binds ranks to disjoint CPUs; nothing to share")
    for report, share in zip(found, shares(found)):
        assert (report["intra"], report["inter"]) == (share, max(2, share)), found
        assert report["spinning"] == (share > 1), found
    # And from this process's own CPU set, not the ranks' reports: ranks the launcher left on
    # the CPUs they inherited from here are n to share them.
    inherited = set(os.sched_getaffinity(0))
    for report in found:
        if set(report["affinity"]) == inherited:
            share = max(1, len(inherited) // n)
            assert (report["intra"], report["inter"]) == (share, max(2, share)), (inherited, found)


def test_pools_the_user_sized_are_left_alone(tmp_path):
    env = unsized_env(TF_NUM_INTRAOP_THREADS=3)
    found = reports(mpirun("tf_threads.py", "--user_inter_op", "5", cwd=tmp_path, env=env), 2)
    # TF_NUM_INTRAOP_THREADS takes effect inside TensorFlow: its config still says 0 (default).
    assert [(r["intra"], r["inter"]) for r in found] == [(0, 5), (0, 5)]
    # Pool sizes are the user's; the spinning is still stopped on a rank with one CPU.
    assert [r["spinning"] for r in found] == [share > 1 for share in shares(found)], found


def test_off_leaves_tensorflow_alone(tmp_path):
    found = reports(mpirun("tf_threads.py", cwd=tmp_path, env=unsized_env(KERASDIST_TF_THREADS="off")), 2)
    assert [(r["intra"], r["inter"], r["spinning"]) for r in found] == [(0, 0, True), (0, 0, True)]


def test_pools_that_already_exist_get_a_warning_naming_the_fix(tmp_path):
    job = mpirun("tf_threads.py", "--ops_first", cwd=tmp_path, env=unsized_env())
    found = reports(job, 2)
    assert [(r["intra"], r["inter"], r["spinning"]) for r in found] == [(0, 0, True), (0, 0, True)]
    if overlapping(found):
        share = shares(found)[0]
        assert job.output.count("before kerasdist.init()") == 1, job.describe()  # local rank 0 only
        assert f"TF_NUM_INTRAOP_THREADS={share} TF_NUM_INTEROP_THREADS={max(2, share)}" in job.output, job.describe()


def test_ranks_bound_to_their_own_cores_keep_tensorflows_pools_but_not_their_spinning(tmp_path):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("binding two ranks to their own cores needs two cores")
    argv = [MPIEXEC, "-bind-to", "core", "-n", "2", sys.executable, SCRIPTS / "tf_threads.py"]
    found = reports(run_job(argv, tmp_path, unsized_env(), 120, script_name="tf_threads.py"), 2)
    assert not overlapping(found), found
    assert [(r["intra"], r["inter"], r["spinning"]) for r in found] == [(0, 0, False), (0, 0, False)]
