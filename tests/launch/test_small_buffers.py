"""The collective property tests again, as a job of their own with a 1000-byte fusion threshold
and a response cache of two slots: every long tensor is then reduced in many pieces (250 float32
values, 500 float16 ones), packing boundaries fall inside every group, and nearly every cycle
evicts a cached response. The threshold and the capacity are read once, at start-up, so the
shared test jobs cannot vary them."""

import sys

import pytest
from launch_utils import LAUNCH_TEST_MARKS, MPIEXEC, REPO_ROOT, child_env, run_job

pytestmark = LAUNCH_TEST_MARKS


@pytest.mark.parametrize("ranks", [2, 3])
def test_property_tests_pass_with_tiny_buffers_and_cache(ranks, tmp_path):
    module = REPO_ROOT / "tests" / "collectives" / "test_properties.py"
    argv = [MPIEXEC, "-n", ranks, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module]
    env = child_env(KERASDIST_FUSION_THRESHOLD=1000, KERASDIST_CACHE_CAPACITY=2, TF_NUM_INTRAOP_THREADS=1)
    job = run_job(argv, tmp_path, env=env, timeout=300)
    assert job.returncode == 0 and not job.timed_out, job.describe()
    assert "2 passed" in job.output, job.describe()
