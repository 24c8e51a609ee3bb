"""kerasdist: data-parallel Keras 3 / TensorFlow training over MPI.

Names are loaded on first use: ``import kerasdist`` alone imports neither TensorFlow nor MPI,
so the launcher (``kerasdist-run``) starts in milliseconds. ``kerasdist.init()`` or any
collective brings them in. Keras still finds kerasdist's saved classes by name once this
package is imported, so ``keras.saving.load_model`` of a model compiled with
``DistributedOptimizer`` needs nothing more (see ``kerasdist._registered_names``).
"""

import importlib

from kerasdist import _registered_names

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    **{
        name: "kerasdist.runtime"
        for name in (
            "cross_rank",
            "cross_size",
            "engine_times",
            "init",
            "is_initialized",
            "local_rank",
            "local_size",
            "planned_size",
            "rank",
            "shutdown",
            "size",
        )
    },
    "mpi_built": "kerasdist.op_library",
    "nccl_built": "kerasdist.op_library",
    "pin_gpu": "kerasdist.devices",
    **{
        name: "kerasdist.ops"
        for name in (
            "Average",
            "Compression",
            "Max",
            "Min",
            "Product",
            "ReduceOp",
            "Sum",
            "allgather",
            "allgather_object",
            "allreduce",
            "alltoall",
            "barrier",
            "broadcast",
            "broadcast_object",
            "broadcast_variables",
            "grouped_allgather",
            "grouped_allreduce",
            "grouped_reducescatter",
            "join",
            "reducescatter",
        )
    },
    **{name: "kerasdist.distributed_optimizer" for name in ("DistributedOptimizer", "DistributedGradientTape")},
    # The callbacks a distributed fit needs. `kerasdist.callbacks(...)` calls it too, but that name is
    # the package of the callback classes, which a function cannot replace: importing a submodule
    # sets the parent's attribute to the module.
    "default_callbacks": "kerasdist.callbacks",
    "GradientNoiseScale": "kerasdist.gradient_statistics",
    "check_replicas": "kerasdist.replicas",
    "notice_received": "kerasdist.coordination",
    "ReplicaDivergenceError": "kerasdist.replicas",
    "SyncBatchNormalization": "kerasdist.layers",
}
_SUBMODULES = (
    "batch_growth",
    "callbacks",
    "curvature",
    "data",
    "estimator",
    "layers",
    "learning_rate",
    "models",
    "optimizers",
    "reductions",
    "run",
)

__all__ = sorted(_EXPORTS) + list(_SUBMODULES)


_registered_names.register_when_keras_is_imported()


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"kerasdist.{name}")
    else:
        raise AttributeError(f"module 'kerasdist' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
