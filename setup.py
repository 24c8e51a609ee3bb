"""Builds kerasdist's op library: the C++ engine plus its TensorFlow binding.

TensorFlow's C++ ABI changes between releases, so the library is compiled against the
TensorFlow that will run it: the one the installing Python imports (``tensorflow``,
``tensorflow-cpu`` or a site build), never one pip fetches. Hence neither ``install_requires``
nor pyproject.toml's build requirements name TensorFlow: either would make pip download a
second TensorFlow (``tensorflow`` beside a user's ``tensorflow-cpu``), into the environment or
into the isolated build environment, and build against a release the user does not run.
Instead this file asks the installing Python, in a subprocess, for ``tf.__version__`` and
``tf.sysconfig``'s flags:

* Under pip's build isolation (the default) the build runs on that same Python, but with
  ``PYTHONPATH`` set to pip's ``sitecustomize`` (which hides the environment's site-packages)
  and ``PYTHONNOUSERSITE=1``. The subprocess runs without those two, so it imports what the
  user's own ``python`` imports. Not ``python -I``: that would also drop, under
  ``--no-build-isolation``, a user's own ``PYTHONPATH`` (a site module's TensorFlow) and user
  site-packages, which pip's isolation has already replaced and this keeps.
* No TensorFlow there (or one older than 2.16, before Keras 3): the build stops, naming what to
  install and ``--no-build-isolation`` for builders that run in a venv of their own (pip's
  ``--use-feature=venv-isolation``, ``python -m build`` for a wheel), where the installing
  Python cannot be found.
* ``build_info.json`` records the TensorFlow version; ``kerasdist.init()`` refuses to load the
  library into another release, naming both and the reinstall command.

MPI, chosen in this order:

1. ``KERASDIST_MPI_HOME``: a system MPI with ``include/mpi.h`` and ``lib/libmpi.so``;
2. ``MPICC``: that MPI compiler wrapper (its ``-show`` / ``--showme`` flags); the variable
   mpi4py's build reads too, so one setting builds both against one MPI;
3. the PyPI ``mpich`` package (the default): its headers from the build environment, where
   pyproject.toml's build requirements put it (pip builds a package before it installs its
   dependencies, so the environment may not have it yet), and at run time the ``libmpi.so.12``
   that ``install_requires``' ``mpich`` puts into the environment (MPICH keeps that ABI across
   releases, as Intel MPI and MVAPICH do);
4. the ``mpicc`` on ``PATH``.

Only with 3 does ``install_requires`` ask for ``mpich``; mpi4py is asked for always (build it
against a system MPI first: docs/deployment.md). An rpath (relative to where the library is
installed, then absolute) lets ``tf.load_op_library`` find ``libmpi`` without
``LD_LIBRARY_PATH``.

``KERASDIST_WITH_NCCL=1`` adds GPU kernels of the ops and an NCCL backend for them, compiled
with g++ alone (no ``nvcc``: the kernels only call the CUDA runtime API) against the PyPI
wheels ``nvidia-nccl-cu12`` (``nccl.h``, ``libnccl.so.2``), ``nvidia-cuda-runtime-cu12``
(``libcudart.so.12`` and its headers) and, for headers those include, ``nvidia-cuda-nvcc-cu12``
and ``nvidia-cuda-cccl-cu12`` (requirements-nccl.txt), found beside this build's Python (so with
``--no-build-isolation``). TensorFlow's own headers suffice, including tensorflow-cpu's.

``build_info.json`` beside the library records that MPI, its compile and link flags as installed
(which tests/engine builds the engine with, without TensorFlow), its ``mpiexec`` and flavour
(which ``kerasdist-run`` launches with) and the TensorFlow version.
"""

import concurrent.futures
import contextlib
import dataclasses
import glob
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time

