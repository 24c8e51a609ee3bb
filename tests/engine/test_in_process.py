"""The engine over a second transport: in_process_test.cc runs three ranks as threads of one
process, each with its own Engine over in_process_transport.h (a control plane and a backend of
a few hundred lines, no MPI), and checks negotiation, fusion, compression, broadcast, allgather,
a mismatch and a stalled rank against values it computes itself. It shows that a transport is
one file implementing control_plane.h and backend.h: nothing in the engine changes for it."""

import re
import subprocess

import pytest
from launch_utils import LAUNCH_TEST_MARKS, REPO_ROOT
from test_c_api import compiled_program

pytestmark = LAUNCH_TEST_MARKS
TEST_PROGRAM = REPO_ROOT / "tests" / "engine" / "in_process_test.cc"
RUN_TIMEOUT_S = 120  # it takes seconds; a hang fails here


@pytest.fixture(scope="module")
def in_process_test(tmp_path_factory):
    return compiled_program(tmp_path_factory, TEST_PROGRAM)


def test_three_engines_in_one_process_agree_over_the_in_process_transport(in_process_test, tmp_path):
    # No mpiexec: the program is one process, and makes no MPI call.
    ran = subprocess.run([in_process_test], cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    output = ran.stdout + ran.stderr
    assert ran.returncode == 0, output
    assert re.search(r"^passed, 0 of [1-9]\d* checks failed$", ran.stdout, re.MULTILINE), output
    # The stalled rank was named by what it answered while idle, through the transport's messages.
    assert "rank(s) 2 (host thread2) (not in any collective)" in output, output
