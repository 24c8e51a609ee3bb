"""Builds kerasdist's op library: the C++ engine plus its TensorFlow binding.

The library is compiled against the TensorFlow found in the build environment
(``tf.sysconfig`` flags) and an MPI chosen in this order:

1. ``KERASDIST_MPI_HOME``: a system MPI with ``include/mpi.h`` and ``lib/libmpi.so``;
2. the PyPI ``mpich`` package installed beside this Python (the default);
3. the ``mpicc`` on ``PATH`` (its ``-show`` / ``--showme`` flags).

An rpath (``$ORIGIN``-relative, then absolute) lets ``tf.load_op_library`` find
``libmpi`` without ``LD_LIBRARY_PATH``. mpi4py must use the same MPI.

``build_info.json`` beside the library records that MPI, its compile and link flags (which
tests/engine builds the engine with, without TensorFlow), its ``mpiexec`` and flavour (which
``kerasdist-run`` launches with) and the TensorFlow version.
"""

import glob
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("kerasdist", "csrc")


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
    mpicc = shutil.which("mpicc")
    if not mpicc:
        sys.exit("kerasdist: no MPI found. `pip install mpich`, or set KERASDIST_MPI_HOME, or put mpicc on PATH.")
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
    mpiexec = mpi.mpiexec_of_install(bin_dir)
    flavour = mpi.detect_flavour(mpiexec) if mpiexec else None
    return mpiexec, flavour.name if flavour else None


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
        out_dir = self.final_directory(ext)
        tf_lib_dir = tf.sysconfig.get_lib()
        rpaths = []
        for lib_dir in mpi_lib_dirs + [tf_lib_dir]:
            rpaths += ["$ORIGIN/" + os.path.relpath(lib_dir, out_dir), os.path.abspath(lib_dir)]
        # -Wno-interference-size: Eigen (in TensorFlow's headers) uses
        # std::hardware_destructive_interference_size, and GCC 12 warns about that on every include.
        ext.extra_compile_args = (
            ["-O3", "-fPIC", "-Wall", "-Wno-sign-compare", "-Wno-deprecated-declarations", "-Wno-interference-size"]
            + tf.sysconfig.get_compile_flags()
            + mpi_compile
        )
        ext.extra_link_args = tf.sysconfig.get_link_flags() + mpi_link + [f"-Wl,-rpath,{p}" for p in rpaths]
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
                    "nccl": False,
                    "tensorflow": tf.__version__,
                },
                f,
                indent=1,
            )


sources = sorted(glob.glob(os.path.join(CSRC, "engine", "*.cc")) + glob.glob(os.path.join(CSRC, "tensorflow", "*.cc")))
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
    ext_modules=[Extension("kerasdist._kerasdist_ops", sources=sources, depends=headers, language="c++")],
    cmdclass={"build_ext": BuildOpLibrary},
    python_requires=">=3.10",
    install_requires=["tensorflow>=2.16", "keras>=3.10,<4", "mpi4py>=4", "numpy"],
    entry_points={"console_scripts": ["kerasdist-run = kerasdist.run:main"]},
)