from setuptools import Extension, find_packages, setup
from setuptools.command.build import build
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("kerasdist", "csrc")
WITH_NCCL = os.environ.get("KERASDIST_WITH_NCCL", "0") == "1"
OLDEST_TENSORFLOW = (2, 16)  # the first release with Keras 3
# What the compile takes with 2 CPUs, as the progress line and README's Install say: 16-20 s on
# 2026-12-07 (2 vCPUs at load 3; tensorflow/ops.cc, the one file with TensorFlow's headers, 7 s).
COMPILE_TIME_ON_2_CPUS = "20 s"

# Run by the installing Python: where it installs, and its TensorFlow's version and build flags.
TARGET_QUERY = r"""
import json, os, sys, sysconfig
found = {"python": sys.executable, "platlib": sysconfig.get_path("platlib"), "data": sysconfig.get_path("data"),
         "scripts": sysconfig.get_path("scripts")}
try:
    import tensorflow as tf
    found["tensorflow"] = {"version": tf.__version__, "path": os.path.dirname(tf.__file__),
                           "lib": tf.sysconfig.get_lib(), "compile_flags": tf.sysconfig.get_compile_flags(),
                           "link_flags": tf.sysconfig.get_link_flags()}
except Exception as error:
    found["tensorflow_error"] = f"{type(error).__name__}: {error}"
print("KERASDIST_TARGET " + json.dumps(found))
"""


def outside_pip_build_env(search_path):
    """The entries of a PATH-like list that are not in a pip isolated build environment (which
    pip makes in temporary directories named pip-build-env-*)."""
    return [p for p in search_path.split(os.pathsep) if p and "pip-build-env-" not in p]


