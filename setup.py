"""Builds kerasdist's op library: the C++ engine plus its TensorFlow binding.

The library is compiled against the TensorFlow found in the build environment
(``tf.sysconfig`` flags) and an MPI chosen in this order:

1. ``KERASDIST_MPI_HOME``: a system MPI with ``include/mpi.h`` and ``lib/libmpi.so``;
2. the PyPI ``mpich`` package installed beside this Python (the default);
3. the ``mpicc`` on ``PATH`` (its ``-show`` / ``--showme`` flags).

An rpath (``$ORIGIN``-relative, then absolute) lets ``tf.load_op_library`` find
``libmpi`` without ``LD_LIBRARY_PATH``. mpi4py must use the same MPI.

``KERASDIST_WITH_NCCL=1`` adds GPU kernels of the ops and an NCCL backend for them, compiled
with g++ alone (no ``nvcc``: the kernels only call the CUDA runtime API) against the PyPI
wheels ``nvidia-nccl-cu12`` (``nccl.h``, ``libnccl.so.2``), ``nvidia-cuda-runtime-cu12``
(``libcudart.so.12`` and its headers) and, for headers those include, ``nvidia-cuda-nvcc-cu12``
and ``nvidia-cuda-cccl-cu12`` (requirements-nccl.txt). TensorFlow's own headers suffice,
including tensorflow-cpu's.

``build_info.json`` beside the library records that MPI, its compile and link flags (which
tests/engine builds the engine with, without TensorFlow), its ``mpiexec`` and flavour (which
``kerasdist-run`` launches with) and the TensorFlow version.
"""

import glob
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, find_packages, setup
from setuptools.command.build import build
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("kerasdist", "csrc")
WITH_NCCL = os.environ.get("KERASDIST_WITH_NCCL", "0") == "1"


def mpi_flags():
    """Returns (compile_flags, link_flags, lib_dirs, description, bin_dir) for the chosen MPI."""
    home = os.environ.get("KERASDIST_MPI_HOME")
    if home:
        lib = os.path.join(home, "lib")
        return (
            [f"-I{os.path.join(home, 'include')}"],
            [f"-L{lib}", "-lmpi"],
            [lib],
            f"KERASDIST_MPI_HOME={home}",
            os.path.join(home, "bin"),
        )
    if os.path.exists(os.path.join(sys.prefix, "include", "mpi.h")):
        lib = os.path.join(sys.prefix, "lib")
        return (
            [f"-I{os.path.join(sys.prefix, 'include')}"],
            [f"-L{lib}", "-lmpi"],
            [lib],
            "PyPI mpich",
            sysconfig.get_path("scripts"),
        )
    # MPICC is the variable mpi4py's build reads too, so one setting builds both against one MPI.
    mpicc_name = os.environ.get("MPICC", "mpicc")
    mpicc = shutil.which(mpicc_name)
    if not mpicc:
        sys.exit(
            f"kerasdist: no MPI found (no {mpicc_name} on PATH). `pip install mpich`, or set KERASDIST_MPI_HOME, "
            "or put mpicc on PATH (or name it in MPICC, e.g. MPICC=mpicc.openmpi)."
        )
    for show in ("-show", "--showme"):
        try:
            words = shlex.split(subprocess.check_output([mpicc, show], text=True, stderr=subprocess.DEVNULL))
            break
        except (subprocess.CalledProcessError, OSError):
            continue
    else:
        sys.exit(f"kerasdist: {mpicc} answers neither -show nor --showme")
    compile_flags = [w for w in words[1:] if w.startswith(("-I", "-D"))]
    link_flags = [w for w in words[1:] if w.startswith(("-L", "-l", "-Wl"))]
    lib_dirs = [w[2:] for w in link_flags if w.startswith("-L")]
    return compile_flags, link_flags, lib_dirs, f"mpicc at {mpicc}", os.path.dirname(mpicc)


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


def mpiexec_and_flavour(bin_dir):
    """The MPI's mpiexec and its flavour name ("mpich", "intel", "openmpi"); None where unknown."""
    mpi = launcher_mpi_module()
    mpiexec = mpi.mpiexec_of_install(bin_dir, mpi_wrapper_suffix())
    flavour = mpi.detect_flavour(mpiexec) if mpiexec else None
    return mpiexec, flavour.name if flavour else None


