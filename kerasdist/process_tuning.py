"""What ``init()`` tunes in the process: glibc's malloc thresholds, TensorFlow's thread pools
when ranks share a host's CPUs, and the pools' spinning when a rank has one CPU.
"""

import ctypes
import os
import warnings

# glibc's mallopt() parameters (malloc.h) and the values init() gives them.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # the ceiling of glibc's own sliding threshold
TRIM_THRESHOLD_BYTES = 64 * 2**20
_MALLOC_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def keep_freed_memory():
    """Has glibc's malloc keep up to 64 MiB of freed memory per arena for reuse.

    By default glibc hands the free top of a thread's heap back to the system once it exceeds a
    threshold that slides with the program's history, and serves blocks over another sliding
    threshold with a fresh mmap. A training step frees and reallocates the same buffers every
    step, and when the collectives' timing tips an arena over its threshold, each step pays for
    zeroing and faulting those pages in again: in the small CNN at 2 ranks on one host, many
    times the system time plain Keras paid (docs/performance.md, "Memory between steps"). Fixed
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


def cpu_share(local):
    """(CPUs this process may run on, ranks on this host that may run on some of them)."""
    mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    return len(mine), sum(1 for theirs in local.allgather(mine) if theirs & mine)


def fit_tf_thread_pools(tf, cpus, sharing, warn):
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


def stop_tf_spinning_on_one_cpu(cpus, sharing):
    """Stops TensorFlow's idle pool threads from spinning when this rank has one CPU or less.

    An idle pool thread spins a while before it sleeps, which pays when it has a CPU to itself.
    A rank with one CPU (bound to a core, or its share of the cores that ranks share) has none to
    spare: the spin holds the CPU that the engine thread and MPI need to finish the collective
    the pool is waiting for. On a 2-vCPU machine, chained 4 KiB allreduces took 27-28 us per op
    without the spin against 64-72 with it (one rank on one CPU), 22 against 30-31 (two ranks
    bound to a core each), and the MLP of benchmarks/keras_scaling.py trained 6-18 % faster at
    2 ranks, bound or not (four alternating pairs). Too late once TensorFlow has run an op.
    """
    if cpus // sharing <= 1:
        from kerasdist import _compat  # imports Keras: only now, not with kerasdist

        _compat.stop_thread_spinning()
