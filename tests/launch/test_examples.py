"""The examples as users run them: 2 processes through the launcher, checked for their
results. examples/keras_digits.py is the main job (`make demo`)."""

import json
import os
import re
import sys

import pytest
from launch_utils import LAUNCH_TEST_MARKS, REPO_ROOT, child_env, run_job

pytestmark = LAUNCH_TEST_MARKS
OFFLINE_SITE = REPO_ROOT / "tests" / "launch" / "offline"
WITHOUT_SCIKIT_LEARN = REPO_ROOT / "tests" / "launch" / "without_scikit_learn"
ATTEMPT_MARKER = "NETWORK ACCESS ATTEMPTED"  # printed by offline/sitecustomize.py
EXAMPLE_TIMEOUT_S = 240


def launch(example, *flags, n=2, tmp_path, env=None, flags_of_the_launcher=()):
    argv = [
        sys.executable,
        "-m",
        "kerasdist.run",
        "-np",
        str(n),
        *flags_of_the_launcher,
        sys.executable,
        REPO_ROOT / "examples" / example,
        *flags,
    ]
    return run_job(argv, tmp_path, env or child_env(), timeout=EXAMPLE_TIMEOUT_S, script_name=example)


def env_without_scikit_learn():
    """A child environment whose Python processes cannot import scikit-learn (see without_scikit_learn/)."""
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(WITHOUT_SCIKIT_LEARN), env["PYTHONPATH"]])
    return env


def offline_env():
    """A child environment whose Python processes refuse network access and say so (see offline/)."""
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(OFFLINE_SITE), env["PYTHONPATH"]])
    return env


def test_keras_digits_reaches_95_percent_printed_once(tmp_path):
    job = launch("keras_digits.py", tmp_path=tmp_path)
    assert job.returncode == 0 and not job.timed_out, job.describe()
    results = re.findall(r"^2 process\(es\): test accuracy ([0-9.]+)", job.output, re.MULTILINE)
    assert len(results) == 1, "expected one result line, from rank 0 only" + job.describe()
    assert float(results[0]) >= 0.95, job.describe()
    assert len(re.findall(r"^Epoch 20/20", job.output, re.MULTILINE)) == 1, job.describe()


@pytest.mark.parametrize(
    "example", ["keras_digits.py", "custom_loop.py", "estimator_digits.py", "horovod_keras_digits.py"]
)
def test_an_example_without_scikit_learn_names_the_extra_in_one_line_per_rank(tmp_path, example):
    job = launch(example, tmp_path=tmp_path, env=env_without_scikit_learn())
    assert job.returncode != 0 and not job.timed_out, job.describe()
    named = [line for line in job.output.splitlines() if "pip install 'kerasdist[examples]'" in line]
    assert len(named) == 2, "one line from each rank" + job.describe()
    assert "Traceback" not in job.output, job.describe()


