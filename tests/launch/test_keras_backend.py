"""kerasdist.init() refuses a Keras backend other than TensorFlow, on every rank, in one line
naming the backend and what to set: under KERAS_BACKEND=jax, init, shard and compile used to pass
and fit failed at epoch 1 with a NotImplementedError per rank.

JAX is not installed here, and Keras imports it as it starts under KERAS_BACKEND=jax; the scripts
make `keras.config.backend()`, which Keras's backend choice answers, say "jax" instead.
"""

import sys

from launch_utils import LAUNCH_TEST_MARKS, MPIEXEC, run_job

pytestmark = LAUNCH_TEST_MARKS

ON_JAX = (
    "import keras\n"
    "keras.config.backend = lambda: 'jax'  # what Keras answers under KERAS_BACKEND=jax\n"
    "import kerasdist\n"
    "kerasdist.init()\n"
    "print('INIT_PASSED', flush=True)\n"
)


def _error_lines(output):
    return [line for line in output.splitlines() if line.startswith("RuntimeError: ")]


def test_init_refuses_the_jax_backend_naming_it_and_the_fix(tmp_path):
    job = run_job([sys.executable, "-c", ON_JAX], tmp_path, timeout=120)
    assert job.returncode == 1 and "INIT_PASSED" not in job.output, job.describe()
    (line,) = _error_lines(job.output)
    assert "Keras runs on its 'jax' backend on rank 0" in line, line
    assert "set KERAS_BACKEND=tensorflow" in line, line


def test_every_rank_refuses_the_jax_backend_and_the_job_ends(tmp_path):
    job = run_job([MPIEXEC, "-n", "2", sys.executable, "-c", ON_JAX], tmp_path, timeout=120)
    assert not job.timed_out and job.returncode != 0 and "INIT_PASSED" not in job.output, job.describe()
    lines = _error_lines(job.output)
    assert sorted(line.split(" on rank ")[1][0] for line in lines) == ["0", "1"], job.describe()
