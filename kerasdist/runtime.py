"""Process-level state: MPI start-up, ranks, the engine's knobs and life cycle.

``init()`` starts MPI through mpi4py (thread level MULTIPLE), loads the op library and
starts the engine thread. A plain ``python train.py`` is an MPI singleton: a world of size 1
in which every collective is the identity.
"""

import atexit
import ctypes
import dataclasses
import glob
import json
import os
import sys
import threading
import time
import warnings

from kerasdist.knobs import Knobs, engine_settings, unknown_variables_message

# The number of ranks the job was planned with, when it runs on fewer (set by `kerasdist-run
# --min-np` after it lost hosts; see `planned_size`).
PLANNED_SIZE_VARIABLE = "KERASDIST_PLANNED_SIZE"


@dataclasses.dataclass
class _State:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    planned_size: int
    # Every rank on one host, and no GPU there: gradient buckets have nothing to hide behind.
    one_cpu_host: bool
    knobs: Knobs
    ops: object  # the tf.load_op_library module
    engine: ctypes.CDLL


_state = None
_shut_down = False
_lock = threading.RLock()


def _library_path():
    here = os.path.dirname(os.path.abspath(__file__))
    found = glob.glob(os.path.join(here, "_kerasdist_ops*.so"))
    if not found:
        raise ImportError(
            "kerasdist's op library is not built; run `make build` (or "
            "`python setup.py build_ext --inplace`) in the kerasdist checkout"
        )
    return found[0]


def _load_op_library(tf, path):
    """Loads the op library into TensorFlow ``tf``, refusing one built against another release.

    TensorFlow's C++ interface changes between minor releases: such a library fails to load
    with an undefined symbol, or loads and crashes later.
    """
    built_against = _build_info().get("tensorflow")
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
        f"releases, so the library must be rebuilt against the running one: {_rebuild_command()}"
    )


def _rebuild_command():
    """The command that rebuilds kerasdist the way it was installed (pip's direct_url.json)."""
    import importlib.metadata
    import shlex
    import urllib.parse

    info = _build_info()
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


def _import_mpi():
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.thread_level = "multiple"  # the engine thread calls MPI beside Python's
    from mpi4py import MPI

    return MPI


def init():
    """Starts kerasdist in this process; later calls do nothing.

    Collectives call it implicitly. Under a launcher every rank must call it (directly or
    through its first collective).

    When several ranks on a host may run on the same CPUs (a launcher that does not bind),
    it sizes TensorFlow's thread pools to each rank's share of them, unless the user did
    (``KERASDIST_TF_THREADS``). That works only before TensorFlow runs its first op, so call
    it first.

    Example:

    ```python
    import kerasdist
    kerasdist.init()
    print(0 <= kerasdist.rank() < kerasdist.size())  # True
    ```
    """
    global _state
    with _lock:
        if _state is not None:
            return
        if _shut_down:
            raise RuntimeError("kerasdist was shut down in this process and cannot be started again")
        knobs = Knobs.from_environment()
        if knobs.malloc == "auto":
            _keep_freed_memory()
        MPI = _import_mpi()
        import tensorflow as tf

        world = MPI.COMM_WORLD
        rank, size = world.Get_rank(), world.Get_size()
        planned_size = planned_size_from_environment(os.environ, size)  # every rank sees the same
        unknown_variables = unknown_variables_message(os.environ)
        if unknown_variables and rank == 0:  # the same variables reach every rank: say it once
            warnings.warn(unknown_variables, stacklevel=2)
        local = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        cross = world.Split(color=local.Get_rank(), key=rank)
        cpus, sharing = _cpu_share(local)  # a collective: every rank joins, whatever its knob says
        if knobs.tf_threads == "auto" and sharing > 1:
            _fit_tf_thread_pools(tf, cpus, sharing, warn=local.Get_rank() == 0)
        # Agreed over the host so every rank makes the same gradient buckets; listing physical
        # devices leaves TensorFlow's runtime unstarted (users set GPU memory growth after init).
        gpu_on_host = any(local.allgather(bool(tf.config.list_physical_devices("GPU"))))
        path = _library_path()
        ops = _load_op_library(tf, path)
        engine = ctypes.CDLL(path)
        engine.kerasdist_start.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_char_p),
            ctypes.POINTER(ctypes.c_char_p),
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        engine.kerasdist_submit_failure.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
        engine.kerasdist_join.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_char_p, ctypes.c_int]
        engine.kerasdist_engine_times.argtypes = [
            ctypes.POINTER(ctypes.c_char_p),
            ctypes.POINTER(ctypes.c_double),
            ctypes.c_int,
        ]
        error = ctypes.create_string_buffer(1024)
        settings = engine_settings(knobs)
        names = (ctypes.c_char_p * len(settings))(*(name.encode() for name, _ in settings))
        values = (ctypes.c_char_p * len(settings))(*(text.encode() for _, text in settings))
        failed = engine.kerasdist_start(len(settings), names, values, error, len(error))
        if failed:
            raise RuntimeError(error.value.decode())
        _state = _State(
            rank=rank,
            size=size,
            local_rank=local.Get_rank(),
            local_size=local.Get_size(),
            cross_rank=cross.Get_rank(),
            cross_size=cross.Get_size(),
            planned_size=planned_size,
            one_cpu_host=local.Get_size() == size and not gpu_on_host,
            knobs=knobs,
            ops=ops,
            engine=engine,
        )
        local.Free()
        cross.Free()
        # Registered after mpi4py's import, so it runs before MPI_Finalize.
        atexit.register(shutdown)
        if size > 1:
            _abort_job_on_uncaught_exception(MPI)
            _remember_exit_status()
            _exit_through_shutdown(MPI)


