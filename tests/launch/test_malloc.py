"""init() makes glibc's malloc keep freed memory for reuse (KERASDIST_MALLOC), and leaves
malloc alone when told to or when the user tuned it; each case in a fresh process."""

import sys

import pytest
from launch_utils import LAUNCH_TEST_MARKS, child_env, python_run

pytestmark = [
    *LAUNCH_TEST_MARKS,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc"),
]

BLOCK_BYTES = 8 * 2**20


def kept_bytes(tmp_path, **env):
    job = python_run("malloc_reuse.py", cwd=tmp_path, env=child_env(**env))
    assert job.returncode == 0 and not job.timed_out, job.describe()
    return job.marker("KEPT_BYTES")


def test_init_keeps_a_freed_block_for_the_next_step(tmp_path):
    assert kept_bytes(tmp_path) >= BLOCK_BYTES


def test_off_leaves_glibcs_defaults(tmp_path):
    # glibc's default: an 8 MiB block is mmapped and unmapped again when freed.
    assert kept_bytes(tmp_path, KERASDIST_MALLOC="off") < BLOCK_BYTES


def test_malloc_the_user_tuned_is_left_alone(tmp_path):
    # Blocks over 1 MiB mmapped, as the user asked: kerasdist's 32 MiB would keep this one.
    assert kept_bytes(tmp_path, MALLOC_MMAP_THRESHOLD_=str(2**20)) < BLOCK_BYTES
