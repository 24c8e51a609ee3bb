"""Process-level state: MPI start-up, ranks, the engine's life cycle.

``init()`` starts MPI through mpi4py (thread level MULTIPLE), loads the op library and
starts the engine thread. A plain ``python train.py`` is an MPI singleton: a world of size 1
in which every collective is the identity. Beside it: ``op_library`` (finding and loading the
library), ``process_tuning`` (malloc, thread pools), ``exit_policy`` (how a rank leaves a job)
and ``devices`` (``pin_gpu``).
"""

import atexit
import ctypes
import dataclasses
import os
import sys
import threading
import warnings

from kerasdist import exit_policy, notice, op_library, process_tuning
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
    # The thread whose init() started kerasdist: its unnamed eager collectives are numbered alike
    # on every rank (every rank runs the same program, so the same thread starts it everywhere).
    # None when a tf.py_function body started it, on one of TensorFlow's threads: the next body
    # may run on another.
    thread: threading.Thread | None


_state = None
_shut_down = False
_lock = threading.RLock()


def _import_mpi():
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.thread_level = "multiple"  # the engine thread calls MPI beside Python's
    from mpi4py import MPI

    return MPI


def init():
    """Starts kerasdist in this process; later calls do nothing.

    Collectives call it implicitly. Under a launcher every rank must call it (directly or
    through its first collective). The thread that calls it owns the unnamed eager collectives:
    other threads must name theirs (see the guide's "Threads"). A process that a launcher started
    as one of several ranks but that MPI sees alone (srun without `--mpi=pmi2`, another MPI's
    mpirun) is refused: it would train a model of its own as rank 0.

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
            process_tuning.keep_freed_memory()
        MPI = _import_mpi()
        import tensorflow as tf

        from kerasdist import _compat

        world = MPI.COMM_WORLD
        rank, size = world.Get_rank(), world.Get_size()
        _refuse_a_keras_backend_other_than_tensorflow(rank)
        unseen_launch = launch_mpi_did_not_see(os.environ, size)
        if unseen_launch:
            raise RuntimeError(unseen_launch)
        planned_size = planned_size_from_environment(os.environ, size)  # every rank sees the same
        unknown_variables = unknown_variables_message(os.environ)
        if unknown_variables and rank == 0:  # the same variables reach every rank: say it once
            warnings.warn(unknown_variables, stacklevel=2)
        local = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        cross = world.Split(color=local.Get_rank(), key=rank)
        cpus, sharing = process_tuning.cpu_share(local)  # a collective: every rank joins, whatever its knob says
        if knobs.tf_threads == "auto":
            if sharing > 1:
                process_tuning.fit_tf_thread_pools(tf, cpus, sharing, warn=local.Get_rank() == 0)
            process_tuning.stop_tf_spinning_on_one_cpu(cpus, sharing)
        # Agreed over the host so every rank makes the same gradient buckets; listing physical
        # devices leaves TensorFlow's runtime unstarted (users set GPU memory growth after init).
        gpu_on_host = any(local.allgather(bool(tf.config.list_physical_devices("GPU"))))
        path = op_library.library_path()
        ops = op_library.load(tf, path)
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
            thread=None if _compat.in_py_function() else threading.current_thread(),
        )
        local.Free()
        cross.Free()
        # Registered after mpi4py's import, so it runs before MPI_Finalize.
        atexit.register(shutdown)
        if size > 1:
            exit_policy.install(MPI, shutdown, running_rank=lambda: None if _state is None else _state.rank)
        notice.install(knobs.notice_signal, rank)  # after MPI's own handler, which swallowed it


# Set by a launcher for each process it starts: (size variable, rank variable, the launcher, the fix).
_LAUNCHERS = (
    (
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "Open MPI's mpirun",
        "launch with the mpiexec of the MPI kerasdist was built with",
    ),
    ("PMI_SIZE", "PMI_RANK", "a PMI launcher (hydra's mpiexec, or srun --mpi=pmi2)", "launch with its own mpiexec"),
    (
        "SLURM_STEP_NUM_TASKS",
        "SLURM_PROCID",
        "srun",
        "give srun the process-management interface kerasdist's MPI speaks (--mpi=pmi2 for MPICH, "
        "--mpi=pmix for Open MPI), or start the job with kerasdist-run inside the allocation",
    ),
)


def launch_mpi_did_not_see(environ, size):
    """Why this process, alone in its MPI world, was started as one of several ranks, or None.

    A launcher whose processes MPI cannot reach (srun without --mpi=pmi2, another MPI's mpirun)
    leaves each process a world of its own: every one would be rank 0 of 1 and train its own
    model, writing rank 0's checkpoints at once, without an error.
    """
    if size != 1:
        return None
    for size_variable, rank_variable, launcher, fix in _LAUNCHERS:
        text = environ.get(size_variable, "")
        started = int(text) if text.isdigit() else 1
        if started > 1:
            return (
                f"kerasdist: this process was started by {launcher} as rank {environ.get(rank_variable, '?')} "
                f"of {started} ({size_variable}={text}), but MPI sees a world of 1 process: the ranks cannot "
                "reach each other, and each would train a model of its own as rank 0. To fix it, "
                f"{fix}; `kerasdist-run --check-build` names the MPI and the mpiexec kerasdist was built with."
            )
    return None


def _refuse_a_keras_backend_other_than_tensorflow(rank):
    """Raises on every rank whose Keras runs on another backend (KERAS_BACKEND=jax): kerasdist's
    collectives, optimizers and callbacks are TensorFlow ops, which would fail only at the first
    training step. ``import tensorflow`` has imported Keras already."""
    import keras

    backend = keras.config.backend()
    if backend != "tensorflow":
        chosen_by = (
            f"KERAS_BACKEND={os.environ['KERAS_BACKEND']}"
            if os.environ.get("KERAS_BACKEND")
            else "from keras.json in ~/.keras or KERAS_HOME"
        )
        raise RuntimeError(
            f"Keras runs on its {backend!r} backend on rank {rank} ({chosen_by}), but kerasdist's collectives, "
            "DistributedOptimizer and callbacks are TensorFlow ops: set KERAS_BACKEND=tensorflow in the "
            "environment of every rank"
        )


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


def shutdown():
    """Stops the engine; pending collectives fail. Runs at exit on its own.

    Every rank should shut down: the engine agrees on it with the other ranks, and a rank
    still waiting for a collective then gets an error instead of hanging. Once shut down,
    kerasdist cannot start again in that process.

    Example:

    ```python
    import kerasdist

    kerasdist.init()
    print(int(kerasdist.allreduce(1.0, op=kerasdist.Sum)) == kerasdist.size())  # True
    kerasdist.shutdown()  # on every rank, after its last collective
    print(kerasdist.is_initialized())  # False
    kerasdist.shutdown()  # again, as at exit: nothing left to stop
    try:
        kerasdist.init()
    except RuntimeError as error:
        print(error)  # kerasdist was shut down in this process and cannot be started again
    ```
    """
    global _state, _shut_down
    with _lock:
        if _state is None:
            return
        if _state.size > 1 and exit_policy.requested_status:
            # Other ranks may still be in collectives with this one; ending the job now keeps the
            # status the program chose (they would otherwise fail and abort with status 1).
            exit_policy.abort_job(
                _import_mpi(),
                f"rank {_state.rank} called {exit_policy.requested_by} with status {exit_policy.requested_status}; "
                f"ending the job with that status",
                exit_policy.requested_status,
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
        message = f"a collective timed out on rank {rank} (see the error above); ending the job with status 1"
        exit_policy.abort_job(_import_mpi(), message, 1)


def is_initialized():
    """True between ``init()`` and ``shutdown()``.

    Example:

    ```python
    import kerasdist

    kerasdist.init()
    print(kerasdist.is_initialized())  # True
    ```
    """
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
    """This process's rank in the job, 0 .. size()-1.

    Example:

    ```python
    import kerasdist

    kerasdist.init()
    print(0 <= kerasdist.rank() < kerasdist.size())  # True
    print(kerasdist.allgather_object(kerasdist.rank()) == list(range(kerasdist.size())))  # True
    ```
    """
    return _started().rank


def size():
    """The number of processes in the job.

    Example:

    ```python
    import tensorflow as tf
    import kerasdist

    kerasdist.init()
    total = kerasdist.allreduce(tf.constant(1.0), op=kerasdist.Sum)
    print(float(total) == kerasdist.size())  # True
    ```
    """
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
    """This process's rank among the processes on its host: which GPU, or which share of the
    host's CPUs, is this rank's.

    Example:

    ```python
    import kerasdist

    kerasdist.init()
    print(0 <= kerasdist.local_rank() < kerasdist.local_size())  # True
    ```
    """
    return _started().local_rank


def local_size():
    """The number of processes on this host.

    Example:

    ```python
    import kerasdist

    kerasdist.init()
    print(1 <= kerasdist.local_size() <= kerasdist.size())  # True
    ```
    """
    return _started().local_size


def cross_rank():
    """The index of this host among hosts (ranks with the same local_rank, in rank order).

    Example:

    ```python
    import kerasdist

    kerasdist.init()
    print(0 <= kerasdist.cross_rank() < kerasdist.cross_size())  # True
    ```
    """
    return _started().cross_rank


def cross_size():
    """The number of hosts that have a process with this local_rank.

    Example:

    ```python
    import kerasdist

    kerasdist.init()
    print(kerasdist.cross_size() * kerasdist.local_size() >= kerasdist.size())  # True
    ```
    """
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
    between TensorFlow handing them over and a cycle taking them up), ``cycles``,
    ``collectives``, ``rode`` and ``hierarchical`` (counts; ``rode``: small allreduces whose sums
    travelled with the negotiation that agreed on them, ``KERASDIST_PIGGYBACK_BYTES``, their time
    counted as ``negotiation``; ``hierarchical``: allreduce pieces and allgathers that ran as the
    hierarchy across hosts, ``KERASDIST_ALLREDUCE_ALGORITHM``). Take the difference of two calls
    around the code you measure: a rank that is mostly ``idle`` waits on its own computation, a
    large ``negotiation`` share is waiting for other ranks (or many small cycles), a large
    ``transfer`` share is the network.

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
