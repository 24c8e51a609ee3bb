"""`horovod.tensorflow.keras` (Horovod 0.28) on kerasdist: `import kerasdist.horovod.tensorflow.keras as hvd`.

Example:

```python
import keras
import numpy as np
import kerasdist.horovod.tensorflow.keras as hvd

hvd.init()
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size())), loss="mse")
callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
history = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, callbacks=callbacks, verbose=0)
print(float(hvd.allreduce(np.float32(hvd.rank()), op=hvd.Sum)) == sum(range(hvd.size())))  # True
```
"""

import inspect

import keras
import tensorflow as tf

from kerasdist.horovod import tensorflow as _hvd
from kerasdist.horovod.tensorflow import (  # noqa: F401 (Horovod's Keras module re-exports these)
    Average,
    Compression,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from kerasdist.horovod.tensorflow.keras import callbacks  # noqa: F401


def __getattr__(name):
    """The rest of `horovod.tensorflow`'s API (Horovod's Keras module re-exports much of it):
    `broadcast_object`, `allgather_object`, `join`, `barrier`, `SyncBatchNormalization`, and the
    names kerasdist does not offer (`start_timeline`, `elastic`, ...), which raise when used."""
    found = None if name.startswith("_") else getattr(_hvd, name, None)
    if found is None or inspect.ismodule(found):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return found


def DistributedOptimizer(
    optimizer,
    name=None,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    sparse_as_dense=False,
    gradient_predivide_factor=1.0,
    op=Average,
    backward_passes_per_step=1,
    average_aggregated_gradients=False,
    num_groups=0,
    groups=None,
    process_set=global_process_set,
    scale_local_gradients=True,
):
    """Horovod's Keras `DistributedOptimizer` (argument order as in `horovod.tensorflow.keras`).

    Example:

    ```python
    import keras
    import numpy as np
    import kerasdist
    import kerasdist.horovod.tensorflow.keras as hvd

    hvd.init()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])  # weights differ per rank
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = np.ones((8, 3)), np.full((8, 1), float(hvd.rank()))  # each rank its own targets
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    model.fit(x, y, batch_size=4, callbacks=callbacks, verbose=0)
    kernel = model.layers[0].kernel.numpy()
    print(all((other == kernel).all() for other in kerasdist.allgather_object(kernel)))  # True
    ```
    """
    # horovod.tensorflow's DistributedOptimizer takes every one of these by name: only the order differs
    return _hvd.DistributedOptimizer(**locals())


# Horovod's Keras collectives take tensor-compatible values and return NumPy values.
def allreduce(
    value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None, compression=Compression.none
):
    return _hvd.allreduce(
        tf.constant(value), average, "", "", compression, op, prescale_factor, postscale_factor, name
    ).numpy()


def allgather(value, name=None):
    return _hvd.allgather(tf.constant(value), name).numpy()


def broadcast(value, root_rank, name=None):
    return _hvd.broadcast(tf.constant(value), root_rank, name).numpy()


def reducescatter(value, name=None, op=Average):
    return _hvd.reducescatter(tf.constant(value), op=op, name=name).numpy()


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none, legacy_opts=False):
    """Horovod's `load_model`: loads a `.keras` file and wraps its optimizer in `DistributedOptimizer`.

    The optimizer's saved state (slots, iterations) is kept; one saved as a
    `kerasdist.DistributedOptimizer` already comes back as one and is left as it is.
    `custom_optimizers` (classes) are found by their class names, as `custom_objects` are.

    Example:

    ```python
    import keras
    import kerasdist
    import kerasdist.horovod.tensorflow.keras as hvd

    hvd.init()
    if hvd.rank() == 0:
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), loss="mse")
        model.save("hvd_model.keras")
    kerasdist.barrier()  # the file is written before any rank reads it
    loaded = hvd.load_model("hvd_model.keras")
    print(type(loaded.optimizer).__name__)  # DistributedOptimizer
    ```
    """
    objects = dict(custom_objects or {})
    objects.update({optimizer.__name__: optimizer for optimizer in custom_optimizers or ()})
    model = keras.saving.load_model(filepath, custom_objects=objects)
    if model.optimizer is not None and not isinstance(model.optimizer, _hvd._KerasdistOptimizer):
        model.optimizer = _hvd.DistributedOptimizer(model.optimizer, compression=compression)
    return model