def environment_without_pip_isolation(environ):
    """``environ`` less what pip's build isolation sets to hide the environment's packages."""
    cleaned = dict(environ)
    entries = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    kept = outside_pip_build_env(environ.get("PYTHONPATH", ""))
    if len(kept) != len(entries):
        cleaned.pop("PYTHONNOUSERSITE", None)
    if kept:
        cleaned["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        cleaned.pop("PYTHONPATH", None)
    return cleaned


_target = None


def installing_python():
    """What the installing Python reports (``TARGET_QUERY``): its install paths and TensorFlow."""
    global _target
    if _target is None:
        # cwd "/": a package directory of the checkout must not shadow an installed one.
        result = subprocess.run(
            [sys.executable, "-c", TARGET_QUERY],
            env=environment_without_pip_isolation(os.environ),
            cwd="/",
            capture_output=True,
            text=True,
        )
        lines = [line for line in result.stdout.splitlines() if line.startswith("KERASDIST_TARGET ")]
        if not lines:
            sys.exit(f"kerasdist: {sys.executable} could not report its TensorFlow:\n{result.stderr[-2000:]}")
        _target = json.loads(lines[-1][len("KERASDIST_TARGET ") :])
    return _target


def target_tensorflow():
    """The installing Python's TensorFlow (``TARGET_QUERY``'s fields); exits naming the fix if none."""
    target = installing_python()
    tf = target.get("tensorflow")
    if tf is None:
        sys.exit(
            f"kerasdist: the op library is compiled against the TensorFlow it will run with, and "
            f"{target['python']} cannot import one ({target['tensorflow_error']}). Install TensorFlow "
            f"first (`pip install tensorflow-cpu` or `pip install tensorflow`, >= 2.16), then kerasdist. "
            f"Builders that use a venv of their own (pip --use-feature=venv-isolation, python -m build) "
            f"cannot see it: install with pip, or pass --no-build-isolation."
        )
    version = tuple(int(part) for part in re.findall(r"\d+", tf["version"])[:2])
    if version < OLDEST_TENSORFLOW:
        sys.exit(
            f"kerasdist needs TensorFlow >= 2.16 (Keras 3); {target['python']} has {tf['version']}. "
            f"Upgrade it (`pip install -U tensorflow-cpu` or `tensorflow`), then install kerasdist."
        )
    return tf


@dataclasses.dataclass
class Mpi:
    source: str  # how build_info.json and --check-build name it
    compile_flags: list  # as installed: what build_info.json records
    link_flags: list
    lib_dirs: list  # where libmpi is at run time (the rpath)
    bin_dir: str  # where its mpiexec is at run time
    probe_bin_dir: str  # where its mpiexec is now, to ask which MPI it is
    # Where the build finds the MPI when it is not yet where it will be installed (PyPI mpich
    # in pip's build environment); searched after the installed places.
    build_compile_flags: list = dataclasses.field(default_factory=list)
    build_link_flags: list = dataclasses.field(default_factory=list)


def mpicc_flags(mpicc):
    """The compile and link flags MPI's compiler wrapper adds, from ``-show`` (MPICH) or ``--showme``."""
    for show in ("-show", "--showme"):
        try:
            words = shlex.split(subprocess.check_output([mpicc, show], text=True, stderr=subprocess.DEVNULL))
            break
        except (subprocess.CalledProcessError, OSError):
            continue
    else:
        sys.exit(f"kerasdist: {mpicc} answers neither -show nor --showme")
    return [w for w in words[1:] if w.startswith(("-I", "-D"))], [
        w for w in words[1:] if w.startswith(("-L", "-l", "-Wl"))
    ]


def pypi_mpich_home():
    """The prefix holding include/mpi.h of the ``mpich`` package beside this build's Python, or None."""
    try:
        files = importlib.metadata.distribution("mpich").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    header = next((f for f in files if f.name == "mpi.h" and f.parent.name == "include"), None)
    return os.path.dirname(os.path.dirname(os.path.abspath(header.locate()))) if header else None


def choose_mpi(target=None):
    """The MPI to build against (the module docstring's order), or None when there is none.

    ``target`` (``installing_python()``) places PyPI mpich's run-time library and mpiexec in
    the environment being installed into; without it, they stay where the build finds them.
    """
    home = os.environ.get("KERASDIST_MPI_HOME")
    if home:
        lib, bin_dir = os.path.join(home, "lib"), os.path.join(home, "bin")
        return Mpi(
            f"KERASDIST_MPI_HOME={home}",
            [f"-I{os.path.join(home, 'include')}"],
            [f"-L{lib}", "-lmpi"],
            [lib],
            bin_dir,
            bin_dir,
        )
    mpicc_named = os.environ.get("MPICC")
    mpich = None if mpicc_named else pypi_mpich_home()
    if mpich:
        data = target["data"] if target else mpich
        lib = os.path.join(data, "lib")
        bin_dir = target["scripts"] if target else os.path.join(mpich, "bin")
        mpi = Mpi(
            "PyPI mpich",
            [f"-I{os.path.join(data, 'include')}"],
            [f"-L{lib}", "-lmpi"],
            [lib],
            bin_dir,
            os.path.join(mpich, "bin"),
        )
        if os.path.realpath(data) != os.path.realpath(mpich):
            mpi.build_compile_flags = [f"-I{os.path.join(mpich, 'include')}"]
            mpi.build_link_flags = [f"-L{os.path.join(mpich, 'lib')}"]
        return mpi
    # Not the mpicc of the build environment's mpich, which pip puts first on PATH.
    mpicc = shutil.which(
        mpicc_named or "mpicc", path=os.pathsep.join(outside_pip_build_env(os.environ.get("PATH", os.defpath)))
    )
    if not mpicc:
        return None
    compile_flags, link_flags = mpicc_flags(mpicc)
    lib_dirs = [w[2:] for w in link_flags if w.startswith("-L")]
    bin_dir = os.path.dirname(mpicc)
    return Mpi(f"mpicc at {mpicc}", compile_flags, link_flags, lib_dirs, bin_dir, bin_dir)


def mpi_wrapper_suffix():
    """The suffix of the named mpicc (".openmpi" of Debian's mpicc.openmpi), which its mpiexec shares."""
    name = os.path.basename(os.environ.get("MPICC", "mpicc"))
    return name[len("mpicc") :] if name.startswith("mpicc") else ""


def nvidia_wheel_dir(name):
    """Where the PyPI wheel ``nvidia-<name>`` put its include/ and lib/ (the ``nvidia.<name>`` package)."""
    spec = importlib.util.find_spec(f"nvidia.{name.replace('-', '_')}")
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            f"kerasdist: KERASDIST_WITH_NCCL=1 needs the PyPI wheel nvidia-{name}-cu12; "
            "pip install -r requirements-nccl.txt"
        )
    return list(spec.submodule_search_locations)[0]


