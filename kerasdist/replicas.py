"""The invariant of data-parallel training, checked: every rank holds the same model.

Each rank computes, for its epoch, each optimizer's step count and learning rate, and an exact
fingerprint of every variable the ranks must share (model and optimizers); one allreduce of three
numbers (their count and 64-bit digests of what they are and of their values: each number's
maximum, and its complement's) tells every rank whether all ranks hold the same. Only when they
do not does anything more cross the network: each value's maximum and minimum, to find the ones
that differ, then what each rank holds of the first of them, to name them in the error.
"""

import fnmatch
import hashlib
import struct
import warnings

import keras
import numpy as np
import tensorflow as tf

from kerasdist import _compat, ops, runtime, training_state
from kerasdist.layers import SyncBatchNormalization

ON_DIVERGENCE = ("raise", "warn")
# How many differing values an error names with every rank's values; it counts the rest.
_NAMED_DIFFERENCES = 3


class ReplicaDivergenceError(RuntimeError):
    """The ranks no longer hold the same training state: each would go on training its own model.

    `check_replicas` raises it on every rank, naming the first variable that differs and the
    ranks that hold which value.

    Example:

    ```python
    import keras, kerasdist

    kerasdist.init()
    weight = keras.Variable([float(kerasdist.rank())], name="weight")  # a different value on each rank
    try:
        kerasdist.check_replicas(weight)
        outcome = "alike"
    except kerasdist.ReplicaDivergenceError:
        outcome = "diverged"
    print(outcome == ("alike" if kerasdist.size() == 1 else "diverged"))  # True
    ```
    """


class _Entry:
    """One value every rank must hold alike: what it is (in rank `root`'s words), its kind, the
    value as an int64, and, for a variable, the variable (to measure how far ranks are apart)."""

    def __init__(self, what, kind, value, variable=None, shown=None):
        self.what, self.kind, self.value, self.variable = what, kind, value, variable
        self.shown = str(value) if shown is None else shown


def check_replicas(*objects, epoch=None, per_rank=(), on_divergence="raise", when=""):
    """Raises `ReplicaDivergenceError` on every rank when the ranks' training states differ.

    A collective: every rank calls it at the same point, with the same objects. It compares,
    exactly, the `epoch` (when given), each optimizer's `iterations` and learning rate, and every
    variable that data parallelism keeps equal on every rank: for a Keras model, its variables and
    those of each of its optimizers (`model.optimizer`, and optimizers held as attributes); for an
    optimizer, its own; a variable stands for itself. Left out, as each rank's own by design:
    dropout seed states, the moving statistics of a plain `keras.layers.BatchNormalization`
    (`SyncBatchNormalization`'s are global and checked), a `DistributedOptimizer`'s partial sums and
    held gradients, and the variables `per_rank` names. On one rank it does nothing.

    Args:
        *objects: Keras models, optimizers or variables (or lists of them).
        epoch: the epoch every rank should be in, or None.
        per_rank: variables, or patterns of variable paths (`fnmatch`, e.g. `"*/running_count"`),
            whose values are meant to differ between ranks.
        on_divergence: "raise" (default) or "warn" (a warning on every rank, naming the same).
        when: words for the message, e.g. "at the end of epoch 3".

    Example:

    A custom loop that checks after each epoch (`fit` with `kerasdist.callbacks()` checks by itself):

    ```python
    import keras, kerasdist, numpy as np, tensorflow as tf
    kerasdist.init()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.1))
    kerasdist.broadcast_variables(model.variables, root_rank=0)
    x, y = np.ones((4, 3), "float32"), np.ones((4, 1), "float32")
    for epoch in range(2):
        with kerasdist.DistributedGradientTape(tf.GradientTape()) as tape:
            loss = keras.ops.mean((model(x) - y) ** 2)
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        kerasdist.check_replicas(model, optimizer, epoch=epoch)  # returns: the ranks agree
    print(int(optimizer.iterations.numpy()))  # 2
    ```
    """
    if on_divergence not in ON_DIVERGENCE:
        raise ValueError(f"on_divergence={on_divergence!r}: expected one of {', '.join(ON_DIVERGENCE)}")
    models, optimizers, variables = _sorted_out(objects)
    if runtime.state().size == 1:
        return
    entries = _entries(models, optimizers, variables, epoch, per_rank)
    layout = "\n".join(f"{entry.kind} {_layout_of(entry)}" for entry in entries).encode()
    values = np.array([entry.value for entry in entries], np.int64)
    # One small allreduce in the common case: equal digests mean equal layouts and values (a
    # 64-bit hash: two different states collide with a chance of 2**-64).
    summary = np.array([len(entries), _digest(layout), _digest(values.tobytes())], np.int64)
    highest, lowest = _highest_and_lowest(summary, "kerasdist.replica_check")
    if (highest == lowest).all():
        return
    if (highest[:2] != lowest[:2]).any():
        _diverged(_layout_difference(entries, when), on_divergence)
        return
    highest, lowest = _highest_and_lowest(values, "kerasdist.replica_check.values")
    differing = np.flatnonzero(highest != lowest)
    _diverged(_value_difference(entries, differing, when), on_divergence)


