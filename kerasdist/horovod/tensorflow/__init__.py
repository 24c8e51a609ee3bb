"""`horovod.tensorflow` (Horovod 0.28) on kerasdist: `import kerasdist.horovod.tensorflow as hvd`.

Example:

```python
import tensorflow as tf
import kerasdist.horovod.tensorflow as hvd

hvd.init()
total = hvd.allreduce(tf.constant(1.0), op=hvd.Sum)
print(float(total) == hvd.size())  # True
rows, received = hvd.alltoall(tf.fill([hvd.size()], hvd.rank()))
print(received.numpy().tolist() == [1] * hvd.size())  # True
```
"""

import os
import sys
import warnings

# `keras` would be shadowed: importing the submodule kerasdist.horovod.tensorflow.keras binds that name here.
import keras as _keras
import tensorflow as tf

import kerasdist
from kerasdist import knobs, op_library, ops, runtime
from kerasdist.distributed_optimizer import DistributedGradientTape as _KerasdistGradientTape
from kerasdist.distributed_optimizer import DistributedOptimizer as _KerasdistOptimizer
from kerasdist.reductions import reduce_gradients

Average, Sum, Min, Max, Product = ops.Average, ops.Sum, ops.Min, ops.Max, ops.Product


class _NotOffered:
    """A Horovod name kerasdist does not implement: any use raises, naming what to use instead."""

    def __init__(self, name, instead, members=None):
        self._name, self._instead, self._members = name, instead, members or {}

    def error(self, member=None):
        if member in self._members:
            return NotImplementedError(
                f"kerasdist does not offer Horovod's {self._name} ({member}); {self._members[member]}"
            )
        return NotImplementedError(f"kerasdist does not offer Horovod's {self._name}; {self._instead}")

    def __call__(self, *args, **kwargs):
        raise self.error()

    def __getattr__(self, attribute):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        raise self.error(attribute)

    def __repr__(self):
        return f"<Horovod's {self._name}: not offered by kerasdist>"


Adasum = _NotOffered(
    "Adasum reduction",
    "use op=hvd.Average; for large global batches, kerasdist.optimizers.LARS or LAMB adapt the step per layer",
)
_NOT_OFFERED = {
    "elastic": _NotOffered(
        "elastic training",
        "kerasdist-run --restarts N --min-np M restarts a failed job, or one a host left on notice "
        "(KERASDIST_NOTICE_SIGNAL), on the hosts left, and at the larger size when hosts come back "
        "(--discovery-interval), from its Rank0Checkpoint(resume=True)",
        members={
            "run": "call the training function directly (no decorator) and start the script with "
            "kerasdist-run -np N --restarts R --min-np M --host-discovery-script S: the launcher starts the "
            "whole script again on the hosts there are, where Horovod retried the function in the process",
            **dict.fromkeys(
                ("KerasState", "TensorFlowKerasState", "TensorFlowState", "ObjectState", "State"),
                "pass kerasdist.callbacks.Rank0Checkpoint(directory, resume=True) to fit: it saves at each "
                "epoch's end and at the step a notice stops (state.commit()), and a restarted script resumes "
                "from it (state.restore())",
            ),
            **dict.fromkeys(
                ("CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback"),
                "kerasdist.callbacks.Rank0Checkpoint(directory, resume=True) with kerasdist.callbacks() "
                "keeps the epoch and batch a restart resumes from",
            ),
        },
    ),
    "ProcessSet": _NotOffered("process sets", "kerasdist's collectives always span all ranks of the job"),
    "add_process_set": _NotOffered("process sets", "kerasdist's collectives always span all ranks of the job"),
    "remove_process_set": _NotOffered("process sets", "kerasdist's collectives always span all ranks of the job"),
    "start_timeline": _NotOffered("start_timeline", "set KERASDIST_TIMELINE=path (or HOROVOD_TIMELINE) before init()"),
    "stop_timeline": _NotOffered("stop_timeline", "the KERASDIST_TIMELINE file is closed at shutdown"),
    "broadcast_global_variables": _NotOffered(
        "broadcast_global_variables (TensorFlow 1 graphs)",
        "use hvd.broadcast_variables(model.variables, root_rank=0), as Horovod itself asks under TF2",
    ),
}


