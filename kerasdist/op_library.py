"""The op library: where it is, what it was built with and against, and loading it.

Imports no TensorFlow and no MPI (the launcher's ``--check-build`` uses it): ``load`` gets
TensorFlow from its caller.
"""

import glob
import json
import os
import sys


def library_path():
    here = os.path.dirname(os.path.abspath(__file__))
    found = glob.glob(os.path.join(here, "_kerasdist_ops*.so"))
    if not found:
        raise ImportError(
            "kerasdist's op library is not built; run `make build` (or "
            "`python setup.py build_ext --inplace`) in the kerasdist checkout"
        )
    return found[0]


def load(tf, path):
    """Loads the op library into TensorFlow ``tf``, refusing one built against another release.

    TensorFlow's C++ interface changes between minor releases: such a library fails to load
    with an undefined symbol, or loads and crashes later.
    """
    built_against = build_info().get("tensorflow")
    mismatch = tensorflow_mismatch(built_against, tf.__version__)
    if mismatch:
        raise ImportError(mismatch)
    try:
        return tf.load_op_library(path)
    except tf.errors.NotFoundError as error:  # an undefined symbol across patch releases
        if built_against and built_against != tf.__version__:
            raise ImportError(f"{tensorflow_mismatch(built_against, tf.__version__, always=True)} ({error})") from error
        raise


def tensorflow_mismatch(built_against, running, always=False):
    """Why an op library built against TensorFlow ``built_against`` cannot run in TensorFlow
    ``running``, naming both and the command that rebuilds it; None when their major and minor
    versions agree (or one is unknown), unless ``always``."""
    if not built_against or not running:
        return None
    if not always and built_against.split(".")[:2] == running.split(".")[:2]:
        return None
    return (
        f"kerasdist's op library was built against TensorFlow {built_against}, but this Python "
        f"({sys.executable}) runs TensorFlow {running}; TensorFlow's C++ interface differs between "
        f"releases, so the library must be rebuilt against the running one: {rebuild_command()}"
    )


def rebuild_command():
    """The command that rebuilds kerasdist the way it was installed (pip's direct_url.json)."""
    import importlib.metadata
    import shlex
    import urllib.parse

    info = build_info()
    settings = []
    mpi = info.get("mpi", "")
    if mpi.startswith("KERASDIST_MPI_HOME="):
        settings.append(shlex.quote(mpi))
    elif mpi.startswith("mpicc at "):
        settings.append("MPICC=" + shlex.quote(mpi[len("mpicc at ") :]))
    if info.get("nccl"):
        settings.append("KERASDIST_WITH_NCCL=1")
    try:
        origin = json.loads(importlib.metadata.distribution("kerasdist").read_text("direct_url.json") or "{}")
    except importlib.metadata.PackageNotFoundError:
        origin = {}
    url = origin.get("url", "")
    source = urllib.parse.unquote(url[len("file://") :]) if url.startswith("file://") else url
    if origin.get("dir_info", {}).get("editable"):
        return f"cd {shlex.quote(source)} && " + " ".join(
            settings + [sys.executable, "setup.py", "build_ext", "--inplace"]
        )
    if "vcs_info" in origin:
        vcs = origin["vcs_info"]
        source = f"{vcs['vcs']}+{url}@{vcs.get('commit_id') or vcs.get('requested_revision')}"
    # Not pip's cached wheel: it was built against the TensorFlow the library expects.
    pip = [sys.executable, "-m", "pip", "install", "--no-cache-dir", "--force-reinstall", "--no-deps"]
    if info.get("nccl"):  # the NCCL wheels are found beside the installing Python only
        pip.append("--no-build-isolation")
    return " ".join(
        settings
        + pip
        + [shlex.quote(source) if source else "<the checkout, sdist or git URL you installed kerasdist from>"]
    )


def mpi_built():
    """True: the op library always runs collectives over MPI (Horovod's name; see `nccl_built`).

    Example:

    ```python
    import kerasdist

    print(kerasdist.mpi_built())  # True
    ```
    """
    return True


def build_info():
    """What setup.py recorded beside the op library (build_info.json); {} where it is missing."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "build_info.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def nccl_built():
    """True when the op library has GPU kernels and the NCCL backend (built with ``KERASDIST_WITH_NCCL=1``).

    It says what was compiled, not that this machine has a GPU.

    Example:

    ```python
    import kerasdist
    print(isinstance(kerasdist.nccl_built(), bool))  # True
    ```
    """
    return bool(build_info().get("nccl", False))