def nccl_flags():
    """Returns (compile_flags, link_flags, lib_dirs, version) for NCCL and the CUDA runtime."""
    nccl, cudart = nvidia_wheel_dir("nccl"), nvidia_wheel_dir("cuda-runtime")
    # cuda_runtime_api.h includes crt/host_defines.h (shipped with nvcc's headers) and nccl.h's
    # cuda_fp16.h includes <nv/target> (CCCL's); both are headers only here.
    includes = [nccl, cudart, nvidia_wheel_dir("cuda-nvcc"), nvidia_wheel_dir("cuda-cccl")]
    header = open(os.path.join(nccl, "include", "nccl.h"), encoding="utf-8").read()
    version = ".".join(
        re.search(rf"#define NCCL_{part}\s+(\d+)", header).group(1) for part in ("MAJOR", "MINOR", "PATCH")
    )
    lib_dirs = [os.path.join(nccl, "lib"), os.path.join(cudart, "lib")]
    # The wheels ship only versioned names; --no-as-needed keeps NCCL linked although only
    # kernels that may never run call it, so a missing libnccl fails at load, not mid-training.
    link = [f"-L{d}" for d in lib_dirs] + [
        "-Wl,--no-as-needed",
        "-l:libnccl.so.2",
        "-l:libcudart.so.12",
        "-Wl,--as-needed",
    ]
    return ["-DKERASDIST_WITH_NCCL"] + [f"-I{os.path.join(d, 'include')}" for d in includes], link, lib_dirs, version


