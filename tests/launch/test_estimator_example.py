"""examples/estimator_digits.py as users run it: 2 processes through the launcher."""

import re
import sys

from launch_utils import LAUNCH_TEST_MARKS, REPO_ROOT, child_env, run_job

pytestmark = LAUNCH_TEST_MARKS
EXAMPLE = "estimator_digits.py"
EXAMPLE_TIMEOUT_S = 240


def launch(*flags, tmp_path):
    argv = [sys.executable, "-m", "kerasdist.run", "-np", "2", sys.executable, REPO_ROOT / "examples" / EXAMPLE,
            *flags]
    return run_job(argv, tmp_path, child_env(), timeout=EXAMPLE_TIMEOUT_S, script_name=EXAMPLE)


def test_estimator_digits_reaches_90_percent_then_resumes(tmp_path):
    model_dir, exported = tmp_path / "model", tmp_path / "digits.keras"
    job = launch(f"--model_dir={model_dir}", f"--export_path={exported}", tmp_path=tmp_path)
    assert job.returncode == 0 and not job.timed_out, job.describe()
    results = re.findall(r"^2 process\(es\): accuracy ([0-9.]+), loss [0-9.]+ at global step (\d+) on 450 held-out",
                         job.output, re.MULTILINE)
    assert len(results) == 1, "expected one result line, from rank 0 only" + job.describe()
    accuracy, global_step = results[0]
    assert float(accuracy) >= 0.9 and global_step == "600", job.describe()
    assert (model_dir / "model.ckpt-600.index").exists() and exported.exists(), job.describe()

    again = launch(f"--model_dir={model_dir}", "--max_steps=700", tmp_path=tmp_path)
    assert again.returncode == 0 and not again.timed_out, again.describe()
    assert re.search(r"Restored from \S+model\.ckpt-600 \(global step 600\) for training", again.output), \
        again.describe()
    assert re.search(r"^2 process\(es\): accuracy [0-9.]+, loss [0-9.]+ at global step 700 ", again.output,
                     re.MULTILINE), again.describe()