def replicated_variables(model, per_rank=()):
    """The model's variables that every rank must hold alike: `model_state_variables` without
    the moving statistics of plain `BatchNormalization` layers (each rank's own batches feed
    them) and without those `per_rank` names."""
    own_statistics = set()
    for layer in _compat.all_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization) and not isinstance(layer, SyncBatchNormalization):
            own_statistics.update(id(v) for v in (layer.moving_mean, layer.moving_variance))
    return [
        v
        for v in training_state.model_state_variables(model)
        if id(v) not in own_statistics and not _named(v, per_rank)
    ]


def _named(variable, per_rank):
    path = getattr(variable, "path", variable.name)
    return any(fnmatch.fnmatchcase(path, item) if isinstance(item, str) else item is variable for item in per_rank)


def _sorted_out(objects):
    """(models, optimizers, variables) among `objects`, in order."""
    models, optimizers, variables = [], [], []
    for item in tf.nest.flatten(list(objects)):
        if isinstance(item, keras.Model):
            models.append(item)
        elif isinstance(item, keras.optimizers.Optimizer):
            optimizers.append(item)
        elif isinstance(item, (tf.Variable, keras.Variable)):
            variables.append(item)
        else:
            raise TypeError(f"check_replicas({item!r}): expected Keras models, optimizers or variables")
    return models, optimizers, variables


def _entries(models, optimizers, variables, epoch, per_rank):
    entries = [] if epoch is None else [_Entry("the epoch", "epoch", int(epoch), shown=str(int(epoch) + 1))]
    optimizers = [optimizer for model in models for optimizer in training_state.optimizers_of(model)] + optimizers
    variables = [v for model in models for v in replicated_variables(model, per_rank)] + variables
    names = [optimizer.name for optimizer in optimizers]
    for index, optimizer in enumerate(optimizers):
        name = optimizer.name if names.count(optimizer.name) == 1 else f"{optimizer.name} #{index}"
        if not optimizer.built:
            continue
        entries.append(_Entry(f"the step count of optimizer '{name}'", "iterations", int(optimizer.iterations.numpy())))
        rate = np.asarray(optimizer.learning_rate)[()]
        entries.append(
            _Entry(f"the learning rate of optimizer '{name}'", "learning rate", _bits(float(rate)), shown=str(rate))
        )
        # The counters and rates are compared above, by name; each rank's own state is left out.
        left_out = {id(v) for v in training_state.optimizer_per_rank_variables(optimizer) + _counters(optimizer)}
        variables += [v for v in optimizer.variables if id(v) not in left_out and not _named(v, per_rank)]
    unique = list({id(v): v for v in variables}.values())
    for variable, fingerprint in zip(unique, _fingerprints(unique)):
        path = getattr(variable, "path", variable.name)
        entries.append(_Entry(f"variable '{path}'", "variable", int(fingerprint), variable=variable))
    return entries


def _counters(optimizer):
    """The step counters and learning-rate variables of `optimizer` and the optimizers it wraps."""
    counters = []
    while optimizer is not None:
        counters += [optimizer.iterations, _compat.learning_rate_object(optimizer)]
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return counters


def _digest(data):
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _bits(number):
    return struct.unpack("<q", struct.pack("<d", number))[0]


def _layout_of(entry):
    if entry.variable is None:
        return ""
    return f"{list(entry.variable.shape)} {keras.backend.standardize_dtype(entry.variable.dtype)}"


_fingerprint_functions = {}


def differing_variables(variables, name):
    """The `variables` whose values are not the same on every rank, the same list on every rank.
    A collective: every rank passes variables of the same shapes in the same order (one pass over
    them and one allreduce of two numbers a variable)."""
    if runtime.state().size == 1 or not variables:
        return []
    highest, lowest = _highest_and_lowest(np.asarray(_fingerprints(variables), np.int64), name)
    return [variable for variable, high, low in zip(variables, highest, lowest) if high != low]


# An odd 64-bit constant (2**64 / the golden ratio, as int64) that spreads the positional sum.
_SPREAD = -0x61C8864680B583EB


def _fingerprint(variable):
    """An exact fingerprint of a variable's values: the sum of their bit patterns, and the sum of
    each pattern times its position, combined. Equal values give equal fingerprints whatever order
    a rank adds in (integer sums wrap alike); a changed value, or two values swapped, changes it,
    but for 64-bit sums that collide by chance."""
    bits = tf.reshape(tf.cast(_bit_patterns(variable), tf.int64), [-1])
    positions = tf.range(1, tf.size(bits, out_type=tf.int64) + 1)
    return tf.bitwise.bitwise_xor(tf.reduce_sum(bits), tf.reduce_sum(bits * positions) * _SPREAD)


def _bit_patterns(variable):
    value = tf.convert_to_tensor(variable)
    if value.dtype.is_floating:  # float64 becomes pairs of int32
        return tf.bitcast(value, tf.int16 if value.dtype.size == 2 else tf.int32)
    return value