def __getattr__(name):
    if name == "SyncBatchNormalization":  # a Keras layer: loaded on use, as kerasdist's names are
        return kerasdist.SyncBatchNormalization
    if name in _NOT_OFFERED:
        return _NOT_OFFERED[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _GlobalProcessSet:
    """Horovod's `global_process_set`: all ranks, the only set kerasdist has."""

    process_set_id = 0

    def size(self):
        return runtime.size()

    def rank(self):
        return runtime.rank()

    def included(self):
        return True

    @property
    def ranks(self):
        return list(range(runtime.size()))

    def __repr__(self):
        return "global_process_set"


global_process_set = _GlobalProcessSet()


def _check_process_set(process_set):
    if process_set is not global_process_set:
        raise _NOT_OFFERED["ProcessSet"].error()


class Compression:
    """Horovod's gradient compression: `none`, or `fp16` (floats travel as float16).

    Example:

    ```python
    import tensorflow as tf
    import kerasdist.horovod.tensorflow as hvd

    hvd.init()
    averaged = hvd.allreduce(tf.constant([1.0, 2.5]), compression=hvd.Compression.fp16)
    print(averaged.dtype.name, averaged.numpy().tolist())  # float32 [1.0, 2.5]
    ```
    """

    none = ops.Compression.none
    fp16 = ops.Compression.fp16


# HOROVOD_* variable -> (KERASDIST_* variable, the Horovod text as kerasdist's)
_HOROVOD_LOG_LEVELS = {"trace": "debug", "debug": "debug", "info": "info", "warning": "warning"}
_HOROVOD_SETTINGS = {
    "HOROVOD_FUSION_THRESHOLD": ("KERASDIST_FUSION_THRESHOLD", str),  # bytes in both
    "HOROVOD_CYCLE_TIME": ("KERASDIST_CYCLE_TIME_MS", str),  # milliseconds in both
    "HOROVOD_CACHE_CAPACITY": ("KERASDIST_CACHE_CAPACITY", lambda text: "1" if text == "0" else text),
    "HOROVOD_TIMELINE": ("KERASDIST_TIMELINE", str),
    "HOROVOD_STALL_CHECK_TIME_SECONDS": ("KERASDIST_STALL_WARNING_S", str),
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": ("KERASDIST_STALL_TIMEOUT_S", str),  # 0: never, in both
    "HOROVOD_LOG_LEVEL": ("KERASDIST_LOG_LEVEL", lambda text: _HOROVOD_LOG_LEVELS.get(text.lower(), "error")),
    "HOROVOD_AUTOTUNE": ("KERASDIST_AUTOTUNE", lambda text: "off" if _horovod_false(text) else "auto"),
    # Horovod's 0 is its default, a flat allreduce; kerasdist's default chooses per layout.
    "HOROVOD_HIERARCHICAL_ALLREDUCE": (
        "KERASDIST_ALLREDUCE_ALGORITHM",
        lambda text: "auto" if _horovod_false(text) else "hierarchical",
    ),
}


def _horovod_false(text):
    return text.lower() in ("0", "false", "no", "off")


def _adopt_horovod_settings(environ):
    """Copies each set HOROVOD_* knob into its unset KERASDIST_* twin, checked by kerasdist's rule.

    Horovod's cache capacity 0 (no response cache) becomes 1: kerasdist's cache cannot be turned
    off, and one slot is the nearest. HOROVOD_STALL_CHECK_DISABLE=1 turns stall warnings off.
    """
    declared = {knob.variable: knob for knob in knobs.KNOBS}
    for horovod_variable, (variable, convert) in _HOROVOD_SETTINGS.items():
        text = environ.get(horovod_variable, "").strip()
        if not text or environ.get(variable, "").strip():
            continue
        converted = convert(text)
        try:
            declared[variable].parse(converted)
        except ValueError as error:
            raise ValueError(f"{horovod_variable}={text!r} (read as {variable}) {error}") from None
        environ[variable] = converted
    if (
        environ.get("HOROVOD_STALL_CHECK_DISABLE", "").strip() not in ("", "0")
        and not environ.get("KERASDIST_STALL_WARNING_S", "").strip()
    ):
        environ["KERASDIST_STALL_WARNING_S"] = "0"


def init(comm=None, process_sets=None):
    """Starts kerasdist (see `kerasdist.init`), reading HOROVOD_* settings first.

    Horovod's `comm` (an mpi4py communicator or a list of ranks) and `process_sets` select
    subsets of ranks, which kerasdist does not offer: give neither.

    Example:

    ```python
    import kerasdist.horovod.tensorflow as hvd

    hvd.init()
    print(hvd.is_initialized(), 0 <= hvd.rank() < hvd.size())  # True True
    ```
    """
    if comm is not None or process_sets is not None:
        raise _NOT_OFFERED["ProcessSet"].error()
    _adopt_horovod_settings(os.environ)
    runtime.init()


shutdown = runtime.shutdown
is_initialized = runtime.is_initialized
size, rank = runtime.size, runtime.rank
local_size, local_rank = runtime.local_size, runtime.local_rank
cross_size, cross_rank = runtime.cross_size, runtime.cross_rank
mpi_built, nccl_built = op_library.mpi_built, op_library.nccl_built


def mpi_enabled():
    return True


def mpi_threads_supported():
    return True  # the engine's thread makes every MPI call; ranks may run TensorFlow threads freely


def _false():
    return False


gloo_enabled = gloo_built = ddl_built = ccl_built = cuda_built = rocm_built = _false


def _op(op, average):
    """Horovod's rule: `op` wins; the deprecated `average` maps to Average or Sum; default Average."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        _warn_at_callers_line("average= is deprecated in Horovod; use op=hvd.Average or op=hvd.Sum", DeprecationWarning)
        return Average if average else Sum
    if op is Adasum:
        raise Adasum.error()
    return Average if op is None else op


def _warn_at_callers_line(message, category):
    """A warning attributed to the first line outside this package: the script's call."""
    level, frame = 2, sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith(__package__):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def _reduce_with(compression):
    """(kerasdist compression, compress, decompress): a custom Horovod compressor (a class with
    `compress(tensor) -> (tensor, context)` and `decompress(tensor, context)`) runs around an
    uncompressed reduction, as in Horovod."""
    if compression is Compression.none or compression is Compression.fp16:
        return compression, None
    return Compression.none, _compressor(compression)


def _compressor(compression):
    """`compression` if it can compress and decompress (fp16 and custom compressors can)."""
    if hasattr(compression, "compress") and hasattr(compression, "decompress"):
        return compression
    raise ValueError(
        f"compression={compression!r}: expected hvd.Compression.none, hvd.Compression.fp16 or a compressor"
    )


def _reduce_compressed(reduce, tensor, compressor, *arguments):
    """`reduce(tensor, *arguments)` with `tensor` compressed before and the result decompressed
    after: Horovod's way with a compressor the reduction does not apply itself."""
    compressed, context = compressor.compress(tensor)
    return compressor.decompress(reduce(compressed, *arguments), context)


def _allreduce_arguments(tensors, op, average, prescale_factor, postscale_factor, compression, process_set):
    """Checks Horovod's allreduce arguments for `tensors`; returns `(op, wire, compressor)` (see
    `_reduce_with`). `tf.IndexedSlices` are gathered, not reduced: Sum or Average only, unscaled."""
    _check_process_set(process_set)
    op = _op(op, average)
    if any(isinstance(tensor, tf.IndexedSlices) for tensor in tensors):
        if op not in (Sum, Average):
            raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
    return (op, *_reduce_with(compression))


def allreduce(
    tensor,
    average=None,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    name=None,
    process_set=global_process_set,
    ignore_name_scope=False,
):
    """Horovod's `allreduce`: Average by default; `tf.IndexedSlices` are gathered (Sum/Average only,
    no pre/postscale). Devices are ignored: kerasdist reduces on the CPU.

    Example:

    ```python
    import tensorflow as tf
    import kerasdist.horovod.tensorflow as hvd

    hvd.init()
    mean = hvd.allreduce(tf.constant(float(hvd.rank())))
    print(float(mean) == (hvd.size() - 1) / 2)  # True
    print(float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum)) == hvd.size())  # True
    ```
    """
    op, wire, compressor = _allreduce_arguments(
        [tensor], op, average, prescale_factor, postscale_factor, compression, process_set
    )
    if compressor is None:
        return ops.allreduce(tensor, op, name, prescale_factor, postscale_factor, wire)
    return _reduce_compressed(ops.allreduce, tensor, compressor, op, name, prescale_factor, postscale_factor)


def grouped_allreduce(
    tensors,
    average=None,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
    ignore_name_scope=False,
    name=None,
):
    """Horovod's `grouped_allreduce`: the tensors are reduced as one unit (Average by default).

    Example:

    ```python
    import tensorflow as tf
    import kerasdist.horovod.tensorflow as hvd

    hvd.init()
    ones, twos = hvd.grouped_allreduce([tf.ones([2]), tf.fill([3], 2.0)])
    print(ones.numpy().tolist(), twos.numpy().tolist())  # [1.0, 1.0] [2.0, 2.0, 2.0]
    ```
    """
    tensors = list(tensors)
    op, wire, compressor = _allreduce_arguments(
        tensors, op, average, prescale_factor, postscale_factor, compression, process_set
    )
    if any(isinstance(t, tf.IndexedSlices) for t in tensors) or compressor is not None:
        # kerasdist's grouped allreduce takes dense tensors and its own wire formats only
        return [
            allreduce(t, None, "", "", compression, op, prescale_factor, postscale_factor, name and f"{name}.{i}")
            for i, t in enumerate(tensors)
        ]
    return ops.grouped_allreduce(tensors, op, name, prescale_factor, postscale_factor, wire)


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Horovod's `allgather`: every rank's `tensor`, concatenated along dim 0 in rank order (see
    `kerasdist.allgather`).

    Example:

    ```python
    import tensorflow as tf
    import kerasdist.horovod.tensorflow as hvd

    hvd.init()
    gathered = hvd.allgather(tf.fill([1], hvd.rank()))
    print(gathered.numpy().tolist() == list(range(hvd.size())))  # True
    ```
    """
    _check_process_set(process_set)
    return ops.allgather(tensor, name)


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Horovod's `grouped_allgather`: `allgather` of each tensor of a list, as one unit.

    Example:

    ```python
    import tensorflow as tf
    import kerasdist.horovod.tensorflow as hvd

    hvd.init()
    ranks, ones = hvd.grouped_allgather([tf.fill([1], hvd.rank()), tf.ones([2, 3])])
    print(ranks.numpy().tolist() == list(range(hvd.size())), ones.shape == (2 * hvd.size(), 3))  # True True
    ```
    """
    _check_process_set(process_set)
    return ops.grouped_allgather(tensors, name)


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Horovod's `broadcast`: every rank receives `root_rank`'s `tensor`.

    Example:

    ```python
    import tensorflow as tf
    import kerasdist.horovod.tensorflow as hvd

    hvd.init()
    print(int(hvd.broadcast(tf.constant(hvd.rank()), root_rank=0)))  # 0
    ```
    """
    _check_process_set(process_set)
    return ops.broadcast(tensor, root_rank, name)


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Assigns `root_rank`'s values to `variables` on every rank.

    Example:

    ```python
    import tensorflow as tf
    import kerasdist.horovod.tensorflow as hvd

    hvd.init()
    weight = tf.Variable(float(hvd.rank()))
    hvd.broadcast_variables([weight], root_rank=0)
    print(float(weight.numpy()))  # 0.0
    ```
    """
    _check_process_set(process_set)
    ops.broadcast_variables(list(variables), root_rank)


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Horovod's `alltoall`: returns `(received rows, received_splits)`.

    Example:

    ```python
    import tensorflow as tf
    import kerasdist.horovod.tensorflow as hvd

    hvd.init()
    # Rank r sends one row holding r to every rank, so every rank receives 0, 1, ..., size - 1.
    rows, splits = hvd.alltoall(tf.fill([hvd.size()], hvd.rank()))
    print(rows.numpy().tolist() == list(range(hvd.size())), splits.numpy().tolist() == [1] * hvd.size())  # True True
    ```
    """
    _check_process_set(process_set)
    return ops.alltoall(tensor, splits, name, return_received_splits=True)


def reducescatter(
    tensor,
    device_dense="",
    compression=Compression.none,
    op=Average,
    name=None,
    process_set=global_process_set,
    ignore_name_scope=False,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """Horovod's `reducescatter`: rank r keeps its share of dim 0 (lower ranks take the remainder).

    Example:

    ```python
    import tensorflow as tf
    import kerasdist.horovod.tensorflow as hvd

    hvd.init()
    mine = hvd.reducescatter(tf.ones([2 * hvd.size()]), op=hvd.Sum)
    print(mine.numpy().tolist() == [float(hvd.size())] * 2)  # True
    ```
    """
    _check_process_set(process_set)
    op = _op(op, None)
    if compression is Compression.none:
        return ops.reducescatter(tensor, op, name, prescale_factor, postscale_factor)
    return _reduce_compressed(
        ops.reducescatter,
        tf.convert_to_tensor(tensor),
        _compressor(compression),
        op,
        name,
        prescale_factor,
        postscale_factor,
    )


def grouped_reducescatter(
    tensors,
    device_dense="",
    compression=Compression.none,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
    name=None,
):
    """Horovod's `grouped_reducescatter`: `reducescatter` of each tensor of a list, as one unit.

    Example:

    ```python
    import tensorflow as tf
    import kerasdist.horovod.tensorflow as hvd

    hvd.init()
    first, second = hvd.grouped_reducescatter([tf.ones([hvd.size()]), tf.ones([2 * hvd.size(), 3])])
    print(first.shape, second.shape)  # (1,) (2, 3)
    ```
    """
    _check_process_set(process_set)
    if compression is not Compression.none:
        return [
            reducescatter(
                t, "", compression, op, name and f"{name}.{i}", process_set, False, prescale_factor, postscale_factor
            )
            for i, t in enumerate(tensors)
        ]
    return ops.grouped_reducescatter(tensors, _op(op, None), name, prescale_factor, postscale_factor)


def barrier(process_set=global_process_set):
    """Horovod's `barrier`: returns once every rank has called it.

    Example:

    ```python
    import kerasdist.horovod.tensorflow as hvd

    hvd.init()
    hvd.barrier()
    print("every rank got here")  # every rank got here
    ```
    """
    _check_process_set(process_set)
    ops.barrier()


def join(device=""):
    """Horovod's `join`: see `kerasdist.join`; returns the rank that joined last.

    Example:

    ```python
    import kerasdist.horovod.tensorflow as hvd

    hvd.init()
    print(0 <= hvd.join() < hvd.size())  # True
    ```
    """
    return kerasdist.join()


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Horovod's `broadcast_object`: `root_rank`'s picklable `obj`, on every rank.

    Example:

    ```python
    import kerasdist.horovod.tensorflow as hvd

    hvd.init()
    print(hvd.broadcast_object({"from": hvd.rank()}, root_rank=0))  # {'from': 0}
    ```
    """
    _check_process_set(process_set)
    return ops.broadcast_object(obj, root_rank, name)


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function that broadcasts its argument from `root_rank` (Horovod's TF1-session helper).

    Example:

    ```python
    import kerasdist.horovod.tensorflow as hvd

    hvd.init()
    from_rank_0 = hvd.broadcast_object_fn(root_rank=0)
    print(from_rank_0(hvd.rank()))  # 0
    ```
    """
    _check_process_set(process_set)
    return lambda obj: ops.broadcast_object(obj, root_rank, name)


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Horovod's `allgather_object`: the list of every rank's picklable `obj`, in rank order.

    Example:

    ```python
    import kerasdist.horovod.tensorflow as hvd

    hvd.init()
    print(hvd.allgather_object(hvd.rank()) == list(range(hvd.size())))  # True
    ```
    """
    _check_process_set(process_set)
    return ops.allgather_object(obj, name)


def _check_gradient_arguments(op, gradient_predivide_factor, compression, num_groups, groups, process_set):
    """Horovod's checks on the gradient-reducing wrappers; returns the op to use.

    `gradient_predivide_factor` f splits the average into a 1/f scale before the sum and f/size
    after it, which keeps float16 sums in range on Horovod's wire. kerasdist sums 16-bit values
    in float32, so the split changes nothing but rounding and is not applied. `groups` and
    `num_groups` choose which gradients fuse into one allreduce; kerasdist's gradient buckets
    make that choice (KERASDIST_BUCKET_BYTES), and results do not depend on it.
    """
    _check_process_set(process_set)
    if op is Adasum:
        raise Adasum.error()
    if op not in (Average, Sum):
        raise ValueError("op currently only supports Average and Sum")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if compression is not Compression.none and compression is not Compression.fp16:
        raise ValueError("gradient reduction takes hvd.Compression.none or hvd.Compression.fp16")
    groups = num_groups if groups is None and num_groups else groups
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of tf.Variable.")
    return op


def DistributedOptimizer(
    optimizer,
    name=None,
    use_locking=False,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    sparse_as_dense=False,
    backward_passes_per_step=1,
    op=Average,
    gradient_predivide_factor=1.0,
    average_aggregated_gradients=False,
    num_groups=0,
    groups=None,
    process_set=global_process_set,
    scale_local_gradients=True,
):
    """Horovod's `DistributedOptimizer` for a Keras optimizer: a `kerasdist.DistributedOptimizer`.

    As in Horovod, `backward_passes_per_step=k` applies the SUM of the k micro-batch gradients
    unless `average_aggregated_gradients=True`. TensorFlow 1 optimizers do not exist in Keras 3.

    Example:

    ```python
    import keras
    import numpy as np
    import kerasdist.horovod.tensorflow as hvd

    hvd.init()
    keras.utils.set_random_seed(1)  # the same first weights on every rank
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size())), loss="mse")
    history = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0)
    print(type(model.optimizer).__name__, len(history.history["loss"]))  # DistributedOptimizer 1
    ```
    """
    op = _check_gradient_arguments(op, gradient_predivide_factor, compression, num_groups, groups, process_set)
    if not isinstance(optimizer, _keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer (Keras 3), got {optimizer!r}")
    distributed = _KerasdistOptimizer(
        optimizer,
        op=op,
        compression=compression,
        backward_passes_per_step=backward_passes_per_step,
        sparse_as_dense=sparse_as_dense,
        average_aggregated_gradients=average_aggregated_gradients,
        name=name,
    )
    distributed.register_local_var = _NotOffered(
        "DistributedOptimizer.register_local_var",
        "every trainable variable's gradient is reduced; to keep some layers' gradients local, train "
        "with hvd.PartialDistributedGradientTape(tape, local_layers=[...]) in a custom loop",
    )
    return distributed


class _PartialGradientTape(_KerasdistGradientTape):
    """A DistributedGradientTape that leaves the gradients of `local_variables` unreduced."""

    def __init__(self, tape, op, compression, sparse_as_dense, local_variables, scale_local_gradients):
        super().__init__(tape, op, compression, sparse_as_dense)
        self._local_variables = list(local_variables)  # kept alive, so their ids stay theirs
        self._local = {id(v) for v in self._local_variables}
        self._scale_local = scale_local_gradients

    def gradient(self, target, sources, output_gradients=None, unconnected_gradients=tf.UnconnectedGradients.NONE):
        if not self._local:
            return super().gradient(target, sources, output_gradients, unconnected_gradients)
        ops._refuse_xla("PartialDistributedGradientTape.gradient")
        grads = self._tape.gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources, flat_grads = tf.nest.flatten(sources), tf.nest.flatten(grads)
        shared = [i for i, s in enumerate(flat_sources) if id(s) not in self._local]
        reduced = reduce_gradients([flat_grads[i] for i in shared], self._op, self._compression, self._sparse_as_dense)
        result = list(flat_grads)
        for i, g in zip(shared, reduced):
            result[i] = g
        if self._scale_local:  # Horovod scales local gradients by 1/size, as if averaged
            for i, s in enumerate(flat_sources):
                if id(s) in self._local and result[i] is not None:
                    result[i] = result[i] / tf.cast(runtime.size(), result[i].dtype)
        return tf.nest.pack_sequence_as(grads, result)


def DistributedGradientTape(
    gradtape,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    sparse_as_dense=False,
    op=Average,
    gradient_predivide_factor=1.0,
    num_groups=0,
    groups=None,
    process_set=global_process_set,
    scale_local_gradients=True,
):
    """Horovod's `DistributedGradientTape`: `gradient()` returns gradients reduced across ranks.

    Example:

    ```python
    import tensorflow as tf
    import kerasdist.horovod.tensorflow as hvd

    hvd.init()
    weight = tf.Variable(1.0)
    with tf.GradientTape() as tape:
        loss = weight * float(hvd.rank())  # this rank's gradient is its rank
    tape = hvd.DistributedGradientTape(tape)
    print(float(tape.gradient(loss, [weight])[0]) == (hvd.size() - 1) / 2)  # True
    ```
    """
    op = _check_gradient_arguments(op, gradient_predivide_factor, compression, num_groups, groups, process_set)
    return _KerasdistGradientTape(gradtape, op, compression, sparse_as_dense)


def PartialDistributedGradientTape(
    gradtape,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    sparse_as_dense=False,
    op=Average,
    gradient_predivide_factor=1.0,
    num_groups=0,
    groups=None,
    process_set=global_process_set,
    local_layers=None,
    scale_local_gradients=True,
):
    """Horovod's `PartialDistributedGradientTape`: the trainable weights of `local_layers` keep
    this rank's own gradient (divided by size when `scale_local_gradients`); the rest are reduced.

    Example:

    ```python
    import keras
    import tensorflow as tf
    import kerasdist.horovod.tensorflow as hvd

    hvd.init()
    shared, local = keras.layers.Dense(1, use_bias=False), keras.layers.Dense(1, use_bias=False)
    x = tf.ones([1, 1])
    shared(x), local(x)
    with tf.GradientTape() as tape:
        loss = float(hvd.rank() + 1) * (shared(x) + local(x))  # rank r's gradients are r + 1
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local], scale_local_gradients=False)
    shared_gradient, local_gradient = tape.gradient(loss, shared.trainable_weights + local.trainable_weights)
    print(float(shared_gradient[0, 0]) == (hvd.size() + 1) / 2)  # True
    print(float(local_gradient[0, 0]) == hvd.rank() + 1)  # True
    ```
    """
    op = _check_gradient_arguments(op, gradient_predivide_factor, compression, num_groups, groups, process_set)
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, _keras.layers.Layer):
        local_layers = [local_layers]
    if not all(isinstance(layer, _keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of keras.layers.Layer type.")
    local_variables = [v for layer in local_layers for v in layer.trainable_weights]
    return _PartialGradientTape(gradtape, op, compression, sparse_as_dense, local_variables, scale_local_gradients)