def launcher_mpi_module():
    """kerasdist/run/mpi.py, loaded by path: the package is not importable while it is built."""
    path = os.path.join(HERE, "kerasdist", "run", "mpi.py")
    spec = importlib.util.spec_from_file_location("_kerasdist_run_mpi", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mpiexec_and_flavour(mpi):
    """Where the MPI's mpiexec will be, and its flavour name ("mpich", "intel", "openmpi"); None where unknown."""
    module = launcher_mpi_module()
    probe = module.mpiexec_of_install(mpi.probe_bin_dir, mpi_wrapper_suffix())
    if not probe:
        return None, None
    flavour = module.detect_flavour(probe)
    mpiexec = os.path.join(mpi.bin_dir, os.path.basename(probe))
    return mpiexec, flavour.name if flavour else None


def require_mpi(target):
    mpi = choose_mpi(target)
    if mpi is None:
        sys.exit(
            f"kerasdist: no MPI found (no PyPI mpich beside {sys.executable}, no {os.environ.get('MPICC', 'mpicc')} "
            "on PATH). `pip install mpich`, or set KERASDIST_MPI_HOME, or name your MPI's compiler wrapper in "
            "MPICC (e.g. MPICC=mpicc.openmpi)."
        )
    return mpi


class BuildVariantApart(build):
    """Builds the NCCL variant under build/nccl/ and one against another MPI than PyPI's mpich
    under build/mpi-<which>/, so that variants built at once do not share object files."""

    def initialize_options(self):
        super().initialize_options()
        variant = ["nccl"] if WITH_NCCL else []
        mpi = choose_mpi()
        if mpi and mpi.source != "PyPI mpich":
            variant.append("mpi-" + re.sub(r"[^A-Za-z0-9.]+", "_", mpi.source).strip("_"))
        if variant:
            self.build_base = os.path.join("build", *variant)


def progress_terminal():
    """Where compile progress goes: the user's terminal. A plain `pip install` shows a build's
    output only with -v (a spinner otherwise), so when stderr is not a terminal the
    controlling terminal is written to directly; without one (CI, a log), stderr."""
    if not sys.stderr.isatty():
        try:
            return open("/dev/tty", "w", encoding="utf-8")
        except OSError:
            pass
    return sys.stderr


class CompileProgress:
    """One line when the compile starts, saying how long it takes, and one per compiled file
    with the time since then."""

    def __init__(self, files, jobs):
        self.files, self.done, self.started = files, 0, time.monotonic()
        self.lock = threading.Lock()
        self.stream = progress_terminal()
        self.say(
            f"compiling the op library: {files} C++ files, {jobs} at a time "
            f"(about {COMPILE_TIME_ON_2_CPUS} with 2 CPUs)"
        )

    def say(self, text):
        elapsed = int(time.monotonic() - self.started)
        self.stream.write(f"kerasdist: [{elapsed // 60}:{elapsed % 60:02d}] {text}\n")
        self.stream.flush()

    def compiled(self, source):
        with self.lock:
            self.done += 1
            self.say(f"compiled {self.done}/{self.files}: {os.path.relpath(source, CSRC)}")


class BuildOpLibrary(build_ext):
    """Compiles with TensorFlow's and MPI's flags instead of Python's extension defaults."""

    def run(self):
        # setuptools compiles into build/ and copies to the source tree afterwards when building
        # in place (build_ext --inplace, editable installs), clearing `inplace` meanwhile.
        self.library_goes_to_source_tree = bool(self.inplace)
        # setuptools skips a library newer than its sources; but a checkout's build/ may hold
        # one compiled against another environment's TensorFlow, so an install always compiles.
        if not self.library_goes_to_source_tree:
            self.force = True
        super().run()

    @contextlib.contextmanager
    def compiling_in_parallel(self):
        """setuptools compiles one extension's sources one after another (its ``-j`` runs
        extensions side by side, and there is one); the library's ~20 files, a few of them heavy
        with TensorFlow's headers, compile one per CPU instead (``build_ext -j N`` sets N)."""
        jobs = self.parallel if isinstance(self.parallel, int) and self.parallel > 1 else len(os.sched_getaffinity(0))
        compile_sources = self.compiler.compile

        def compile_each(sources, *args, **kwargs):
            progress = CompileProgress(len(sources), max(1, jobs))

            def compile_one(source):
                objects = compile_sources([source], *args, **kwargs)
                progress.compiled(source)
                return objects

            with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
                compiled = list(pool.map(compile_one, sources))
            progress.say("linking")
            return [obj for objects in compiled for obj in objects]

        self.compiler.compile = compile_each
        try:
            yield
        finally:
            self.compiler.compile = compile_sources

    def final_directory(self, ext, target):
        """Where the library will be loaded from: the package's source directory when built in
        place, else the package's directory in the installing Python's site-packages."""
        package = ".".join(self.get_ext_fullname(ext.name).split(".")[:-1])
        if not self.library_goes_to_source_tree:
            return os.path.join(target["platlib"], *package.split("."))
        return os.path.abspath(self.get_finalized_command("build_py").get_package_dir(package))

    def build_extension(self, ext):
        target = installing_python()
        tf = target_tensorflow()
        mpi = require_mpi(target)
        # The engine calls MPI's C API only. Open MPI's mpi.h (Debian's 4.1) otherwise pulls its
        # C++ bindings into C++ code, which then needs libmpi_cxx: the library failed to load with
        # "undefined symbol: _ZN3MPI8Datatype4FreeEv".
        mpi_compile = ["-DOMPI_SKIP_MPICXX=1", "-DMPICH_SKIP_MPICXX=1", *mpi.compile_flags]
        nccl_compile, nccl_link, nccl_lib_dirs, nccl_version = nccl_flags() if WITH_NCCL else ([], [], [], None)
        final_dir = self.final_directory(ext, target)
        rpaths = []
        for lib_dir in mpi.lib_dirs + nccl_lib_dirs + [tf["lib"]]:
            rpaths += ["$ORIGIN/" + os.path.relpath(lib_dir, final_dir), os.path.abspath(lib_dir)]
        # -Wno-interference-size: Eigen (in TensorFlow's headers) uses
        # std::hardware_destructive_interference_size, and GCC 12 warns about that on every include.
        ext.extra_compile_args = (
            ["-O3", "-fPIC", "-Wall", "-Wno-sign-compare", "-Wno-deprecated-declarations", "-Wno-interference-size"]
            + tf["compile_flags"]
            + mpi_compile
            + mpi.build_compile_flags
            + nccl_compile
        )
        ext.extra_link_args = (
            tf["link_flags"] + mpi.link_flags + mpi.build_link_flags + nccl_link + [f"-Wl,-rpath,{p}" for p in rpaths]
        )
        # Python's own CFLAGS (e.g. -DNDEBUG -g -fwrapv) are harmless; its C++ std flag is ours.
        with self.compiling_in_parallel():
            super().build_extension(ext)
        mpiexec, flavour = mpiexec_and_flavour(mpi)
        # Beside the library being built; setuptools installs or copies it with the library.
        out_dir = os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))
        if self.library_goes_to_source_tree:
            out_dir = final_dir
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "build_info.json"), "w") as f:
            json.dump(
                {
                    "mpi": mpi.source,
                    "mpi_compile_flags": mpi_compile,
                    "mpi_link_flags": mpi.link_flags,
                    "mpiexec": mpiexec,
                    "mpi_flavour": flavour,
                    "nccl": WITH_NCCL,
                    "nccl_version": nccl_version,
                    "tensorflow": tf["version"],
                },
                f,
                indent=1,
            )


