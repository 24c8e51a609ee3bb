"""Training off the main thread: the thread that started kerasdist makes its unnamed eager
collectives, kerasdist's own in fit included, so model.fit with kerasdist.callbacks() and a
DistributedOptimizer runs in a worker thread that started kerasdist (explicitly, or through the
optimizer) and ends with the weights of one plain Keras process fitted with the global batch on
every rank. The main thread's unnamed calls are then refused on every rank, naming that thread.

Each case runs a job of its own: the test process started kerasdist on its main thread.
"""

import json
import re

import numpy as np
import pytest
from launch_utils import LAUNCH_TEST_MARKS, mpirun

pytestmark = LAUNCH_TEST_MARKS
RANKS = 2
JOB_TIMEOUT_S = 240  # two TensorFlow processes on two shared cores, each fitting twice


def per_rank(job, marker):
    """{rank: the rest of the line} for the lines `MARKER rank=R ...`."""
    return {int(rank): rest for rank, rest in re.findall(rf"^{marker} rank=(\d+) (.*)$", job.output, re.MULTILINE)}


@pytest.mark.parametrize("started_by", ["init", "optimizer"])
def test_fit_in_the_worker_thread_that_started_kerasdist_trains_as_one_process(tmp_path, started_by):
    job = mpirun("worker_thread.py", started_by, n=RANKS, cwd=tmp_path, timeout=JOB_TIMEOUT_S)
    assert job.returncode == 0 and not job.timed_out, job.describe()
    reference = [np.array(w) for w in json.loads(job.lines_with("REFERENCE ")[0])]
    trained = per_rank(job, "WEIGHTS")
    assert sorted(trained) == list(range(RANKS)), job.describe()
    for rank, text in trained.items():
        for mine, expected in zip(json.loads(text), reference, strict=True):
            np.testing.assert_allclose(mine, expected, atol=1e-5, err_msg=f"rank {rank}")
    refusals = per_rank(job, "MAIN_REFUSED")
    assert sorted(refusals) == list(range(RANKS)), job.describe()
    for message in refusals.values():
        assert "thread 'MainThread'" in message, message
        assert "the thread that started kerasdist ('trainer', which has ended)" in message, message


def test_kerasdist_started_in_a_py_function_body_leaves_unnamed_eager_calls_to_no_thread(tmp_path):
    # The body ran on one of TensorFlow's threads, and the next body may run on another: no
    # thread of that pool is the same on every rank.
    job = mpirun("worker_thread.py", "py_function", n=RANKS, cwd=tmp_path, timeout=JOB_TIMEOUT_S)
    assert job.returncode == 0 and not job.timed_out, job.describe()
    refusals = per_rank(job, "MAIN_REFUSED")
    assert sorted(refusals) == list(range(RANKS)), job.describe()
    for message in refusals.values():
        assert "started inside a tf.py_function" in message and "kerasdist.init()" in message, message
