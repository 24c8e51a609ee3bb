"""examples/estimator_digits.py as users run it: 2 processes through the launcher."""

import os
import re
import sys

from launch_utils import LAUNCH_TEST_MARKS, REPO_ROOT, child_env, run_job

pytestmark = LAUNCH_TEST_MARKS
EXAMPLE = "estimator_digits.py"
EXAMPLE_TIMEOUT_S = 240
# The header absl gives a log record: severity (INFO, WARNING, ERROR, FATAL), date, time, thread,
# file:line.
ABSL_RECORD = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ \S+:\d+\] ")
# TensorFlow's C++ prints these when it is imported, before TF_CPP_MIN_LOG_LEVEL applies, on the
# CPUs they concern (oneDNN is on by default only on some; the other names instructions the
# binary was not built for). Only TF_ENABLE_ONEDNN_OPTS=0, which changes the numerics, silences
# the first. Not ours to hide: the launcher shows each once.
TENSORFLOW_IMPORT_NOTICES = ("port.cc:153] oneDNN custom operations are on", "cpu_feature_guard.cc:")


def launch(*flags, tmp_path, **env):
    argv = [sys.executable, "-m", "kerasdist.run", "-np", "2", sys.executable, REPO_ROOT / "examples" / EXAMPLE, *flags]
    return run_job(argv, tmp_path, child_env(**env), timeout=EXAMPLE_TIMEOUT_S, script_name=EXAMPLE)


def test_estimator_digits_reaches_90_percent_then_resumes(tmp_path):
    model_dir, exported = tmp_path / "model", tmp_path / "digits.keras"
    job = launch(f"--model_dir={model_dir}", f"--export_path={exported}", tmp_path=tmp_path)
    assert job.returncode == 0 and not job.timed_out, job.describe()
    results = re.findall(
        r"^2 process\(es\): accuracy ([0-9.]+), loss [0-9.]+ at global step (\d+) on 450 held-out",
        job.output,
        re.MULTILINE,
    )
    assert len(results) == 1, "expected one result line, from rank 0 only" + job.describe()
    accuracy, global_step = results[0]
    assert float(accuracy) >= 0.9 and global_step == "600", job.describe()
    assert (model_dir / "model.ckpt-600.index").exists() and exported.exists(), job.describe()

    again = launch(f"--model_dir={model_dir}", "--max_steps=700", tmp_path=tmp_path)
    assert again.returncode == 0 and not again.timed_out, again.describe()
    assert re.search(r"Restored from \S+model\.ckpt-600 \(global step 600\) for training", again.output), (
        again.describe()
    )
    assert re.search(
        r"^2 process\(es\): accuracy [0-9.]+, loss [0-9.]+ at global step 700 ", again.output, re.MULTILINE
    ), again.describe()


def test_estimator_digits_first_run_prints_only_rank_0s_lines_and_leaves_no_files(tmp_path):
    job_tmp = tmp_path / "tmp"  # the job's own TMPDIR: nothing else writes there meanwhile
    job_tmp.mkdir()
    before = sorted(os.listdir(job_tmp))
    job = launch("--max_steps=20", "--eval_every=10", tmp_path=tmp_path, TMPDIR=job_tmp)
    assert job.returncode == 0 and not job.timed_out, job.describe()

    lines = job.output.splitlines()
    absl_records = [
        line for line in lines if ABSL_RECORD.match(line) and not any(n in line for n in TENSORFLOW_IMPORT_NOTICES)
    ]
    assert not absl_records, "absl log records in the output:\n" + "\n".join(absl_records) + job.describe()
    for notice in TENSORFLOW_IMPORT_NOTICES:
        assert sum(notice in line for line in lines) <= 1, notice + job.describe()
    assert not [line for line in lines if line.startswith("INFO:") or "Warning:" in line], job.describe()
    assert len([line for line in lines if line.startswith("2 process(es): accuracy")]) == 1, (
        "expected one result line, from rank 0 only" + job.describe()
    )
    assert len([line for line in lines if line.startswith("first 10 test digits:")]) == 1, job.describe()

    # Without --model_dir the Estimator trained in a temporary directory under TMPDIR ...
    used = re.findall(r"^Using a temporary model directory, deleted at exit: (\S+)$", job.output, re.MULTILINE)
    assert len(used) == 1 and os.path.dirname(used[0]) == str(job_tmp), job.describe()
    # ... and it is gone.
    assert sorted(os.listdir(job_tmp)) == before, f"left behind in TMPDIR: {os.listdir(job_tmp)}" + job.describe()
