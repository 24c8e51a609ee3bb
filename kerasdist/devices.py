"""Which GPU this process uses: ``pin_gpu``."""

from kerasdist import runtime


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

    runtime.init()  # local_rank comes from MPI
    return _pin_gpu(tf.config, runtime.local_rank(), runtime.local_size())


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
