"""The engine without TensorFlow: c_api_test.cc, compiled from kerasdist/csrc/engine/*.cc and MPI
alone (no TensorFlow header or library), runs the engine's C API under mpiexec with fusion on,
with small fusion buffers and with fusion off, checking results it computes itself."""

import glob
import re
import shlex
import shutil
import subprocess
import time

import pytest
from launch_utils import DEFAULT_JOB_TIMEOUT_S, LAUNCH_TEST_MARKS, MPIEXEC, REPO_ROOT, run_job

from kerasdist.run.launcher import read_build_info

pytestmark = LAUNCH_TEST_MARKS

ENGINE_DIR = REPO_ROOT / "kerasdist" / "csrc" / "engine"
TEST_PROGRAM = REPO_ROOT / "tests" / "engine" / "c_api_test.cc"
BUILD_INFO = REPO_ROOT / "kerasdist" / "build_info.json"
COMPILE_TIMEOUT_S = 600
FUSION_THRESHOLDS = {
    "fused": 64 << 20,
    # Groups split over several buffers, and tensors past it reduced in threshold-sized pieces.
    "small_buffers": 4096,
    "unfused": 0,
}


def compile_command(output, program):
    build_info = read_build_info(BUILD_INFO)
    if build_info is None or "mpi_compile_flags" not in build_info:
        pytest.fail(f"{BUILD_INFO} is missing or predates mpi_compile_flags: build the op library (make build)")
    link_flags = build_info["mpi_link_flags"]
    rpaths = [f"-Wl,-rpath,{flag[2:]}" for flag in link_flags if flag.startswith("-L")]
    # Every engine source, whatever files it is split into, and nothing from csrc/tensorflow.
    sources = sorted(glob.glob(str(ENGINE_DIR / "*.cc")))
    return [
        "g++",
        "-std=c++17",
        "-O1",  # the engine's logic is under test, not its speed
        "-pthread",
        "-Wall",
        "-Wno-sign-compare",
        f"-I{ENGINE_DIR}",
        *build_info["mpi_compile_flags"],
        *sources,
        str(program),
        "-o",
        str(output),
        *link_flags,
        *rpaths,
    ]


def compiled_program(tmp_path_factory, source):
    """`source` compiled with every engine source into a fresh directory; its path."""
    if shutil.which("g++") is None:
        pytest.fail("g++ is needed to build the engine tests (it builds the op library too)")
    program = tmp_path_factory.mktemp("engine") / source.stem
    command = compile_command(program, source)
    started = time.monotonic()
    compiled = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    assert compiled.returncode == 0, f"$ {shlex.join(command)}\n{compiled.stdout}{compiled.stderr}"
    print(f"compiled {program.name} in {time.monotonic() - started:.1f} s")
    return program


@pytest.fixture(scope="session")
def c_api_test(tmp_path_factory):
    return compiled_program(tmp_path_factory, TEST_PROGRAM)


@pytest.mark.parametrize("threshold", FUSION_THRESHOLDS.values(), ids=FUSION_THRESHOLDS.keys())
@pytest.mark.parametrize("ranks", [2, 3])
def test_engine_c_api_without_tensorflow(c_api_test, ranks, threshold, tmp_path):
    job = run_job(
        [MPIEXEC, "-n", ranks, c_api_test, threshold],
        cwd=tmp_path,
        timeout=DEFAULT_JOB_TIMEOUT_S,
        script_name=c_api_test.name,
    )
    assert not job.timed_out and job.returncode == 0, job.describe()
    passed = re.findall(r"^rank \d+: passed, 0 of [1-9]\d* checks failed$", job.output, re.MULTILINE)
    assert len(passed) == ranks, job.describe()