class BuildVariantApart(build):
    """Builds the NCCL variant under build/nccl/ and one against another MPI than PyPI's mpich
    under build/mpi-<which>/: setuptools skips an extension that looks up to date in its build
    directory, so a shared one would hand one variant another's library."""

    def initialize_options(self):
        super().initialize_options()
        variant = ["nccl"] if WITH_NCCL else []
        mpi_source = mpi_flags()[3]
        if mpi_source != "PyPI mpich":
            variant.append("mpi-" + re.sub(r"[^A-Za-z0-9.]+", "_", mpi_source).strip("_"))
        if variant:
            self.build_base = os.path.join("build", *variant)


class BuildOpLibrary(build_ext):
    """Compiles with TensorFlow's and MPI's flags instead of Python's extension defaults."""

    def run(self):
        # setuptools compiles into build/ and copies to the source tree afterwards when building
        # in place (build_ext --inplace, editable installs), clearing `inplace` meanwhile.
        self.library_goes_to_source_tree = bool(self.inplace)
        super().run()

    def final_directory(self, ext):
        """Where the library will be loaded from: the package's source directory when built
        in place, else the build directory that gets installed."""
        if not self.library_goes_to_source_tree:
            return os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))
        package = ".".join(self.get_ext_fullname(ext.name).split(".")[:-1])
        return os.path.abspath(self.get_finalized_command("build_py").get_package_dir(package))

    def build_extension(self, ext):
        import tensorflow as tf  # only needed at build time

        mpi_compile, mpi_link, mpi_lib_dirs, mpi_source, mpi_bin_dir = mpi_flags()
        # The engine calls MPI's C API only. Open MPI's mpi.h (Debian's 4.1) otherwise pulls its
        # C++ bindings into C++ code, which then needs libmpi_cxx: the library failed to load with
        # "undefined symbol: _ZN3MPI8Datatype4FreeEv".
        mpi_compile = ["-DOMPI_SKIP_MPICXX=1", "-DMPICH_SKIP_MPICXX=1", *mpi_compile]
        nccl_compile, nccl_link, nccl_lib_dirs, nccl_version = nccl_flags() if WITH_NCCL else ([], [], [], None)
        out_dir = self.final_directory(ext)
        tf_lib_dir = tf.sysconfig.get_lib()
        rpaths = []
        for lib_dir in mpi_lib_dirs + nccl_lib_dirs + [tf_lib_dir]:
            rpaths += ["$ORIGIN/" + os.path.relpath(lib_dir, out_dir), os.path.abspath(lib_dir)]
        # -Wno-interference-size: Eigen (in TensorFlow's headers) uses
        # std::hardware_destructive_interference_size, and GCC 12 warns about that on every include.
        ext.extra_compile_args = (
            ["-O3", "-fPIC", "-Wall", "-Wno-sign-compare", "-Wno-deprecated-declarations", "-Wno-interference-size"]
            + tf.sysconfig.get_compile_flags()
            + mpi_compile
            + nccl_compile
        )
        ext.extra_link_args = tf.sysconfig.get_link_flags() + mpi_link + nccl_link + [f"-Wl,-rpath,{p}" for p in rpaths]
        # Python's own CFLAGS (e.g. -DNDEBUG -g -fwrapv) are harmless; its C++ std flag is ours.
        super().build_extension(ext)
        mpiexec, flavour = mpiexec_and_flavour(mpi_bin_dir)
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "build_info.json"), "w") as f:
            json.dump(
                {
                    "mpi": mpi_source,
                    "mpi_compile_flags": mpi_compile,
                    "mpi_link_flags": mpi_link,
                    "mpiexec": mpiexec,
                    "mpi_flavour": flavour,
                    "nccl": WITH_NCCL,
                    "nccl_version": nccl_version,
                    "tensorflow": tf.__version__,
                },
                f,
                indent=1,
            )


source_dirs = ["engine", "tensorflow"] + (["nccl", os.path.join("tensorflow", "gpu")] if WITH_NCCL else [])
sources = sorted(f for d in source_dirs for f in glob.glob(os.path.join(CSRC, d, "*.cc")))
headers = sorted(glob.glob(os.path.join(CSRC, "**", "*.h"), recursive=True))

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
        "License :: OSI Approved :: Apache Software License",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: C++",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
    packages=find_packages(include=["kerasdist", "kerasdist.*"]),
    # setup.py sets the library's compile and link flags: a change to it rebuilds the library.
    ext_modules=[
        Extension("kerasdist._kerasdist_ops", sources=sources, depends=headers + ["setup.py"], language="c++")
    ],
    cmdclass={"build": BuildVariantApart, "build_ext": BuildOpLibrary},
    python_requires=">=3.10",
    install_requires=["tensorflow>=2.16", "keras>=3.10,<4", "mpi4py>=4", "numpy"],
    entry_points={"console_scripts": ["kerasdist-run = kerasdist.run:main"]},
)
