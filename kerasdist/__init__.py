"""kerasdist: data-parallel Keras 3 / TensorFlow training over MPI."""
from kerasdist.runtime import (cross_rank, cross_size, init, is_initialized, local_rank, local_size, mpi_built,
                               nccl_built, rank, shutdown, size)
from kerasdist.ops import (Average, Compression, Max, Min, Product, ReduceOp, Sum, allgather, allgather_object,
                           allreduce, alltoall, barrier, broadcast, broadcast_object, broadcast_variables,
                           grouped_allreduce, reducescatter)

__version__ = "0.1.0"