def planned_size_from_environment(environ, size):
    """`KERASDIST_PLANNED_SIZE` in `environ` for a job of `size` ranks: `size` when unset.

    Raises:
        ValueError: the value is not a whole multiple of `size` (each rank must stand in for a
            whole number of planned ranks), naming the variable, its text and the fix.
    """
    text = environ.get(PLANNED_SIZE_VARIABLE, "").strip()
    if not text:
        return size
    try:
        planned = int(text)
    except ValueError:
        planned = 0
    if planned < size or planned % size:
        raise ValueError(
            f"{PLANNED_SIZE_VARIABLE}={text!r} must be a whole multiple of this job's {size} rank(s): each "
            f"rank stands in for planned / {size} ranks to keep the planned global batch; unset it, or run "
            f"a number of ranks that divides it"
        )
    return planned


# glibc's mallopt() parameters (malloc.h) and the values init() gives them.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # the ceiling of glibc's own sliding threshold
TRIM_THRESHOLD_BYTES = 64 * 2**20
_MALLOC_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def _keep_freed_memory():
    """Has glibc's malloc keep up to 64 MiB of freed memory per arena for reuse.

    By default glibc hands the free top of a thread's heap back to the system once it exceeds a
    threshold that slides with the program's history, and serves blocks over another sliding
    threshold with a fresh mmap. A training step frees and reallocates the same buffers every
    step, and when the collectives' timing tips an arena over its threshold, each step pays for
    zeroing and faulting those pages in again: 13-22 ms of system time in a 80 ms step of the
    small CNN at 2 ranks on one host, where plain Keras paid 1 ms (docs/performance.md). Fixed
    thresholds (blocks under 32 MiB from the heap, up to 64 MiB of its free top kept) end that.
    Left alone: a process whose MALLOC_*_ variables tune malloc, and a C library that is not glibc.
    """
    if any(variable in os.environ for variable in _MALLOC_VARIABLES):
        return
    libc = ctypes.CDLL(None)
    if hasattr(libc, "gnu_get_libc_version"):
        # Setting either threshold also stops glibc from sliding the other, so both are set.
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)


def _cpu_share(local):
    """(CPUs this process may run on, ranks on this host that may run on some of them)."""
    mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    return len(mine), sum(1 for theirs in local.allgather(mine) if theirs & mine)