def _fingerprints(variables):
    """Every variable's `_fingerprint`, from one traced function per list of variables: a model's
    hundreds of variables cost one call, not hundreds of ops."""
    if not variables:
        return []
    key = tuple(id(v) for v in variables)
    function = _fingerprint_functions.get(key)
    if function is None:
        _fingerprint_functions.clear()  # the variables of the last list checked are kept alive here
        function = tf.function(lambda: tf.stack([_fingerprint(v) for v in variables]), autograph=False)
        _fingerprint_functions[key] = function
    return function().numpy()


def _highest_and_lowest(values, name):
    """Every rank's highest and lowest of each value, from one allreduce: the lowest is the
    complement of the highest complement (complements cannot overflow, negations can)."""
    both = ops.allreduce(tf.constant(np.concatenate([values, ~values])), op=ops.Max, name=name).numpy()
    return both[: len(values)], ~both[len(values) :]


def _layout_difference(entries, when):
    every_rank = ops.allgather_object([(e.what, e.kind, _layout_of(e)) for e in entries])
    root = every_rank[0]
    for rank, theirs in enumerate(every_rank[1:], start=1):
        if [entry[1:] for entry in theirs] == [entry[1:] for entry in root]:
            continue
        if len(theirs) != len(root):
            difference = f"rank 0 has {len(root)} values to compare, rank {rank} has {len(theirs)}"
        else:
            at = next(i for i, (a, b) in enumerate(zip(root, theirs)) if a[1:] != b[1:])
            difference = f"rank 0 has {root[at][0]} {root[at][2]}, rank {rank} has {theirs[at][0]} {theirs[at][2]}"
        break
    return (
        f"kerasdist: the ranks no longer hold the same model{_when(when)}: {difference}. Build the same "
        "model and optimizers on every rank, and check the same objects on every rank."
    )


def _value_difference(entries, differing, when):
    named = [entries[i] for i in differing[:_NAMED_DIFFERENCES]]
    own = []
    for index, entry in zip(differing, named):
        if entry.variable is None:
            own.append(entry.shown)
        else:
            root_value = ops.broadcast(
                tf.convert_to_tensor(entry.variable), root_rank=0, name=f"kerasdist.replica_check.values#{index}"
            )
            distance = np.max(np.abs(np.asarray(entry.variable, np.float64) - np.asarray(root_value, np.float64)))
            own.append("rank 0's values" if distance == 0 else f"values up to {distance:.3g} from rank 0's")
    every_rank = ops.allgather_object(own)
    described = [
        f"{entry.what}: {_grouped([held[i] for held in every_rank], entry.kind)}" for i, entry in enumerate(named)
    ]
    more = len(differing) - len(named)
    others = f"; {more} more of the {len(entries)} values compared differ too" if more else ""
    return (
        f"kerasdist: the ranks no longer hold the same training state{_when(when)}, so each would go on "
        f"training its own model. {'; '.join(described)}{others}. {_HINTS[named[0].kind]} To find where it "
        "starts, check more often (KERASDIST_REPLICA_CHECK=N checks every N steps); KERASDIST_REPLICA_CHECK=off "
        "turns the check off."
    )


def _grouped(held, kind):
    """'rank 0 has A; ranks 1, 2 have B': ranks grouped by what they hold, in rank order."""
    groups = {}
    for rank, value in enumerate(held):
        groups.setdefault(value, []).append(rank)
    parts = []
    for value, ranks in groups.items():
        who = f"rank {ranks[0]} has" if len(ranks) == 1 else f"ranks {_ranks(ranks)} have"
        parts.append(f"{who} {value}" if kind != "epoch" else f"{who} epoch {value}")
    return ", ".join(parts)


def _ranks(ranks):
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _when(when):
    return f" {when}" if when else ""


_HINTS = {
    "epoch": (
        "A callback that resumes training from a backup (BackupAndRestore, or one of your own) ran on some "
        "ranks only, or found different backups: give every rank the same callbacks, or resume with "
        "kerasdist.callbacks(checkpoint_dir=..., resume=True), which resumes every rank from rank 0's checkpoint."
    ),
    "iterations": (
        "Some ranks applied updates the others did not: an optimizer's apply() ran on some ranks only, or a "
        "resume restored the optimizer on some ranks only."
    ),
    "learning rate": (
        "A callback changed the learning rate on some ranks only: one that only some ranks have, or one that "
        "decides from each rank's own metrics (ReduceLROnPlateau needs kerasdist.callbacks.MetricAverage, "
        "which kerasdist.callbacks(average_metrics=True) includes)."
    ),
    "variable": (
        "Weights changed on some ranks only: a callback or your own code set them from per-rank information "
        "(EarlyStopping(restore_best_weights=True) on each rank's own metrics, set_weights or load_weights on "
        "one rank), a variable was assigned outside the optimizer, or a layer keeps state that is each rank's "
        "own by design (pass it as per_rank= to leave it unchecked)."
    ),
}


def _diverged(message, on_divergence):
    if on_divergence == "raise":
        raise ReplicaDivergenceError(message)
    warnings.warn(message, stacklevel=3)
