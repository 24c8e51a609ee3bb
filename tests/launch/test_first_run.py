"""A user's first run: `make demo` without any logging variable set says only what the example
says."""

import os
import re
import sys
import threading
import time

import pytest

from launch_utils import LAUNCH_TEST_MARKS, REPO_ROOT, child_env, run_job
from kerasdist.run import output

pytestmark = LAUNCH_TEST_MARKS
LAUNCHER = [sys.executable, "-m", "kerasdist.run"]
DEMO_TIMEOUT_S = 240
ONEDNN_NOTICE = ("I0000 00:00:1796111508.473692    {thread} port.cc:153] oneDNN custom operations are on. "
                 "You may see slightly different numerical results.\n")
ABSL_NOTICE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"


def _user_env():
    """A user's environment: no TF_CPP_MIN_LOG_LEVEL."""
    env = child_env()
    env.pop("TF_CPP_MIN_LOG_LEVEL")
    return env


def _copied(text, tmp_path):
    """What the launcher shows of ``text`` written to the job's stderr."""
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "wb") as writer:
        writer.write(text.encode())
    with open(tmp_path / "shown", "wb") as destination:
        output.copy_showing_startup_notices_once(read_end, destination)
    os.close(read_end)
    return (tmp_path / "shown").read_text()


# ---- the job's stderr --------------------------------------------------------------------

def test_startup_notices_of_every_rank_are_shown_once_and_everything_else_in_order(tmp_path):
    error = "E0000 00:00:1796111508.5 5579 port.cc:153] something went wrong on this rank\n"
    ranks_output = (ABSL_NOTICE + ONEDNN_NOTICE.format(thread=11) + "rank 0 says hello\n"
                    + ABSL_NOTICE + ONEDNN_NOTICE.format(thread=22) + error + "rank 1 says hello\n"
                    + ONEDNN_NOTICE.format(thread=11) + error + "a last line without its newline")
    shown_once = ABSL_NOTICE + ONEDNN_NOTICE.format(thread=11)
    assert _copied(ranks_output, tmp_path) == (shown_once + "rank 0 says hello\n" + error + "rank 1 says hello\n"
                                               + error + "a last line without its newline")


def test_a_partial_line_goes_out_without_waiting_for_its_end(tmp_path):
    progress = b"\r 50% of the epoch"  # redrawn in place: its newline comes much later
    shown = tmp_path / "shown"
    read_end, write_end = os.pipe()
    with open(shown, "wb") as destination:
        copier = threading.Thread(target=output.copy_showing_startup_notices_once, args=(read_end, destination))
        copier.start()
        os.write(write_end, progress)
        deadline = time.monotonic() + 10
        while shown.stat().st_size == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        shown_before_the_end = shown.read_bytes()
        os.close(write_end)
        copier.join(10)
    os.close(read_end)
    assert shown_before_the_end == progress


def test_demo_prints_no_warning_and_each_tensorflow_notice_once(tmp_path):
    argv = [*LAUNCHER, "-np", "2", sys.executable, REPO_ROOT / "examples" / "keras_digits.py", "--epochs=2"]
    job = run_job(argv, tmp_path, _user_env(), timeout=DEMO_TIMEOUT_S, script_name="keras_digits.py")
    assert job.returncode == 0 and not job.timed_out, job.describe()
    assert not re.findall(r"\w*Warning\b", job.output), job.describe()
    for notice in ("All log messages before absl::InitializeLog", "oneDNN custom operations are on"):
        assert job.output.count(notice) == 1, notice + job.describe()
    assert job.output.count("cpu_feature_guard.cc") <= 1, job.describe()
    # What the example prints, from rank 0 alone.
    assert len(re.findall(r"^Epoch 2/2", job.output, re.MULTILINE)) == 1, job.describe()
    assert len(re.findall(r"^2 process\(es\): test accuracy", job.output, re.MULTILINE)) == 1, job.describe()