source_dirs = ["engine", "tensorflow"] + (["nccl", os.path.join("tensorflow", "gpu")] if WITH_NCCL else [])
sources = sorted(f for d in source_dirs for f in glob.glob(os.path.join(CSRC, d, "*.cc")))
headers = sorted(glob.glob(os.path.join(CSRC, "**", "*.h"), recursive=True))
built_mpi = choose_mpi()

setup(
    name="kerasdist",
    version="0.1.0",
    description="Data-parallel Keras 3 / TensorFlow training over MPI",
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: C++",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
    # examples/ installs as kerasdist.examples: `python -m kerasdist.examples.keras_digits` runs
    # one from any install, while a checkout keeps running examples/keras_digits.py as a script.
    packages=find_packages(include=["kerasdist", "kerasdist.*"]) + ["kerasdist.examples"],
    package_dir={"kerasdist.examples": "examples"},
    # setup.py sets the library's compile and link flags: a change to it rebuilds the library.
    ext_modules=[
        Extension("kerasdist._kerasdist_ops", sources=sources, depends=headers + ["setup.py"], language="c++")
    ],
    cmdclass={"build": BuildVariantApart, "build_ext": BuildOpLibrary},
    python_requires=">=3.10",
    # No TensorFlow: the installed one is built against (module docstring). PyPI's mpich only when
    # this build uses it; with a system MPI, mpi4py must be built against that MPI beforehand.
    install_requires=["keras>=3.10,<4", "mpi4py>=4", "numpy"]
    + (["mpich>=4"] if built_mpi and built_mpi.source == "PyPI mpich" else []),
    # What the examples need beyond kerasdist: scikit-learn's bundled digits (no download).
    extras_require={"examples": ["scikit-learn>=1.4"]},
    entry_points={"console_scripts": ["kerasdist-run = kerasdist.run:main"]},
)