def _fit_tf_thread_pools(tf, cpus, sharing, warn):
    """Sizes TensorFlow's intra- and inter-op pools to this rank's share of its CPUs.

    TensorFlow sizes both pools to every CPU the process may run on, so ranks that the
    launcher did not bind each start that many threads on the same cores, and their idle
    workers spin while another rank's math and MPI wait for a core. A pool the user sized
    (TF_NUM_*_THREADS or tf.config.threading) is left alone; so is a rank bound to its own
    CPUs, where TensorFlow's default already is its share.
    """
    threads = max(1, cpus // sharing)
    # The inter-op pool gets two threads even on one CPU: with one, TensorFlow runs backprop's
    # chain of ops inline on it and a gradient bucket's collective waits in the pool's queue until
    # the whole backward pass is done, so nothing overlaps. The second thread mostly sleeps.
    pools = [
        (
            "intra-op",
            "TF_NUM_INTRAOP_THREADS",
            tf.config.threading.get_intra_op_parallelism_threads,
            tf.config.threading.set_intra_op_parallelism_threads,
            threads,
        ),
        (
            "inter-op",
            "TF_NUM_INTEROP_THREADS",
            tf.config.threading.get_inter_op_parallelism_threads,
            tf.config.threading.set_inter_op_parallelism_threads,
            max(2, threads),
        ),
    ]
    too_late = []
    for pool, variable, configured, configure, size in pools:
        if os.environ.get(variable, "").strip() or configured():
            continue
        try:
            configure(size)
        except RuntimeError:  # TensorFlow has run an op: its pools exist
            too_late.append((pool, variable, size))
    if too_late and warn:
        warnings.warn(
            f"kerasdist: {sharing} ranks share {cpus} CPUs on this host, but TensorFlow created its "
            f"{' and '.join(pool for pool, _, _ in too_late)} thread pool{'s' if len(too_late) > 1 else ''} "
            f"with {cpus} threads per rank before kerasdist.init(), so the ranks compete for the cores. "
            f"Call kerasdist.init() before any TensorFlow work, or set "
            f"{' '.join(f'{variable}={size}' for _, variable, size in too_late)} for every rank "
            f"(KERASDIST_TF_THREADS=off silences this).",
            stacklevel=3,
        )


def _abort_job_on_uncaught_exception(MPI):
    """Without this, a rank that dies of an exception blocks in MPI_Finalize and the rest
    of the job waits for it forever."""
    previous = sys.excepthook

    def abort(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        where = f"rank {MPI.COMM_WORLD.Get_rank()} (host {MPI.Get_processor_name()})"
        _abort_job(f"uncaught exception on {where}; aborting the job", 1)

    sys.excepthook = abort


def _abort_job(message, status):
    MPI = _import_mpi()
    sys.stderr.write(f"kerasdist: {message}\n")
    sys.stderr.flush()
    # The launcher forwards output asynchronously and an abort tears its pipes down: give it a
    # moment, or the message that explains the failure can be lost.
    time.sleep(0.5)
    MPI.COMM_WORLD.Abort(status)


# What this rank's program passed to sys.exit() or os._exit(), as an exit status; None until it
# calls one, and which of the two it called.
_requested_exit_status = None
_exit_call = "sys.exit"


def _remember_exit_status():
    """Records sys.exit's status, which atexit handlers cannot otherwise see.

    A rank leaving with status n while others still run would make their pending collectives
    fail, and they would abort the job with status 1: the status the program chose would be
    lost. Knowing it, `shutdown()` ends the job with it instead.
    """
    exit_for_real = sys.exit

    def exit(status=None):
        global _requested_exit_status
        _requested_exit_status = _as_exit_status(status)
        exit_for_real(status)

    exit.__doc__ = exit_for_real.__doc__
    sys.exit = exit


_OS_EXIT_BACKSTOP_S = 10


def _exit_through_shutdown(MPI):
    """Makes `os._exit` in this process leave the job the way a normal exit does.

    `os._exit` skips atexit, so neither `shutdown()` nor MPI_Finalize ran: hydra then took the
    rank for one that ended early, killed the ranks still training without a word and ended the
    job with the status the rank gave, 0 included. Shutting down first makes a rank that leaves
    mid-job fail the collectives the others wait in (they end the job non-zero, as after a
    `sys.exit(0)` mid-job), and keeps the status of a non-zero `os._exit(n)`. Forked children
    (multiprocessing workers leave through `os._exit`) have no engine and exit as before.
    """
    exit_now = os._exit
    initializing_pid = os.getpid()

    def _exit(status):
        global _requested_exit_status, _exit_call
        if _state is not None and os.getpid() == initializing_pid:
            sys.stderr.write(
                f"kerasdist: rank {_state.rank} left with os._exit({status}); shutting kerasdist down first, "
                "so that ranks still in collectives with it fail instead of being killed silently\n"
            )
            sys.stderr.flush()
            _requested_exit_status, _exit_call = _as_exit_status(status), "os._exit"
            # os._exit must end the process even if the shutdown waits (a peer frozen, or this
            # thread called it while another holds the runtime's lock, as pytest-timeout does).
            backstop = threading.Timer(_OS_EXIT_BACKSTOP_S, exit_now, args=(_as_exit_status(status) or 1,))
            backstop.daemon = True
            backstop.start()
            shutdown()
            if not MPI.Is_finalized():
                MPI.Finalize()
        exit_now(status)

    _exit.__doc__ = exit_now.__doc__
    os._exit = _exit


def _as_exit_status(status):
    """The process exit status Python gives `sys.exit(status)`."""
    if status is None:
        return 0
    if isinstance(status, int) and not isinstance(status, bool):
        return status & 0xFF
    return 1  # a message: Python prints it and exits 1


def shutdown():
    """Stops the engine; pending collectives fail. Runs at exit on its own.

    Every rank should shut down: the engine agrees on it with the other ranks, and a rank
    still waiting for a collective then gets an error instead of hanging.
    """
    global _state, _shut_down
    with _lock:
        if _state is None:
            return
        if _state.size > 1 and _requested_exit_status:
            # Other ranks may still be in collectives with this one; ending the job now keeps the
            # status the program chose (they would otherwise fail and abort with status 1).
            _abort_job(
                f"rank {_state.rank} called {_exit_call} with status {_requested_exit_status}; "
                f"ending the job with that status",
                _requested_exit_status,
            )
        _state.engine.kerasdist_shutdown()
        stalled = _state.engine.kerasdist_stalled()
        rank, size = _state.rank, _state.size
        _state = None
        _shut_down = True
    if stalled and size > 1:
        # A collective timed out: the ranks no longer agree on what ran, even where the program
        # caught the error, so the job must not look successful; and a rank the engine gave up on
        # may still block the others, which only an abort ends.
        _abort_job(f"a collective timed out on rank {rank} (see the error above); ending the job with status 1", 1)


def is_initialized():
    """True between ``init()`` and ``shutdown()``."""
    return _state is not None


def state():
    """The live state, starting kerasdist if needed (used by the collectives)."""
    if _state is None:
        init()
    return _state


def _started():
    if _state is None:
        raise ValueError("kerasdist has not been initialized; call kerasdist.init() first")
    return _state


def rank():
    """This process's rank in the job, 0 .. size()-1."""
    return _started().rank


def size():
    """The number of processes in the job."""
    return _started().size


def planned_size():
    """The number of ranks the job was planned with: `size()`, unless the job runs on fewer.

    `kerasdist-run --min-np` restarts a job on the hosts that remain after some are lost, with
    a number of ranks that divides the planned one, and sets `KERASDIST_PLANNED_SIZE` on every
    rank. `DistributedOptimizer` then accumulates `planned_size() // size()` times more
    micro-batches per update, so the global batch stays per-rank batch × `planned_size()` × k.
    Scale a learning rate by `planned_size()` rather than `size()`, and it stays what it was;
    kerasdist's learning-rate callbacks and batch growth do.

    Example:

    ```python
    import kerasdist
    kerasdist.init()
    print(kerasdist.planned_size() % kerasdist.size())  # 0
    ```
    """
    return _started().planned_size


def local_rank():
    """This process's rank among the processes on its host."""
    return _started().local_rank


def local_size():
    """The number of processes on this host."""
    return _started().local_size


def cross_rank():
    """The index of this host among hosts (ranks with the same local_rank, in rank order)."""
    return _started().cross_rank


def cross_size():
    """The number of hosts that have a process with this local_rank."""
    return _started().cross_size


def engine_times():
    """Where this rank's engine thread has spent its time since `init()`: a dict of running totals.

    Keys, in order: seconds in each phase of the engine thread, which together make up its wall
    time — ``idle`` (nothing pending: waiting for this process's next collective),
    ``negotiation`` (agreeing with the other ranks what is ready, waiting there for slower ranks
    included), ``slow_path`` (first calls and changed requests, settled through rank 0),
    ``copy_in`` (packing fused tensors), ``transfer`` (the MPI or NCCL calls that move the data),
    ``outputs`` (allocating and scaling results), ``hand_back`` (TensorFlow's completion
    callbacks), ``other`` (bookkeeping); then ``pickup`` (seconds collectives waited, summed,
    between TensorFlow handing them over and a cycle taking them up), ``cycles`` and
    ``collectives`` (counts). Take the difference of two calls around the code you measure:
    a rank that is mostly ``idle`` waits on its own computation, a large ``negotiation`` share is
    waiting for other ranks (or many small cycles), a large ``transfer`` share is the network.

    Example:

    ```python
    import tensorflow as tf
    import kerasdist
    kerasdist.init()
    before = kerasdist.engine_times()
    kerasdist.allreduce(tf.ones([1024]), name="engine_times_example")
    after = kerasdist.engine_times()
    print(int(after["collectives"] - before["collectives"]))  # 1
    print(after["transfer"] > before["transfer"])  # True
    ```
    """
    engine = _started().engine
    capacity = 16
    names = (ctypes.c_char_p * capacity)()
    values = (ctypes.c_double * capacity)()
    count = engine.kerasdist_engine_times(names, values, capacity)
    return {names[i].decode(): values[i] for i in range(min(count, capacity))}


def mpi_built():
    """True: the op library always runs collectives over MPI."""
    return True


def _build_info():
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
    return bool(_build_info().get("nccl", False))


def pin_gpu():
    """Makes this process see one GPU, the one of its local rank, with memory growth on.

    Call it first, before TensorFlow uses a GPU: each process then trains on its own GPU and
    kerasdist's collectives of GPU tensors run over NCCL (with an NCCL build). Returns the
    GPU (a ``tf.config.PhysicalDevice``), or None on a machine without GPUs, where it changes
    nothing. Raises RuntimeError when a host runs more processes than it has GPUs.

    Example:

    ```python
    import kerasdist
    gpu = kerasdist.pin_gpu()  # None without GPUs
    print(gpu is None or gpu.device_type == "GPU")  # True
    ```
    """
    import tensorflow as tf

    init()  # local_rank comes from MPI
    return _pin_gpu(tf.config, local_rank(), local_size())


def _pin_gpu(config, local_rank, local_size):
    """pin_gpu on a ``tf.config``-like object, so the choice is testable without GPUs."""
    gpus = config.list_physical_devices("GPU")
    if not gpus:
        return None
    if local_rank >= len(gpus):
        raise RuntimeError(
            f"kerasdist: local rank {local_rank} has no GPU of its own: this host has {len(gpus)} GPU(s) "
            f"for {local_size} processes; start at most {len(gpus)} processes per host"
        )
    gpu = gpus[local_rank]
    config.set_visible_devices([gpu], "GPU")
    # Without it TensorFlow takes nearly all of the GPU's memory, leaving NCCL's buffers none.
    config.experimental.set_memory_growth(gpu, True)
    return gpu
