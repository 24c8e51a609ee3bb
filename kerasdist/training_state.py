"""The state every rank must share: model variables and optimizer variables.

Used by the callbacks (broadcast, checkpoint resume) and by the Estimator."""

import warnings

import keras
import numpy as np
import tensorflow as tf

from kerasdist import ops, runtime


def build_optimizer(model):
    """Creates the optimizer's variables now if Keras has not yet (it defers them to the first
    step); True when they exist afterwards. A model that is not built yet cannot be helped."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return True
    if not optimizer.built and model.built and model.trainable_variables:
        optimizer.build(model.trainable_variables)
    return optimizer.built


def model_state_variables(model):
    """The model's variables that every rank must share, in the same order on every rank.

    Random-seed states (`SeedGenerator`, used by dropout) stay per rank: ranks should draw
    different dropout masks, as different samples of one large batch would.
    """
    return [v for v in model.variables if not v.path.endswith("seed_generator_state")]


def optimizers_of(model):
    """The model's optimizers, in the same order on every rank: `model.optimizer`, then any
    optimizer the model holds as an attribute (a GAN's `compile` keeps one per sub-model), by
    attribute name."""
    found = {}
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer):
        found[id(optimizer)] = optimizer
    for _, value in sorted(vars(model).items()):
        if isinstance(value, keras.optimizers.Optimizer):
            found.setdefault(id(value), value)
    return list(found.values())


def training_state_variables(model):
    """`model_state_variables(model)`, then the variables of each of the model's optimizers that
    is built (`optimizers_of`)."""
    variables = model_state_variables(model)
    for optimizer in optimizers_of(model):
        if optimizer.built:
            variables += list(optimizer.variables)
    return variables


def optimizer_per_rank_variables(optimizer):
    """The variables of `optimizer` whose values differ between ranks (a `DistributedOptimizer`'s
    partial sums, held gradients, 1-bit residuals), also under a wrapper such as Keras's
    `LossScaleOptimizer`; empty for other optimizers or before the optimizer is built."""
    while optimizer is not None and not hasattr(optimizer, "per_rank_variables"):
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return [] if optimizer is None else optimizer.per_rank_variables()


def per_rank_variables(model):
    """`optimizer_per_rank_variables` of `model.optimizer`."""
    return optimizer_per_rank_variables(getattr(model, "optimizer", None))


def reset_per_rank_state(model):
    """Starts the per-rank optimizer state afresh (see `DistributedOptimizer.reset_per_rank_state`)."""
    optimizer = getattr(model, "optimizer", None)
    while optimizer is not None and not hasattr(optimizer, "reset_per_rank_state"):
        optimizer = getattr(optimizer, "inner_optimizer", None)
    if optimizer is not None:
        optimizer.reset_per_rank_state()


def variables_layout(variables):
    """[shape, dtype] of each variable: what two lists must share for values to move between them."""
    return [[list(v.shape), str(v.dtype)] for v in variables]


# What each kind of per-rank variable (named in DistributedOptimizer.build) holds, for messages.
_PER_RANK_KINDS = (
    ("gradient_sum", "the partial gradient sums of backward_passes_per_step"),  # and held rows
    ("delayed_gradient", "the gradients delay_gradients holds"),
    ("one_bit_residual", "the residuals of one_bit_gradients"),
)


def describe_per_rank_state(variables):
    """What `variables` (from `per_rank_variables`) hold, in words."""
    kinds = [words for suffix, words in _PER_RANK_KINDS if any(v.name.endswith(suffix) for v in variables)]
    return ", ".join(kinds) or "per-rank optimizer variables"


def gather_per_rank_state(variables, root_rank, name):
    """Every rank's values of `variables`, gathered on `root_rank` (a collective): there a uint8
    array whose row r holds rank r's values, byte for byte, in order; None on the other ranks.

    A variable without a fixed first dimension (a window's held embedding-gradient rows) comes
    after its row count, an int64; as such rows differ in length between ranks, each is padded with
    zeros to the longest (one more collective, only for such variables)."""
    size = runtime.state().size
    own = _encoded(variables)
    if not all(_has_fixed_shape(v) for v in variables):
        lengths = ops.allgather(tf.constant([own.size], tf.int64), name=f"{name}.lengths")
        own = np.pad(own, (0, int(np.max(lengths.numpy())) - own.size))
    to_root = [1 if rank == root_rank else 0 for rank in range(size)]
    rows = ops.alltoall(tf.constant(own[np.newaxis]), splits=to_root, name=name)
    return rows.numpy() if runtime.state().rank == root_rank else None


def scatter_per_rank_state(variables, rows, root_rank, name):
    """Assigns to `variables` on every rank its own row of `rows` (a collective; `rows` as
    `gather_per_rank_state` returns it, needed on `root_rank` only)."""
    state = runtime.state()
    if all(_has_fixed_shape(v) for v in variables):
        row_bytes = sum(v.numpy().nbytes for v in variables)
    else:  # rows padded to a length only the root knows
        width = tf.constant([rows.shape[1] if state.rank == root_rank else 0], tf.int64)
        row_bytes = int(ops.broadcast(width, root_rank, name=f"{name}.width").numpy()[0])
    if state.rank == root_rank:
        sent, splits = tf.constant(rows), [1] * state.size
    else:
        sent, splits = tf.zeros([0, row_bytes], tf.uint8), [0] * state.size
    own = ops.alltoall(sent, splits=splits, name=name).numpy().reshape(-1)
    for variable, value in zip(variables, _decoded(variables, own), strict=True):
        variable.assign(value)


def per_rank_rows_problem(rows, variables, size):
    """What is wrong with `rows` (read from a checkpoint) as `gather_per_rank_state` of
    `variables` at `size` ranks would give them, in words; None when nothing is."""
    if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[0] != size:
        return f"holds {rows.dtype} {rows.shape}, not a uint8 row for each of {size} ranks"
    fixed = all(_has_fixed_shape(v) for v in variables)
    for rank, row in enumerate(rows):
        needed = _encoded_length(variables, row)
        if needed is None or needed > row.size or (fixed and needed != row.size):
            return f"holds a row for rank {rank} of {row.size} bytes that does not fit these variables"
    return None


def _has_fixed_shape(variable):
    return None not in tuple(variable.shape)


def _encoded(variables):
    """`variables`' values as bytes, in order, each variable without a fixed shape after its row count."""
    parts = [np.zeros(0, np.uint8)]
    for variable in variables:
        value = np.ascontiguousarray(variable.numpy())
        if not _has_fixed_shape(variable):
            parts.append(np.array([len(value)], "<i8").view(np.uint8))
        parts.append(value.reshape(-1).view(np.uint8))
    return np.concatenate(parts)


def _layout(variables, row):
    """(dtype, shape, offset) of each variable's values in `row` (an `_encoded` row, maybe padded);
    None where a row count points past the row's end."""
    at, placed = 0, []
    for variable in variables:
        current = variable.numpy()
        shape = current.shape
        if not _has_fixed_shape(variable):
            if at + 8 > row.size:
                return None
            count = int(row[at : at + 8].view("<i8")[0])
            if count < 0:
                return None
            shape = (count, *shape[1:])
            at += 8
        placed.append((current.dtype, shape, at))
        at += int(np.prod(shape)) * current.dtype.itemsize
    return placed, at


def _encoded_length(variables, row):
    laid_out = _layout(variables, row)
    return None if laid_out is None else laid_out[1]


def _decoded(variables, row):
    """The values of `variables` that `row` (an `_encoded` row, maybe padded) holds."""
    placed, _ = _layout(variables, row)
    return [
        row[at : at + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape) for dtype, shape, at in placed
    ]


def broadcast_training_state(model, root_rank=0):
    """Gives every rank `root_rank`'s model and optimizer variables (a collective)."""
    if runtime.state().size > 1:
        ops.broadcast_variables(training_state_variables(model), root_rank=root_rank)


def turn_off_xla(model):
    """kerasdist's ops have no XLA kernels: a model compiled with jit_compile=True is switched
    to jit_compile=False (with one warning) before Keras traces its functions."""
    if getattr(model, "jit_compile", False):
        warnings.warn(
            "kerasdist: the model was compiled with jit_compile=True; kerasdist's collectives "
            "cannot run under XLA, so it now runs with jit_compile=False",
            stacklevel=3,
        )
        model.jit_compile = False
        model.train_function = model.test_function = model.predict_function = None