def test_keras_digits_resumes_from_its_checkpoint(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    first = launch("keras_digits.py", "--epochs=3", f"--checkpoint_dir={checkpoints}", tmp_path=tmp_path)
    assert first.returncode == 0, first.describe()
    again = launch("keras_digits.py", "--epochs=5", f"--checkpoint_dir={checkpoints}", tmp_path=tmp_path)
    assert again.returncode == 0, again.describe()
    assert "Epoch 4/5" in again.output and "Epoch 3/5" not in again.output, again.describe()


def test_keras_digits_grows_from_1_rank_to_2_inside_an_epoch_and_ends_at_2(tmp_path):
    """The path a user of --min-np takes with the main example: started on the 1 slot found, it
    is offered a second once its first epoch is saved, stops inside epoch 2 with a checkpoint, and
    resumes there on 2 ranks. That resume raised on every rank (compiled metrics asked for a result
    before any step had built them)."""
    checkpoints = tmp_path / "checkpoints"
    discover = tmp_path / "find-hosts"
    discover.write_text(
        f"#!/bin/sh\nif [ -e {checkpoints}/epoch0001.keras ]; then echo localhost:2; else echo localhost:1; fi\n"
    )
    discover.chmod(0o755)
    growing = ["--restarts", "1", "--min-np", "1", "--discovery-interval", "1", "--host-discovery-script", discover]
    job = launch(
        "keras_digits.py",
        "--epochs=8",
        f"--checkpoint_dir={checkpoints}",
        tmp_path=tmp_path,
        flags_of_the_launcher=growing,
    )
    assert job.returncode == 0 and not job.timed_out, job.describe()
    assert "starting 1 of the planned 2 ranks on localhost:1" in job.output, job.describe()
    assert "the job stopped at a step boundary to grow" in job.output, job.describe()
    assert list(checkpoints.glob("epoch*-batch*.keras")), job.describe()  # stopped inside an epoch
    results = re.findall(r"^2 process\(es\): test accuracy ([0-9.]+)", job.output, re.MULTILINE)
    assert len(results) == 1 and float(results[0]) >= 0.9, job.describe()


def test_keras_digits_never_downloads(tmp_path):
    job = launch("keras_digits.py", "--tfds_name=mnist", n=1, tmp_path=tmp_path)
    assert job.returncode != 0 and "needs --data_dir" in job.output, job.describe()


def test_keras_digits_trains_on_a_tfds_set_prepared_offline(tmp_path):
    # As the example's docstring tells a user: prepare the digits as a TFDS set, then train on it
    # by name; the example never imports the builder.
    data_dir = tmp_path / "tensorflow_datasets"
    prepared = run_job(
        [sys.executable, REPO_ROOT / "tests" / "tfds_digits.py", f"--data_dir={data_dir}"],
        tmp_path,
        offline_env(),
        timeout=EXAMPLE_TIMEOUT_S,
        script_name="tfds_digits.py",
    )
    assert prepared.returncode == 0 and "train 1347 examples in 6 files" in prepared.output, prepared.describe()
    job = launch(
        "keras_digits.py",
        "--tfds_name=kerasdist_digits",
        f"--data_dir={data_dir}",
        "--epochs=10",
        tmp_path=tmp_path,
        env=offline_env(),
    )
    assert job.returncode == 0 and not job.timed_out, job.describe()
    results = re.findall(
        r"^2 process\(es\): test accuracy ([0-9.]+), .* on 450 held-out images$", job.output, re.MULTILINE
    )
    assert len(results) == 1 and float(results[0]) >= 0.93, job.describe()
    for output in (prepared.output, job.output):
        assert ATTEMPT_MARKER not in output, "something tried to reach the network" + job.describe()


def test_custom_loop_trains(tmp_path):
    job = launch("custom_loop.py", tmp_path=tmp_path)
    assert job.returncode == 0 and not job.timed_out, job.describe()
    accuracy = re.findall(r"test accuracy ([0-9.]+)", job.output)
    assert len(accuracy) == 1 and float(accuracy[0]) >= 0.9, job.describe()


@pytest.mark.parametrize("ranks", [1, 2])
def test_synthetic_benchmark_reports_its_throughput(tmp_path, ranks):
    job = launch(
        "keras_synthetic_benchmark.py",
        "--num_warmup_batches=2",
        "--num_batches_per_iter=2",
        "--num_iters=2",
        "--batch_size=8",
        n=ranks,
        tmp_path=tmp_path,
    )
    assert job.returncode == 0 and not job.timed_out, job.describe()
    results = [json.loads(line) for line in job.lines_with("RESULT ")]
    assert len(results) == 1, "one RESULT line, from rank 0" + job.describe()
    assert results[0]["ranks"] == ranks and results[0]["images_per_second"] > 0, job.describe()


def test_synthetic_benchmark_trains_with_local_sgd(tmp_path):
    job = launch(
        "keras_synthetic_benchmark.py",
        "--num_warmup_batches=2",
        "--num_batches_per_iter=3",
        "--num_iters=2",
        "--batch_size=8",
        "--average_models_every=2",
        n=2,
        tmp_path=tmp_path,
    )
    assert job.returncode == 0 and not job.timed_out, job.describe()
    [result] = [json.loads(line) for line in job.lines_with("RESULT ")]
    assert result["average_models_every"] == 2 and result["images_per_second"] > 0, job.describe()


def test_a_horovod_script_with_only_its_import_changed_trains_as_well_as_our_own(tmp_path):
    # The bar keras_digits.py is held to (0.95 on the same split); rank 0 alone checkpoints and
    # evaluates, the pattern that hangs when those calls are collectives.
    checkpoints = tmp_path / "checkpoints"
    job = launch("horovod_keras_digits.py", f"--checkpoint_dir={checkpoints}", tmp_path=tmp_path)
    assert job.returncode == 0 and not job.timed_out, job.describe()
    results = re.findall(r"^2 worker\(s\): test accuracy ([0-9.]+)", job.output, re.MULTILINE)
    assert len(results) == 1 and float(results[0]) >= 0.95, job.describe()
    assert "finished gradual learning rate warmup to 0.04" in job.output, job.describe()
    assert sorted(p.name for p in checkpoints.iterdir()) == sorted(f"checkpoint-{e}.keras" for e in range(1, 21))
